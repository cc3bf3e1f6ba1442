"""The engine inside the ingress process: one replica's engine called in process, read through the same interface
as Serve's DeploymentHandle, so that the ingress code is the same whichever way its engine runs.

With one fixed engine replica, the replica's Ray worker only relays: every token crosses it (a pickled record,
a gRPC message, Serve's bookkeeping in both processes) and, idle, it spends ~0.01 of a core on Ray's signal-check
timer (RESULTS.md). Hosting the engine client (EngineReplica's class, not its Serve deployment) in the ingress
leaves the engine's child process as the only process between the HTTP socket and the model, as in `vllm serve`
(API server + EngineCore). Routing, autoscaling and hand-backs across replicas need the handle: this is for one.
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import AsyncIterator
from typing import Any

_END = object()


class LocalStream:
    """A replica generator run as its own task, read like Serve's DeploymentResponseGenerator: records in order,
    the generator's exception re-raised to the reader, and cancel() closing it (its `finally` aborts the engine
    request) whether or not a read is under way."""

    def __init__(self, records: AsyncIterator[dict[str, Any]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        # Its own context: the task outlives no request, but Serve's per-request context must not leak into it.
        self._task = asyncio.get_running_loop().create_task(self._pump(records), context=contextvars.Context())

    async def _pump(self, records: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for record in records:
                self._queue.put_nowait(record)
            self._queue.put_nowait(_END)
        except asyncio.CancelledError:
            self._queue.put_nowait(asyncio.CancelledError())
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self._queue.put_nowait(exc)
        finally:
            await records.aclose()

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # a second read ends too
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self._task.cancel()


class _Method:
    def __init__(self, target: Any, name: str, stream: bool) -> None:
        self._call = getattr(target, name)
        self._stream = stream

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self._stream:
            return LocalStream(self._call(*args, **kwargs))
        result = self._call(*args, **kwargs)
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        done = asyncio.get_running_loop().create_future()
        done.set_result(result)
        return done


class LocalEngineHandle:
    """`handle.options(stream=True).generate.remote(request)` and `await handle.ready.remote()` on an object in
    this process: the subset of DeploymentHandle the ingress uses (streams.py, ingress.py)."""

    def __init__(self, replica: Any, stream: bool = False) -> None:
        self.replica = replica
        self._stream = stream

    def options(self, *, stream: bool = False, **_: Any) -> LocalEngineHandle:
        return LocalEngineHandle(self.replica, stream)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self.replica, name, self._stream)
