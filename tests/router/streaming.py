"""A streaming completion read the way a client sees it: chunks, the replica that served it (system_fingerprint),
the finish reason, an SSE error event, [DONE]. Shared by the replica tests and the drills."""
from __future__ import annotations

import json
import threading
import time
from collections import Counter
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
    closed_early: bool = False  # the client hung up (close_when) before the stream ended
    events: list[str] = field(default_factory=list)


def stream_completion(url: str, prompt: str, max_tokens: int,
                      on_first_chunk: Callable[[str], None] | None = None,
                      timeout_s: float = 90.0, close_when: threading.Event | None = None) -> StreamResult:
    """close_when: once it is set the client hangs up after its next chunk, as a client that has seen enough."""
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
            if line.startswith("data: "):
                read_event(result, line[len("data: "):], on_first_chunk)
            # Hang up after reading a chunk, not before: a stream that waited in a queue until the moment its client
            # decided still reports the replica that started it (a full suite run once saw one with no replica).
            if close_when is not None and close_when.is_set() and not result.done:
                result.closed_early = True
                return result
    return result


def read_event(result: StreamResult, data: str, on_first_chunk: Callable[[str], None] | None) -> None:
    if data == "[DONE]":
        result.done = True
        return
    event = json.loads(data)
    if "error" in event:
        result.error = event["error"]
        return
    if result.replica is None and on_first_chunk is not None:
        on_first_chunk(event.get("system_fingerprint"))
    result.replica = result.replica or event.get("system_fingerprint")
    if event.get("usage"):  # the last chunk: no choices, the token count
        result.tokens = event["usage"]["completion_tokens"]
        return
    result.chunks += 1  # a chunk may carry several tokens (a stream that fell behind catches up)
    result.finish_reason = event["choices"][0]["finish_reason"] or result.finish_reason


class StreamStarts:
    """Counts streams by the replica their first chunk came from (pass `note` as on_first_chunk) and wakes a
    waiter once the counts satisfy its condition: kill or scale a replica while it is known to be streaming."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._changed = threading.Condition()

    def note(self, replica: str) -> None:
        with self._changed:
            self.counts[replica] += 1
            self._changed.notify_all()

    def wait_for(self, condition: Callable[[Counter[str]], bool], timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: condition(self.counts), timeout_s)


@dataclass
class Sample:
    start: float
    end: float
    result: StreamResult


def closed_loop(url: str, stop: threading.Event, samples: list[Sample], client: int, max_tokens: int) -> None:
    """One client sending back-to-back streams until told to stop (bounded by the test's timeout)."""
    i = 0
    while not stop.is_set():
        start = time.monotonic()
        result = stream_completion(url, f"client {client} request {i} " * 3, max_tokens)
        samples.append(Sample(start, time.monotonic(), result))
        i += 1
