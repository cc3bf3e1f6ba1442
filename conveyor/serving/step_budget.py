"""Each step's token budget, whether the batch may grow, and the predicted wait for a first token, from the latency
targets in SchedulerConfig and the step cost the engine measures (step_cost.py). No torch here.

Two targets size a step while requests decode:
- tpot_slo_ms (the default, 100 ms): the step's predicted MEAN time stays under tpot_slo_ms * slo_headroom. TPOT
  is a mean over a request's output tokens, so planning against the fitted mean is what keeps it, and the prefill
  chunk grows to whatever the decodes leave (Sarathi-Serve sizes chunks the same way, from a profiled budget).
- itl_slo_ms (tail-latency mode): the step's TAIL prediction (mean x the tracked p99 misfit) stays under
  itl_slo_ms * slo_headroom, and the batch grows only while a decode step over it still fits.
With both, the stricter holds; with neither, the budget is max_num_batched_tokens. A step with no decodes delays
no stream, so under the TPOT target alone it takes up to max_num_batched_tokens.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Sequence

from conveyor.serving.config import SchedulerConfig
from conveyor.serving.request import Request
from conveyor.serving.step_cost import KV_SCALE, StepCostModel
from conveyor.serving.ttft_forecast import TtftForecast, causal_kv_reads

# Token budget while the step-cost model is still learning: small and safe.
COLD_START_BUDGET = 64


class OutputLengths:
    """The output lengths of recently finished requests: how long a stream that already has n tokens is likely,
    at the least, to go on. Learned from what the requests did, never from max_tokens (a cap, not a forecast)."""

    def __init__(self, quantile: float, window: int = 256, min_samples: int = 32) -> None:
        self.quantile, self.window, self.min_samples = quantile, window, min_samples
        self._recent: deque[int] = deque()
        self._sorted: list[int] = []

    def add(self, num_tokens: int) -> None:
        if len(self._recent) == self.window:
            del self._sorted[bisect_left(self._sorted, self._recent.popleft())]
        self._recent.append(num_tokens)
        insort(self._sorted, num_tokens)

    def lower_bound(self, num_tokens: int) -> int:
        """The quantile of the final length among recent requests longer than num_tokens; num_tokens itself
        while fewer than min_samples were."""
        first_longer = bisect_right(self._sorted, num_tokens)
        num_longer = len(self._sorted) - first_longer
        if num_longer < self.min_samples:
            return num_tokens
        return self._sorted[first_longer + int(self.quantile * num_longer)]


class StepBudget:
    def __init__(self, config: SchedulerConfig, step_cost: StepCostModel) -> None:
        self.config = config
        self.step_cost = step_cost
        quantile = config.tpot_credit_quantile
        self.output_lengths = OutputLengths(quantile) if quantile is not None else None
        self._deferring_since: float | None = None  # when steps began to run decodes alone (min_chunk_tokens)
        self._no_deferring_until = 0.0  # after a deferral that ran out: its credit did not grow, so none for as long

    def observe_finished(self, num_output_tokens: int) -> None:
        """A request ended by its own output (a stop or its length): what later streams are expected to run to."""
        if self.output_lengths is not None:
            self.output_lengths.add(num_output_tokens)

    @property
    def reads_step_cost(self) -> bool:
        """Whether anything plans with the step-cost model (otherwise nobody needs it fitted)."""
        c = self.config
        return c.itl_slo_ms is not None or c.tpot_slo_ms is not None or self.sheds_by_ttft

    @property
    def sheds_by_ttft(self) -> bool:
        return self.config.ttft_slo_ms is not None and self.config.admission_policy == "slo"

    def tokens(self, running: Sequence[Request], waiting: Sequence[Request], now: float | None = None,
               pace_s: float = 0.0) -> int:
        """This step's token budget. Running decodes always fit (starving a stream would hurt its latency more),
        and pending prefill always gets min_prefill_tokens, so a long prompt progresses even when decodes fill
        the target. pace_s: the recent mean step time, what the steps after this one are expected to take."""
        limit = self.config.max_num_batched_tokens
        if self.config.itl_slo_ms is None and self.config.tpot_slo_ms is None:
            return limit
        if not self.step_cost.ready:
            return min(limit, max(COLD_START_BUDGET, len(running)))
        decodes = [r for r in running if r.num_tokens_to_schedule == 1]
        # The next prefill tokens go to running prefills first, then to the head of the queue.
        prefills = [r for r in running if r.num_tokens_to_schedule > 1]
        if not prefills and waiting:
            prefills = [waiting[0]]
        floor = len(decodes) + (self.config.min_prefill_tokens if prefills else 0)
        shape = (len(decodes), len(running) + (1 if waiting else 0), sum(r.num_tokens for r in decodes),
                 prefills[0].num_computed_tokens if prefills else 0)
        fits = self._fits(*shape, self._tpot_credit_s(decodes, now, pace_s))
        budget = min(limit, max(fits, floor, 1))
        if decodes and prefills and self._defers_prefill(budget - len(decodes), shape, running, waiting, now):
            return len(decodes)
        return budget

    def _defers_prefill(self, room: int, shape: tuple[int, int, int, int], running: Sequence[Request],
                        waiting: Sequence[Request], now: float | None) -> bool:
        """Whether this step runs its decodes alone because the prefill room is under min_chunk_tokens (and under
        what is pending). Each such step is shorter than the target, so the streams get ahead of their pace and
        the TPOT credit grows the room. Only where decodes alone take under half the target (else the credit
        grows too slowly to be worth the wait) and the room at the credit's cap would be enough, and for at most
        that cap's time (more waiting buys no more credit); a wait that ran out (streams behind their pace give
        none) is not begun again for as long, so prefill there still runs a chunk every step."""
        c = self.config
        if (c.min_chunk_tokens is None or now is None or c.itl_slo_ms is not None or not c.tpot_credit_max
                or now < self._no_deferring_until):
            return False
        num_decodes, _, decode_kv_reads, _ = shape
        target_s = c.tpot_slo_ms / 1000 * c.slo_headroom
        cap_s = target_s * c.tpot_credit_max  # the most credit a step can use, and so the longest wait worth it
        if self.step_cost.predict(num_decodes, num_decodes, decode_kv_reads) > target_s / 2:
            return False
        pending = sum(n for r in running if (n := r.num_tokens_to_schedule) > 1)  # running prefills, then the queue
        for r in waiting:
            if pending >= c.min_chunk_tokens:
                break
            pending += r.num_tokens_to_schedule
        want = min(c.min_chunk_tokens, pending)
        if room >= want or self._fits(*shape, cap_s) - num_decodes < want:
            self._deferring_since = None
            return False
        if self._deferring_since is None:
            self._deferring_since = now
        if now - self._deferring_since < cap_s:
            return True
        self._deferring_since = None
        self._no_deferring_until = now + cap_s
        return False

    def _tpot_credit_s(self, decodes: Sequence[Request], now: float | None, pace_s: float) -> float:
        """How far this step may exceed the TPOT target: TPOT is a mean over a request's tokens, so a stream
        ahead of its pace (t_first + target x tokens so far) can take a longer step and stay within it, and so
        can one that will go on long enough to make the time up in steps shorter than the target (the tokens
        it is still expected to produce, a lower quantile learned from finished requests, x (target - pace_s)).
        The stream with the least credit sets it; a stream behind its pace gives none (never negative)."""
        if now is None or not self.config.tpot_credit_max or self.config.tpot_slo_ms is None or not decodes:
            return 0.0
        target_s = self.config.tpot_slo_ms / 1000 * self.config.slo_headroom
        spare_s = max(target_s - pace_s, 0.0)
        credit = math.inf
        for r in decodes:
            if r.first_token_time is None:
                return 0.0
            num_output = len(r.output_token_ids)
            # The next token is output number n + 1: TPOT after it is (t_next - t_first) / n.
            ahead_s = r.first_token_time + target_s * num_output - now - target_s
            if self.output_lengths is not None:
                ahead_s += max(self.output_lengths.lower_bound(num_output) - num_output - 1, 0) * spare_s
            credit = min(credit, ahead_s)
        return min(max(credit, 0.0), target_s * self.config.tpot_credit_max)

    def _fits(self, num_decodes: int, num_seqs: int, decode_kv_reads: int, prefill_context: int,
              tpot_credit_s: float = 0.0) -> int:
        """The most tokens (decodes included) that the targets let a step carry."""
        fits = self.config.max_num_batched_tokens
        if num_decodes == 0 and self.config.itl_slo_ms is None:
            return fits
        for target_s, tail in self._targets(tpot_credit_s):
            fits = min(fits, self.step_cost.max_tokens_within(
                target_s, num_seqs, num_decodes=num_decodes, decode_kv_reads=decode_kv_reads,
                prefill_context=prefill_context, tail=tail))
        return fits

    def _targets(self, tpot_credit_s: float = 0.0) -> list[tuple[float, bool]]:
        """(step time target in seconds, plan against the tail prediction) for each target that is set."""
        c = self.config
        targets = []
        if c.itl_slo_ms is not None:
            targets.append((c.itl_slo_ms / 1000 * c.slo_headroom, True))
        if c.tpot_slo_ms is not None:
            targets.append((c.tpot_slo_ms / 1000 * c.slo_headroom + tpot_credit_s, False))
        return targets

    def batch_has_room(self, running: Sequence[Request], waiting: Sequence[Request]) -> bool:
        """Admit one more sequence only if a decode step over the larger batch (the new request's prompt included
        in the context read) is still predicted under every target. Otherwise new requests wait (and past the
        queue bound, or their TTFT target, get 429), which keeps the admitted streams' inter-token latency."""
        if not running or not self.step_cost.ready or not self._targets():
            return True
        num_seqs = len(running) + 1
        kv_reads = sum(r.num_tokens for r in running) + waiting[0].num_tokens
        return all((self.step_cost.predict_tail if tail else self.step_cost.predict)(num_seqs, num_seqs, kv_reads)
                   <= target_s for target_s, tail in self._targets())

    def ttft_forecast(self, running: Sequence[Request], backlog: Sequence[tuple[int, int]]) -> TtftForecast | None:
        """The wait for a new request's first token before its own prompt: the backlog's prefill (the (start, end)
        token ranges queued ahead of it) at the pace this budget grants prefill beside today's decodes, each step's
        fixed and decode costs, every backlog token and the KV rows its prompt's causal prefix reads. None until
        the step-cost model has a fit."""
        if not self.step_cost.ready:
            return None
        num_decodes = sum(1 for r in running if r.num_tokens_to_schedule <= 1)
        decode_kv_reads = sum(r.num_tokens for r in running if r.num_tokens_to_schedule <= 1)
        num_seqs = len(running) + 1
        step_tokens = min(self.config.max_num_batched_tokens,
                          max(self._fits(num_decodes, num_seqs, decode_kv_reads, 0),
                              num_decodes + self.config.min_prefill_tokens))
        a, b, c, d = self.step_cost.coefficients()
        return TtftForecast(
            coef=(a, b, c, d * KV_SCALE), num_decodes=num_decodes, decode_kv_reads=decode_kv_reads,
            num_seqs=num_seqs, prefill_per_step=max(step_tokens - num_decodes, 1),
            backlog_tokens=sum(end - start for start, end in backlog),
            backlog_kv_reads=sum(causal_kv_reads(start, end) for start, end in backlog),
            limit_s=self.ttft_limit_s())

    def ttft_limit_s(self) -> float:
        return self.config.ttft_slo_ms / 1000 * self.config.slo_headroom
