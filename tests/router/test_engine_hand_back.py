"""The ingress side of an engine-process death (issue 39 item 5): a replica answers a request it could not start with
a hand-back record, and start_stream sends the request again (router/streams.py). A fake handle stands in for Serve's
DeploymentHandle: this checks the one layer, the drill tests/drills/test_engine_kill.py the whole path."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conveyor.router import streams
from conveyor.router.drain import HAND_BACK
from conveyor.router.errors import ApiError


class _Gen:
    def __init__(self, records: list[dict[str, Any]]) -> None:
        self._records = iter(records)
        self.cancelled = False

    async def __anext__(self) -> dict[str, Any]:
        try:
            return next(self._records)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    """Answers each call with the next scripted stream; records what was sent."""

    def __init__(self, streams_: list[list[dict[str, Any]]]) -> None:
        self._streams = iter(streams_)
        self.sent: list[dict[str, Any]] = []
        self.gens: list[_Gen] = []

    def options(self, **_: Any) -> _Handle:
        return self

    @property
    def generate(self) -> _Handle:
        return self

    def remote(self, request: dict[str, Any]) -> _Gen:
        self.sent.append(request)
        self.gens.append(_Gen(next(self._streams)))
        return self.gens[-1]


def test_a_hand_back_record_sends_the_request_elsewhere(monkeypatch) -> None:
    monkeypatch.setattr(streams, "ENGINE_GONE_BACKOFF_S", 0.0)
    handle = _Handle([[{"error": HAND_BACK, "message": "engine process stopped (exit code -9)"}],
                      [{"text": "hi", "num_tokens": 1, "replica": "b"}]])
    handed_back = []
    started = asyncio.run(streams.start_stream(handle, {"request_id": "r1", "stream": False}, 5.0,
                                               on_hand_back=lambda: handed_back.append(1)))
    assert started.first["text"] == "hi"
    assert len(handle.sent) == 2 and handed_back == [1]
    assert handle.gens[0].cancelled and not handle.gens[1].cancelled


def test_hand_backs_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(streams, "ENGINE_GONE_BACKOFF_S", 0.0)
    handle = _Handle([[{"error": HAND_BACK, "message": "gone"}]] * (streams.MAX_HAND_BACKS + 1))
    with pytest.raises(ApiError):
        asyncio.run(streams.start_stream(handle, {"request_id": "r2", "stream": False}, 5.0))
    assert len(handle.sent) == streams.MAX_HAND_BACKS + 1
