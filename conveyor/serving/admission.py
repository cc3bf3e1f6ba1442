"""Admission: whether a request may join the scheduler's waiting queue now, and the refusal it gets if not (HTTP
429 upstream): the queue bounds, the expected wait for a batch slot, and the TTFT forecast of admission_policy slo.
No torch here."""
from __future__ import annotations

import math
from collections import deque

from conveyor.serving.config import SchedulerConfig
from conveyor.serving.kv_cache_manager import KVCacheManager
from conveyor.serving.request import Request
from conveyor.serving.step_budget import StepBudget
from conveyor.serving.ttft_forecast import TtftForecast, cached_prefix_tokens

# QueueFullError.reason values; also the `reason` label of conveyor_requests_rejected_total.
REFUSAL_REASONS = ("queue_full", "ttft_slo")


class QueueFullError(RuntimeError):
    """The engine refuses a request for now (HTTP 429): its waiting queue is at a bound ("queue_full"), or the
    request would miss its time-to-first-token target ("ttft_slo"). The caller should retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


def ttft_refusal(ttft_s: float, limit_s: float) -> QueueFullError:
    return QueueFullError(f"predicted time to first token {ttft_s:.1f} s exceeds the {limit_s:.1f} s target "
                          "(ttft_slo_ms x slo_headroom)", retry_after_s=min(ttft_s - limit_s + 1.0, 60.0),
                          reason="ttft_slo")


class Admission:
    """The admission half of the Scheduler (scheduler.py), which inherits it: it reads the scheduler's queues,
    step budget and recent step time, and counts TTFT refusals there."""

    config: SchedulerConfig
    kv_cache: KVCacheManager
    budget: StepBudget
    waiting: deque[Request]
    running: list[Request]
    num_refused_ttft: int
    _num_waiting_tokens: int
    _mean_step_s: float

    def max_queued_requests(self) -> int:
        """The waiting bound plus the free batch slots: requests arriving at an idle engine wait one step for
        a slot that is theirs already, so they must not count against the queue."""
        return self.config.max_waiting_requests + max(0, self.config.max_num_seqs - len(self.running))

    def check_admission(self, request: Request, *, check_ttft: bool = True) -> None:
        """Raise QueueFullError if the request may not join the queue now: a queue bound, the expected wait for a
        batch slot, or (check_ttft, with admission_policy slo) its predicted first-token time."""
        if len(self.waiting) >= self.max_queued_requests():
            raise QueueFullError(f"waiting queue full ({len(self.waiting)} requests)")
        if self._num_waiting_tokens + request.num_tokens > self.config.max_waiting_tokens:
            raise QueueFullError(f"waiting queue full ({self._num_waiting_tokens} prompt tokens)")
        if self.config.max_queue_wait_s is not None:
            wait_s = self.expected_queue_wait_s()
            if wait_s > self.config.max_queue_wait_s:
                raise QueueFullError(f"expected wait for a batch slot ({wait_s:.1f} s) exceeds max_queue_wait_s",
                                     retry_after_s=min(wait_s, 60.0))
        if check_ttft and self.budget.sheds_by_ttft:
            self._check_ttft(request)

    def ttft_forecast(self) -> TtftForecast | None:
        """The predicted wait for a new request's first token ahead of its own prompt: the prefill of running
        prompts and of the queue. None when TTFT admission is off or the step cost unfitted. With nothing queued
        ahead (backlog_tokens 0) nothing is refused: a prompt too long for the target alone would miss it at any
        time."""
        if not self.budget.sheds_by_ttft:
            return None
        ahead = [(r.num_computed_tokens, r.num_tokens) for r in self.running if r.num_tokens_to_schedule > 1]
        ahead += [(0, r.num_tokens) for r in self.waiting]
        return self.budget.ttft_forecast(self.running, ahead)

    def _check_ttft(self, request: Request) -> None:
        """Refuse a request whose first token is predicted later than the TTFT target: the prefill queued ahead
        of it and its own uncached prompt, at the pace the step budget grants prefill."""
        forecast = self.ttft_forecast()
        if forecast is None or forecast.backlog_tokens == 0:
            return
        # A read of the prefix cache that memoizes nothing: a refused request must leave no state behind.
        cached = cached_prefix_tokens(self.kv_cache.pool, self.kv_cache.block_size, request.prompt_token_ids)
        ttft_s = forecast.predict_s(cached, request.num_tokens)
        if ttft_s > forecast.limit_s:
            self.num_refused_ttft += 1
            raise ttft_refusal(ttft_s, forecast.limit_s)

    def expected_queue_wait_s(self) -> float:
        """How long a request arriving now would wait for a batch slot: the running requests free theirs
        after their remaining max_tokens steps, and the requests already waiting take the first ones."""
        slot_rank = len(self.waiting) - (self.config.max_num_seqs - len(self.running))  # 0: the first to free
        if slot_rank < 0:
            return 0.0
        remaining = sorted(max(r.max_tokens - r.num_output_tokens, 1) for r in self.running)
        if slot_rank >= len(remaining):
            return math.inf
        return remaining[slot_rank] * self._mean_step_s
