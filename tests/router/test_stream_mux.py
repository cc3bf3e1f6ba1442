"""Stream multiplexing's two ends without Ray (router/mux.py, router/streams.py): the replica's batches, and the
ingress putting records from two paths back in order. The real path is tested in tests/router/test_api.py."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from conveyor.router.demux import SUBSCRIPTION_ENDED, Demux
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
        for item in muxed:  # (seq, record) pairs, or a marker such as SUBSCRIPTION_ENDED
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


def test_a_record_lost_with_its_subscription_fails_the_read_without_waiting(monkeypatch) -> None:
    """The replica died with a batch in flight: its subscription and the own stream both ended, so the read fails
    at once instead of after MUXED_TAIL_TIMEOUT_S (set here to an hour: waiting for it would fail wait_for)."""
    from conveyor.router import streams

    monkeypatch.setattr(streams, "MUXED_TAIL_TIMEOUT_S", 3600.0)
    lost = [(2, {"text": "c", "finish_reason": "length"}), SUBSCRIPTION_ENDED]  # seq 1 lost
    with pytest.raises(RuntimeError, match="lost with its replica's subscription"):
        asyncio.run(asyncio.wait_for(asyncio.to_thread(read, OwnStream([]), lost), 5.0))


def test_after_its_subscription_ends_a_stream_reads_on_from_its_own_stream() -> None:
    """The subscription went away while the request ran: the replica sends the rest on the own stream."""
    own = OwnStream([{"text": "c", SEQ_KEY: 2}, {"text": "d", SEQ_KEY: 3, "finish_reason": "stop"}])
    assert [r["text"] for r in read(own, [(1, {"text": "b"}), SUBSCRIPTION_ENDED])] == ["a", "b", "c", "d"]


class FakeSubscription:
    """A replica's `subscribe` stream as Demux sees it: its items, then a failure (the replica died). With
    answer_delay_s it has been taken by a replica at once (Serve's assignment hook) and answers that much later."""

    def __init__(self, items: list[dict], answer_delay_s: float | None = None) -> None:
        self._items = iter(items)
        self.cancelled = False
        self._answer_delay_s = answer_delay_s
        if answer_delay_s is not None:
            self._fetch_future_result_async = self._assigned

    async def _assigned(self) -> None:
        await asyncio.sleep(0)

    def __aiter__(self):  # noqa: ANN204
        return self

    async def __anext__(self) -> dict:
        await asyncio.sleep(self._answer_delay_s or 0)
        self._answer_delay_s = None
        item = next(self._items, None)
        if item is None:
            raise RuntimeError("replica died")
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """Only the call Demux makes: handle.options(stream=True).subscribe.remote(request)."""

    def __init__(self, subscription: FakeSubscription) -> None:
        self.subscribe = SimpleNamespace(remote=lambda request: subscription)

    def options(self, **_: object) -> FakeHandle:
        return self


def test_a_subscription_that_ends_tells_the_streams_it_carried() -> None:
    async def run() -> None:
        subscription = FakeSubscription([{"subscribed": "r1"}, {"batch": [("k1", 1, {"text": "b"})]}])
        demux = Demux(FakeHandle(subscription), "ingress-1")
        carried, elsewhere = demux.register("k1"), demux.register("k2")
        demux.bind("k1", "r1")
        demux.bind("k2", "r2")
        demux.ensure_subscribed("r1")
        assert await asyncio.wait_for(carried.get(), 5.0) == (1, {"text": "b"})
        assert await asyncio.wait_for(carried.get(), 5.0) is SUBSCRIPTION_ENDED
        assert elsewhere.empty() and subscription.cancelled

    asyncio.run(run())


def test_a_subscription_a_replica_has_taken_is_not_given_up_for_a_slow_answer(monkeypatch) -> None:
    """Cancelling it could lose a batch the replica already sent: only the wait for a replica is bounded."""
    from conveyor.router import demux as demux_module

    monkeypatch.setattr(demux_module, "OPEN_TIMEOUT_S", 0.05)

    async def run() -> None:
        subscription = FakeSubscription([{"subscribed": "r1"}, {"batch": [("k1", 1, {"text": "b"})]}],
                                        answer_delay_s=0.3)
        demux = Demux(FakeHandle(subscription), "ingress-1")
        queue = demux.register("k1")
        demux.bind("k1", "r1")
        demux.ensure_subscribed("r1")
        assert await asyncio.wait_for(queue.get(), 5.0) == (1, {"text": "b"})

    asyncio.run(run())
