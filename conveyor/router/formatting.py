"""Turn replica records (one small dict per engine delta) into OpenAI completion / chat bodies and SSE chunks.

A record is `{"text", "num_tokens", "prompt_tokens", ["finish_reason", "cached_tokens"], ["logprobs"]}`
(see conveyor/router/replica.py). One `ChoiceState` per choice accumulates what the non-streaming body needs.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from conveyor.router import tool_calls
from conveyor.router.protocol import Usage


@dataclass
class ChoiceState:
    index: int
    counts_prompt: bool  # n > 1 shares one prompt: count its tokens once in usage
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text_offset: int = 0

    def update(self, record: dict[str, Any]) -> None:
        self.text.append(record["text"])
        self.completion_tokens += record["num_tokens"]
        self.prompt_tokens = record["prompt_tokens"]
        self.finish_reason = record.get("finish_reason", self.finish_reason)
        if "logprobs" in record:
            self.logprobs = (self.logprobs or []) + record["logprobs"]


def usage_of(states: list[ChoiceState]) -> Usage:
    usage = Usage()
    for s in states:
        usage.add(s.prompt_tokens if s.counts_prompt else 0, s.completion_tokens)
    return usage


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Format:
    OBJECT = CHUNK_OBJECT = ""  # the body's `object`: a whole response's, a streamed chunk's

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.fingerprint: str | None = None  # the serving replica's id, so a client can tell replicas apart

    def _body(self, choices: list[dict], usage: Usage | None, *, chunk: bool) -> dict[str, Any]:
        body = {"id": self.request_id, "object": self.CHUNK_OBJECT if chunk else self.OBJECT,
                "created": int(time.time()), "model": self.model, "choices": choices,
                "system_fingerprint": self.fingerprint}
        if usage is not None or not chunk:
            body["usage"] = usage.model_dump() if usage else None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._body([], usage, chunk=True)


class CompletionFormat(_Format):
    """/v1/completions: `text` per choice, legacy logprobs (tokens / token_logprobs / top_logprobs)."""

    OBJECT = CHUNK_OBJECT = "text_completion"

    def logprobs(self, entries: list[dict[str, Any]] | None, state: ChoiceState) -> dict[str, Any] | None:
        if entries is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(state.text_offset)
            state.text_offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [dict(e["top"]) for e in entries], "text_offset": offsets}

    def chunk(self, state: ChoiceState, record: dict[str, Any], first: bool) -> list[dict[str, Any]]:
        choice = {"index": state.index, "text": record["text"],
                  "logprobs": self.logprobs(record.get("logprobs"), state),
                  "finish_reason": record.get("finish_reason")}
        return [self._body([choice], None, chunk=True)]

    def body(self, states: list[ChoiceState]) -> dict[str, Any]:
        choices = []
        for s in states:
            s.text_offset = 0
            choices.append({"index": s.index, "text": "".join(s.text),
                            "logprobs": self.logprobs(s.logprobs, s), "finish_reason": s.finish_reason})
        return self._body(choices, usage_of(states), chunk=False)


class ChatFormat(_Format):
    """/v1/chat/completions: an assistant message per choice, chat-style logprobs. With tools (tool_mode other
    than "none") the text goes through conveyor/router/tool_calls.py: `message.tool_calls` and, streamed,
    `delta.tool_calls`; finish_reason "tool_calls" when the answer made calls."""

    OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, tool_mode: str = "none", tool_names: tuple[str, ...] = (),
                 named_tool: str | None = None) -> None:
        super().__init__(request_id, model)
        self.tool_mode = tool_mode
        self.tool_names = tool_names
        self.named_tool = named_tool
        self._streamers: dict[int, tool_calls.ToolCallStreamer] = {}
        self._pending_logprobs: dict[int, list[dict[str, Any]]] = {}

    @staticmethod
    def logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        if entries is None:
            return None

        def item(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}

        return {"content": [{**item(e["token"], e["logprob"]),
                             "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]}

    def chunk(self, state: ChoiceState, record: dict[str, Any], first: bool) -> list[dict[str, Any]]:
        chunks = []
        if first:  # OpenAI opens each choice with a role-only delta; clients key on it
            role = {"index": state.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}
            chunks.append(self._body([role], None, chunk=True))
        if self.tool_mode != "none":
            return chunks + self._tool_chunks(state, record)
        choice = {"index": state.index, "delta": {"content": record["text"]},
                  "logprobs": self.logprobs(record.get("logprobs")),
                  "finish_reason": record.get("finish_reason")}
        chunks.append(self._body([choice], None, chunk=True))
        return chunks

    def _streamer(self, index: int) -> tool_calls.ToolCallStreamer:
        streamer = self._streamers.get(index)
        if streamer is None:
            streamer = self._streamers[index] = tool_calls.ToolCallStreamer(
                self.tool_mode, self.tool_names, self.named_tool)
        return streamer

    def _tool_chunks(self, state: ChoiceState, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Deltas from the tool-call parser; logprobs ride on the next delta sent (text may be held back)."""
        streamer = self._streamer(state.index)
        deltas = streamer.feed(record["text"])
        finish_reason = record.get("finish_reason")
        if finish_reason is not None:
            deltas += streamer.finish()
            finish_reason = tool_calls.finish_reason_for(streamer.calls, finish_reason)
            deltas = deltas or [{}]  # the finish reason needs a chunk of its own
        self._pending_logprobs.setdefault(state.index, []).extend(record.get("logprobs") or [])
        chunks = []
        for i, delta in enumerate(deltas):
            pending = self._pending_logprobs.pop(state.index, None) if i == 0 else None
            last = i == len(deltas) - 1
            choice = {"index": state.index, "delta": delta,
                      "logprobs": self.logprobs(pending) if pending else None,
                      "finish_reason": finish_reason if last else None}
            chunks.append(self._body([choice], None, chunk=True))
        return chunks

    def message(self, state: ChoiceState) -> tuple[dict[str, Any], str | None]:
        text = "".join(state.text)
        if self.tool_mode == "none":
            return {"role": "assistant", "content": text}, state.finish_reason
        if self.tool_mode == "auto":
            content, calls = tool_calls.parse_auto(text, self.tool_names)
        elif self.tool_mode == "required":
            content, calls = None, tool_calls.parse_required(text)
        else:
            content, calls = None, tool_calls.parse_named(self.named_tool or "", text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, tool_calls.finish_reason_for(len(calls), state.finish_reason or "stop")

    def body(self, states: list[ChoiceState]) -> dict[str, Any]:
        choices = []
        for s in states:
            message, finish_reason = self.message(s)
            choices.append({"index": s.index, "message": message, "logprobs": self.logprobs(s.logprobs),
                            "finish_reason": finish_reason})
        return self._body(choices, usage_of(states), chunk=False)
