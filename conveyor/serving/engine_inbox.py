"""The engine process's end of the pipe: a reader thread that takes the parent's messages while a step runs.

TTFT admission is decided here, once, for every request: the reader holds a new request against the TtftForecast
the step thread left (ttft_forecast.py), plus the prompts it has admitted since, and refuses it at once (429)
or marks it admitted, a final decision the scheduler does not redo. A request that waited out the step in flight
(~100 ms at saturation on 2 cores) for the scheduler's own check got its 429 a step or two late. The step in flight
counts as done: its prefill comes off the backlog before the request is looked at. Without a forecast (TTFT
admission off, the step cost not yet fitted) the scheduler decides. Sends from either thread go through one lock
(a Connection is not thread-safe).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from conveyor.serving.admission import ttft_refusal
from conveyor.serving.engine_messages import Add, Reject
from conveyor.serving.ttft_forecast import TtftForecast

logger = logging.getLogger(__name__)

_CLOSED = object()  # the reader's last item: the parent closed the pipe
_REFUSED = object()


class Inbox:
    def __init__(self, conn: Connection, cached_tokens: Callable[[list[int]], int]) -> None:
        self.conn = conn
        self.cached_tokens = cached_tokens  # prefix-cache hit of a prompt, safe to call off the step thread
        self.num_refused_early = 0  # written by the reader thread only
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (sequence number, message)
        self._send_lock = threading.Lock()
        # The forecast and the uncached prompt ranges admitted here that it does not hold yet, as
        # (sequence number, start, end): set_forecast drops those the step thread has taken.
        self._lock = threading.Lock()
        self._forecast: TtftForecast | None = None
        self._admitted: deque[tuple[int, int, int]] = deque()
        self._num_queued = 0  # reader thread only
        self._num_taken = 0  # step thread only
        self._reader = threading.Thread(target=self._read, name="engine-inbox", daemon=True)

    def start(self) -> None:
        self._reader.start()

    def send(self, message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)

    def set_forecast(self, forecast: TtftForecast | None) -> None:
        """The step thread's forecast, taken after it applied every message it has got (and after each step)."""
        with self._lock:
            self._forecast = forecast
            while self._admitted and self._admitted[0][0] <= self._num_taken:
                self._admitted.popleft()

    def get(self, timeout_s: float | None = None) -> Any | None:
        """The next message in the parent's order; None when none came within timeout_s (0: do not wait).
        Raises EOFError once the parent has closed the pipe."""
        try:
            item = self._items.get(timeout=timeout_s) if timeout_s else self._items.get_nowait()
        except queue.Empty:
            return None
        if item is _CLOSED:
            self._items.put(_CLOSED)  # every later get sees it too
            raise EOFError("the parent closed the pipe")
        self._num_taken, message = item
        return message

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self._items.put(_CLOSED)
                return
            try:
                uncached = self._admission(message) if isinstance(message, Add) else None
            except (EOFError, OSError):  # a refusal could not be sent: the parent is gone
                self._items.put(_CLOSED)
                return
            if uncached is _REFUSED:
                continue
            with self._lock:
                self._num_queued += 1
                if uncached is not None:
                    self._admitted.append((self._num_queued, *uncached))
            self._items.put((self._num_queued, message))

    def _admission(self, message: Add) -> tuple[int, int] | object | None:
        """_REFUSED (answered here), the prompt's uncached range (admitted: message.ttft_admitted set), or None
        (no forecast: the scheduler decides)."""
        with self._lock:
            forecast = self._forecast
            ahead = [(start, end) for _, start, end in self._admitted]
        if forecast is None or not message.prompt_token_ids:
            return None
        try:
            num_tokens = len(message.prompt_token_ids)
            cached = min(self.cached_tokens(message.prompt_token_ids), num_tokens - 1)
            forecast = forecast.with_backlog(ahead)
            if forecast.backlog_tokens > 0:  # a prompt alone is never refused: it would miss at any time
                ttft_s = forecast.predict_s(cached, num_tokens) - forecast.step_s()
                if ttft_s > forecast.limit_s:
                    refusal = ttft_refusal(ttft_s, forecast.limit_s)
                    self.send(Reject(message.request_id, refusal.reason, str(refusal), refusal.retry_after_s))
                    self.num_refused_early += 1
                    return _REFUSED
        except (EOFError, OSError):
            raise
        except Exception:  # noqa: BLE001 - an estimate only: the scheduler's own admission check decides
            logger.exception("TTFT check in the inbox failed; the scheduler decides")
            return None
        message.ttft_admitted = True
        return cached, num_tokens
