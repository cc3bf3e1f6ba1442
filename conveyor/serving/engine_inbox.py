"""The engine process's end of the pipe: a reader thread that takes the parent's messages while a step runs.

The step thread used to read the pipe only between steps, so a request that TTFT admission refuses waited out the
step in flight (~100 ms at saturation on 2 cores) for its 429. The reader answers such a request at once from the
TtftForecast the step thread left after its last step (ttft_forecast.py), and queues everything else in order for
the step thread. It refuses only what the scheduler would refuse after the step in flight: the forecast's
prediction less one step. Sends from either thread go through one lock (a Connection is not thread-safe).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from conveyor.serving.engine_messages import Add, Reject
from conveyor.serving.scheduler import ttft_refusal
from conveyor.serving.ttft_forecast import TtftForecast

logger = logging.getLogger(__name__)

_CLOSED = object()  # the reader's last item: the parent closed the pipe


class Inbox:
    def __init__(self, conn: Connection, cached_tokens: Callable[[list[int]], int]) -> None:
        self.conn = conn
        self.cached_tokens = cached_tokens  # prefix-cache hit of a prompt, safe to call off the step thread
        self.forecast: TtftForecast | None = None  # replaced (never mutated) by the step thread between steps
        self.num_refused_early = 0  # written by the reader thread only
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="engine-inbox", daemon=True)

    def start(self) -> None:
        self._reader.start()

    def send(self, message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)

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
        return item

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self._items.put(_CLOSED)
                return
            if not (isinstance(message, Add) and self._refused_early(message)):
                self._items.put(message)

    def _refused_early(self, message: Add) -> bool:
        forecast = self.forecast
        if forecast is None:
            return False
        try:
            cached = self.cached_tokens(message.prompt_token_ids)
            ttft_s = forecast.predict_s(cached, len(message.prompt_token_ids)) - forecast.step_s()
            if ttft_s <= forecast.limit_s:
                return False
            refusal = ttft_refusal(ttft_s, forecast.limit_s)
            self.send(Reject(message.request_id, refusal.reason, str(refusal), refusal.retry_after_s))
        except (EOFError, OSError):
            raise
        except Exception:  # noqa: BLE001 - an estimate only: the step thread's own admission check decides
            logger.exception("early TTFT check failed; the step thread decides")
            return False
        self.num_refused_early += 1
        return True
