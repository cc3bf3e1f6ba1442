"""A request's replica streams written out to its client as server-sent events: the records of every choice as they
come (merge_records), one SSE chunk each, an error event when a replica fails mid-stream, and the replica streams
cancelled however the response ends (the client gone included)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse

from conveyor.router.errors import ApiError
from conveyor.router.formatting import ChatFormat, ChoiceState, CompletionFormat, sse, usage_of
from conveyor.router.streams import StartedStream

logger = logging.getLogger("ray.serve")  # Serve routes this logger into its replica log files


async def merge_records(streams: list[StartedStream]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(choice position, record) from every stream as they come; the first failure is raised."""
    if len(streams) == 1:  # the common case: no tasks, no queue
        async for record in streams[0].records():
            yield 0, record
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: StartedStream) -> None:
        try:
            async for record in stream.records():
                queue.put_nowait((i, record))
            queue.put_nowait((i, None))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def sse_body(started: list[StartedStream], states: list[ChoiceState],
                   fmt: ChatFormat | CompletionFormat, include_usage: bool,
                   on_cut: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    seen: set[int] = set()
    try:
        async for i, record in merge_records(started):
            states[i].update(record)
            for chunk in fmt.chunk(states[i], record, first=i not in seen):
                yield sse(chunk)
            seen.add(i)
        if include_usage:
            yield sse(fmt.usage_chunk(usage_of(states)))
    except Exception as exc:  # a replica died mid-stream: say so, then end the stream cleanly
        logger.warning("stream cut mid-way: %r", exc)
        if on_cut is not None:
            on_cut()
        error = ApiError.server("the replica serving this stream failed; the output is incomplete")
        yield sse({"error": error.info.model_dump()})
    finally:
        for s in started:  # also runs when the client disconnects: aborts the engine requests
            s.cancel()
    yield sse("[DONE]")


class ReplicaStreamingResponse(StreamingResponse):
    """SSE that cancels its replica streams however the response ends. The body's own `finally` is not
    enough: a client gone before the first chunk leaves the body generator unstarted, so it never runs."""

    def __init__(self, body: AsyncIterator[bytes], started: list[StartedStream]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._started = started

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._started:  # idempotent: a finished or already cancelled stream ignores it
                s.cancel()
