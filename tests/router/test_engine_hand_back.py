"""The ingress side of an engine-process death (issue 39 item 5): a replica answers a request it could not start with
a hand-back record, and start_stream sends the request again (router/streams.py); a request that is not streamed
and is cut mid-generation starts over (read_whole). A fake handle stands in for Serve's
DeploymentHandle: this checks the one layer, the drill tests/drills/test_engine_kill.py the whole path."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import RayActorError

from conveyor.router import streams
from conveyor.router.drain import HAND_BACK
from conveyor.router.errors import ApiError


class _Gen:
    def __init__(self, records: list[dict[str, Any]]) -> None:
        self._records = iter(records)
        self.cancelled = False

    def __aiter__(self) -> _Gen:
        return self

    async def __anext__(self) -> dict[str, Any]:
        try:
            record = next(self._records)
        except StopIteration:
            raise StopAsyncIteration from None
        if isinstance(record, Exception):
            raise record
        return record

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


def _token(text: str, finish_reason: str | None = None) -> dict[str, Any]:
    return {"text": text, "num_tokens": 1, "finish_reason": finish_reason}


def _read_whole(handle: _Handle, handed_back: list[int]) -> list[dict[str, Any]]:
    request = {"request_id": "r3", "stream": False}

    async def read() -> list[dict[str, Any]]:
        first = await streams.start_stream(handle, request, 5.0)
        return await streams.read_whole(first, lambda: streams.start_stream(handle, request, 5.0),
                                        on_hand_back=lambda: handed_back.append(1))

    return asyncio.run(read())


def test_an_unstreamed_request_cut_mid_generation_starts_over(monkeypatch) -> None:
    monkeypatch.setattr(streams, "ENGINE_GONE_BACKOFF_S", 0.0)
    handle = _Handle([[_token("a"), _token("b"), {"error": HAND_BACK, "message": "engine process stopped"}],
                      [_token("x"), _token("y", "length")]])
    handed_back: list[int] = []
    records = _read_whole(handle, handed_back)
    assert [r["text"] for r in records] == ["x", "y"]  # nothing of the first attempt
    assert handed_back == [1] and len(handle.sent) == 2 and handle.gens[0].cancelled


def test_an_unstreamed_request_whose_replica_dies_starts_over(monkeypatch) -> None:
    monkeypatch.setattr(streams, "ENGINE_GONE_BACKOFF_S", 0.0)
    handle = _Handle([[_token("a"), RayActorError()], [_token("x", "stop")]])
    handed_back: list[int] = []
    assert [r["text"] for r in _read_whole(handle, handed_back)] == ["x"]
    assert handed_back == [1] and len(handle.sent) == 2


def test_unstreamed_restarts_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(streams, "ENGINE_GONE_BACKOFF_S", 0.0)
    cut = [_token("a"), {"error": HAND_BACK, "message": "gone"}]
    handle = _Handle([cut] * (streams.MAX_HAND_BACKS + 1))
    with pytest.raises(ApiError):
        _read_whole(handle, [])
    assert len(handle.sent) == streams.MAX_HAND_BACKS + 1
