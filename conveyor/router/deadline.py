"""The server-side request timeout (`request_timeout_s`): queue + generation, counted from the request's arrival.

Serve's own request timeout is off by default and a client may switch it off per request (serve_headers.py), so
the ingress keeps its own: a request past it ends with a clear error and its engine work is aborted (the started
streams are cancelled, which closes the engine requests). Before the status line it is a 408, the status Serve's
own timeout answers with; a stream already under way ends with one SSE error event and [DONE].
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

from conveyor.router.errors import ApiError
from conveyor.router.formatting import sse

logger = logging.getLogger("ray.serve")


def timeout_error(timeout_s: float) -> ApiError:
    return ApiError(408, f"the request did not finish within the server's request timeout ({timeout_s:g} s); "
                         "ask for fewer tokens or retry later", type="timeout_error", code="request_timeout")


async def with_deadline(body: AsyncIterator[bytes], deadline: float | None, timeout_s: float,
                        cancels: Sequence[Callable[[], None]] = ()) -> AsyncIterator[bytes]:
    """`body`'s chunks until the loop's clock passes `deadline` (None: no deadline); then the engine work is
    cancelled and the stream ends with an error event. The timer cancels whatever this generator awaits (the next
    record), which asyncio.timeout_at turns into TimeoutError here."""
    try:
        async with asyncio.timeout_at(deadline):  # None: no deadline
            async for chunk in body:
                yield chunk
        return
    except TimeoutError:
        logger.info("stream ended at the request timeout (%g s)", timeout_s)
    finally:  # closed by its reader (a client gone) or timed out: `body`'s own cleanup runs now, not at GC
        await body.aclose()
    for cancel in cancels:
        cancel()
    yield sse({"error": timeout_error(timeout_s).info.model_dump()})
    yield sse("[DONE]")
