"""OpenAI-style errors: one exception type carrying status + body, and the handlers that render it."""
from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from conveyor.router.protocol import ErrorInfo

logger = logging.getLogger("ray.serve")


_rejection_counter: Callable[[str], None] | None = None


def count_rejections_with(counter: Callable[[str], None] | None) -> None:
    """The ingress's counter of its own refusals (reason: the error code), so 401/400/404/413/5xx answered at
    the ingress appear next to the engines' 429s and 400s (conveyor_requests_rejected_total)."""
    global _rejection_counter
    _rejection_counter = counter


def _count_rejection(reason: str) -> None:
    if _rejection_counter is not None:
        _rejection_counter(reason)


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers or {}
        self.counted = False  # True when counted elsewhere: by the engine replica that refused it, or as cut

    def response(self) -> JSONResponse:
        if not self.counted:
            _count_rejection(self.info.code or str(self.status))
        return JSONResponse({"error": self.info.model_dump()}, status_code=self.status,
                            headers=self.headers)

    def already_counted(self) -> ApiError:
        """Not counted again as a rejection when answered."""
        self.counted = True
        return self

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None) -> ApiError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def too_many(cls, message: str, retry_after_s: float) -> ApiError:
        # Retry-After is whole seconds; never 0, or clients hammer us in a tight loop.
        headers = {"Retry-After": str(max(1, round(retry_after_s)))}
        return cls(429, message, type="rate_limit_error", code="queue_full", headers=headers)

    @classmethod
    def unavailable(cls, message: str, retry_after_s: float = 1.0) -> ApiError:
        headers = {"Retry-After": str(max(1, round(retry_after_s)))}
        return cls(503, message, type="service_unavailable", code="no_replica", headers=headers)

    @classmethod
    def server(cls, message: str) -> ApiError:
        return cls(500, message, type="server_error", code="internal_error")


def from_validation(exc: ValidationError | RequestValidationError) -> ApiError:
    """The first pydantic error as an OpenAI 400 (param = the field path), never FastAPI's 422 shape."""
    errors = exc.errors()
    if not errors:
        return ApiError.invalid("invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # param names the top-level parameter as OpenAI does; the message keeps the full path (union branch,
    # list index) because that is what tells a client which part was wrong.
    param = loc[0] if loc else None
    message = first.get("msg", "invalid value")
    if loc:
        message = f"{'.'.join(loc)}: {message}"
    return ApiError.invalid(message, param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Still OpenAI JSON, so clients parse it; the details go to the log, not to the client.
        logger.exception("unhandled error: %r", exc)
        return ApiError.server("internal server error").response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), type=kind).response()
