"""Stream multiplexing's two ends without Ray (router/mux.py, router/streams.py): the replica's batches, and the
ingress putting records from two paths back in order. The real path is tested in tests/serve/test_api.py."""
from __future__ import annotations

import asyncio

import pytest

from conveyor.router.mux import SEQ_KEY, StreamMux
from conveyor.router.streams import StartedStream
from conveyor.serving.outputs import RequestOutput


def out(request_id: str, text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, text, [len(text)], text, [], 3, finished, "length" if finished else None)


def test_a_batch_holds_every_waiting_stream_once_merged_and_numbered() -> None:
    async def run() -> None:
        mux = StreamMux()
        mux.attach("a", "a/0/0")
        mux.attach("b", "b/0/0")
        for o in (out("a", "x"), out("b", "1"), out("a", "y")):
            mux.put(o)
        first = await mux.take(1.0)
        assert [(k, s, o.delta_text) for k, s, o in first] == [("a/0/0", 1, "xy"), ("b/0/0", 1, "1")]
        mux.put(out("b", "2", finished=True))
        second = await mux.take(1.0)
        assert [(k, s, o.finished) for k, s, o in second] == [("b/0/0", 2, True)]
        await asyncio.wait_for(mux.wait_final_taken("b"), 1.0)  # b is done; a is not
        assert not mux._attached["a"].final_taken.is_set()
        assert await mux.take(0.05) is None  # nothing waiting: the subscription may end if nobody is attached
        mux.put(out("a", "z"))
        assert mux.detach("a") == ([out("a", "z")], 2)  # a's client left: what waited comes back with its seq
        mux.put(out("a", "late"))
        assert await mux.take(0.05) == []  # a detached: its late output goes nowhere
        mux.close()
        assert mux.closed

    asyncio.run(run())


def test_closing_releases_every_attached_stream() -> None:
    async def run() -> None:
        mux = StreamMux()
        mux.attach("a", "a/0/0")
        waiting = asyncio.ensure_future(mux.wait_final_taken("a"))
        await asyncio.sleep(0)
        mux.close()
        await asyncio.wait_for(waiting, 1.0)

    asyncio.run(run())


class OwnStream:
    """The request's own Serve stream as the ingress sees it: records, then the end (or a failure)."""

    def __init__(self, records: list[dict], error: Exception | None = None) -> None:
        self._records, self._error, self.cancelled = records, error, False

    def __aiter__(self):  # noqa: ANN204
        return self._gen()

    async def _gen(self):  # noqa: ANN202
        for record in self._records:
            await asyncio.sleep(0)
            yield record
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        self.cancelled = True


def read(own: OwnStream, muxed: list[tuple[int, dict]]) -> list[dict]:
    async def run() -> list[dict]:
        queue: asyncio.Queue = asyncio.Queue()
        for item in muxed:
            queue.put_nowait(item)
        released = []
        stream = StartedStream({"text": "a", SEQ_KEY: 0}, own, queue, lambda: released.append(True))
        records = [r async for r in stream.records()]
        assert released == [True]
        return records

    return asyncio.run(run())


def test_records_from_the_subscription_and_the_own_stream_come_back_in_order() -> None:
    muxed = [(2, {"text": "c"}), (1, {"text": "b"})]  # batches from two messages, overtaking each other
    own = OwnStream([{"text": "d", SEQ_KEY: 3}, {"text": "e", SEQ_KEY: 4, "finish_reason": "length"}])  # fallback
    assert [r["text"] for r in read(own, muxed)] == ["a", "b", "c", "d", "e"]


def test_a_failing_own_stream_fails_the_read() -> None:
    with pytest.raises(RuntimeError, match="replica died"):
        read(OwnStream([], RuntimeError("replica died")), [(1, {"text": "b"})])


def test_a_record_that_never_comes_is_an_error_not_a_hang(monkeypatch) -> None:
    from conveyor.router import streams

    monkeypatch.setattr(streams, "MUXED_TAIL_TIMEOUT_S", 0.1)
    with pytest.raises(RuntimeError, match="never arrived"):
        read(OwnStream([]), [(2, {"text": "c", "finish_reason": "length"})])  # seq 1 lost
