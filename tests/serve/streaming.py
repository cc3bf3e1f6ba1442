"""A streaming completion read the way a client sees it: chunks, the replica that served it (system_fingerprint),
the finish reason, an SSE error event, [DONE]. Shared by the replica tests and the drills."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamResult:
    status: int = 0
    chunks: int = 0
    tokens: int = 0  # from the usage chunk
    replica: str | None = None
    finish_reason: str | None = None
    error: dict | None = None
    done: bool = False
    events: list[str] = field(default_factory=list)


def stream_completion(url: str, prompt: str, max_tokens: int,
                      on_first_chunk: Callable[[str], None] | None = None,
                      timeout_s: float = 90.0) -> StreamResult:
    result = StreamResult()
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as resp:
        result.status = resp.status_code
        if resp.status_code != 200:
            resp.read()
            result.error = resp.json().get("error")
            return result
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                result.error = event["error"]
                continue
            if result.replica is None and on_first_chunk is not None:
                on_first_chunk(event.get("system_fingerprint"))
            result.replica = result.replica or event.get("system_fingerprint")
            if event.get("usage"):  # the last chunk: no choices, the token count
                result.tokens = event["usage"]["completion_tokens"]
                continue
            result.chunks += 1  # a chunk may carry several tokens (a stream that fell behind catches up)
            result.finish_reason = event["choices"][0]["finish_reason"] or result.finish_reason
    return result
