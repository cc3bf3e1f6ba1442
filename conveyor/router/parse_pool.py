"""Request parsing off the ingress's event loop, with a deadline.

Decoding a 1 MiB body, validating it with pydantic, validating a structured-output grammar and checking tools is
CPU work of up to tens of milliseconds (seconds before the caps of docs/limits.md): on the event loop it would hold
every stream the ingress is relaying. Here it runs on a few worker threads. json.loads and pydantic-core hold the
GIL while they run, but only for one C call at a time, and the grammar library drops it while it parses: the loop
gets its turn at least every switch interval (5 ms) instead of after the whole request.

A thread cannot be stopped, so the deadline bounds what the client waits for, not the thread's work: the caps
bound that. A request still parsing at the deadline is a 413 (too costly to parse: send less); one that waited the
whole deadline for a free worker is a 503 (the ingress is busy: retry), and its work is never started.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from conveyor.router import json_limits
from conveyor.router.errors import ApiError, from_validation

T = TypeVar("T")
DEFAULT_PARSE_TIMEOUT_S = 5.0
DEFAULT_PARSE_THREADS = 4


class ParsePool:
    """A bounded set of worker threads that run parse jobs under a per-job deadline."""

    def __init__(self, num_threads: int = DEFAULT_PARSE_THREADS, timeout_s: float = DEFAULT_PARSE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="parse")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        started = threading.Event()

        def job() -> T:
            started.set()
            return fn(*args)

        future = self._pool.submit(job)
        try:  # on time-out wait_for cancels the wrapper, which cancels a job not yet started
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except asyncio.TimeoutError:
            if not started.is_set():
                raise ApiError(503, f"the server is busy: no parser was free within {self.timeout_s:g} s; retry "
                               "the request", type="service_unavailable", code="parser_busy",
                               headers={"Retry-After": "1"}) from None
            raise ApiError(413, f"the request took more than {self.timeout_s:g} s to parse and validate; send "
                                "fewer or smaller messages, tools or schemas", code="request_too_complex") from None


def parse_body(body: bytes, model: type[BaseModel]) -> Any:
    """A request body -> a validated `model`; every fault of the client's input is an ApiError (a 400)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError.invalid("request body is not valid UTF-8", code="invalid_encoding") from None
    try:
        data = json_limits.loads(text)  # depth, digit limit, NaN, lone surrogates: all a 400
    except ValueError as exc:
        raise ApiError.invalid(str(exc), code=getattr(exc, "code", "invalid_json")) from None
    if not isinstance(data, dict):
        raise ApiError.invalid("request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None
