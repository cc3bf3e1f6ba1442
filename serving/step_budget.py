"""Tail-latency mode (SchedulerConfig.itl_slo_ms): each step's token budget, and whether the batch may grow, sized
so the step's predicted time stays under the inter-token latency target (step_cost.py learns the cost online).
Without a target the budget is max_num_batched_tokens and the batch grows to max_num_seqs. No torch here."""
from __future__ import annotations

from collections.abc import Sequence

from conveyor.serving.config import SchedulerConfig
from conveyor.serving.request import Request
from conveyor.serving.step_cost import StepCostModel

# Token budget while the step-cost model is still learning: small and safe.
COLD_START_BUDGET = 64


class StepBudget:
    def __init__(self, config: SchedulerConfig, step_cost: StepCostModel) -> None:
        self.config = config
        self.step_cost = step_cost

    @property
    def reads_step_cost(self) -> bool:
        """Only the tail-latency mode sizes steps from the step-cost model; otherwise nobody needs it fitted."""
        return self.config.itl_slo_ms is not None

    def tokens(self, running: Sequence[Request], waiting: Sequence[Request]) -> int:
        """This step's token budget: fixed, or in tail-latency mode what the step-cost model says fits the
        ITL target. Running decodes always fit (starving a stream would hurt its latency more), and pending
        prefill always gets min_prefill_tokens, so a long prompt progresses even when decodes fill the target."""
        limit = self.config.max_num_batched_tokens
        if self.config.itl_slo_ms is None:
            return limit
        if not self.step_cost.ready:
            return min(limit, max(COLD_START_BUDGET, len(running)))
        decodes = [r for r in running if r.num_tokens_to_schedule == 1]
        # The next prefill tokens go to running prefills first, then to the head of the queue.
        prefills = [r for r in running if r.num_tokens_to_schedule > 1]
        if not prefills and waiting:
            prefills = [waiting[0]]
        floor = len(decodes) + (self.config.min_prefill_tokens if prefills else 0)
        num_seqs = len(running) + (1 if waiting else 0)
        fits = self.step_cost.max_tokens_within(
            self._target_step_s(), num_seqs, num_decodes=len(decodes),
            decode_kv_reads=sum(r.num_tokens for r in decodes),
            prefill_context=prefills[0].num_computed_tokens if prefills else 0)
        return min(limit, max(fits, floor, 1))

    def batch_has_room(self, running: Sequence[Request], waiting: Sequence[Request]) -> bool:
        """Tail-latency mode caps the batch: admit one more sequence only if a decode step over the larger
        batch (the new request's prompt included in the context read) is still predicted under the target.
        Otherwise new requests wait (and past the queue bound get 429), which keeps the admitted streams'
        inter-token latency."""
        if self.config.itl_slo_ms is None or not self.step_cost.ready or not running:
            return True
        num_seqs = len(running) + 1
        kv_reads = sum(r.num_tokens for r in running) + waiting[0].num_tokens
        return self.step_cost.predict_tail(num_seqs, num_seqs, kv_reads) <= self._target_step_s()

    def _target_step_s(self) -> float:
        return self.config.itl_slo_ms / 1000 * self.config.slo_headroom
