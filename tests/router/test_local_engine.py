"""LocalEngineHandle (conveyor/router/local_engine.py): a replica object in the ingress process, read as Serve's
DeploymentHandle is read by streams.py and ingress.py. A small fake replica stands in for EngineReplica here; the
real one runs in the ingress under `conveyor serve` (tests/router/test_cli_serve.py)."""
from __future__ import annotations

import asyncio

import pytest

from conveyor.router.local_engine import LocalEngineHandle


class FakeReplica:
    def __init__(self) -> None:
        self.closed: list[str] = []
        self.release = asyncio.Event()

    async def generate(self, request: dict):
        try:
            for i in range(request["n"]):
                if request.get("fail_at") == i:
                    raise ValueError("engine said no")
                if request.get("wait_at") == i:
                    await self.release.wait()
                yield {"token": i}
        finally:
            self.closed.append(request["id"])  # EngineReplica's `finally` aborts the engine request here

    async def ready(self) -> dict:
        return {"replica": "here"}

    def engine_state(self) -> dict:
        return {"num_running": 0}


async def _read(stream) -> list:
    return [record async for record in stream]


def test_records_arrive_in_order_and_the_generator_closes() -> None:
    async def main() -> None:
        replica = FakeReplica()
        handle = LocalEngineHandle(replica)
        records = await _read(handle.options(stream=True).generate.remote({"id": "a", "n": 4}))
        assert records == [{"token": i} for i in range(4)]
        assert replica.closed == ["a"]
        assert await handle.ready.remote() == {"replica": "here"}
        assert await handle.engine_state.remote() == {"num_running": 0}  # a plain method, as Serve allows

    asyncio.run(main())


def test_an_error_reaches_the_reader_after_the_records_before_it() -> None:
    async def main() -> None:
        stream = LocalEngineHandle(FakeReplica()).options(stream=True).generate.remote(
            {"id": "b", "n": 4, "fail_at": 2})
        assert [await anext(stream), await anext(stream)] == [{"token": 0}, {"token": 1}]
        with pytest.raises(ValueError, match="engine said no"):
            await anext(stream)

    asyncio.run(main())


def test_cancel_closes_the_generator_while_a_read_waits() -> None:
    """The ingress cancels a stream whose client left, also while a read is under way (sse_body's `finally`)."""
    async def main() -> None:
        replica = FakeReplica()
        stream = LocalEngineHandle(replica).options(stream=True).generate.remote({"id": "c", "n": 4, "wait_at": 1})
        assert await anext(stream) == {"token": 0}
        reader = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert replica.closed == ["c"]  # the engine request was let go
        stream.cancel()  # twice: nothing happens

    asyncio.run(main())


def test_a_local_stream_has_no_assignment_wait() -> None:
    """streams.py waits on a Serve generator's `_fetch_future_result_async` (no replica took it: a 503); in process
    there is nothing to wait for, and the handle has no private names either."""
    async def main() -> None:
        handle = LocalEngineHandle(FakeReplica())
        stream = handle.options(stream=True).generate.remote({"id": "d", "n": 1})
        assert getattr(stream, "_fetch_future_result_async", None) is None
        assert await _read(stream) == [{"token": 0}]
        with pytest.raises(AttributeError):
            handle._fetch_future_result_async  # noqa: B018

    asyncio.run(main())
