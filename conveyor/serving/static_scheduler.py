"""Static batching, the baseline: a batch is admitted together and runs until its longest member ends.

Same interface, KV cache and token budget as the continuous scheduler; what differs is admission: nothing
joins a batch while any member still runs, and a batch is admitted only if every member's whole lifetime
(prompt + max_tokens) fits in the cache at once, so the baseline never preempts.
"""
from __future__ import annotations

import dataclasses
import time

from conveyor.serving.config import SchedulerConfig
from conveyor.serving.kv_cache_manager import KVCacheManager, cdiv
from conveyor.serving.outputs import ScheduledChunk
from conveyor.serving.request import Request, RequestStatus
from conveyor.serving.scheduler import Scheduler


class StaticScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        # The baseline as it is classically run: a fixed token budget and a plain queue, no latency targets
        # (they pace chunks that this scheduler never mixes with decodes).
        super().__init__(dataclasses.replace(config, tpot_slo_ms=None, ttft_slo_ms=None), kv_cache, max_model_len)

    def _admit_waiting(self, budget: int, scheduled: dict[str, ScheduledChunk]) -> int:
        if self.running:
            return budget
        num_reserved = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_blocks = self._lifetime_blocks(request)
            if self.running and num_reserved + num_blocks > self.kv_cache.num_free_blocks:
                break
            num_reserved += num_blocks
            self._pop_waiting()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = request.num_cached_tokens = 0
            self.running.append(request)
        for request in self.running:
            if budget == 0:
                break
            num_new = min(request.num_tokens, budget)
            block_ids = self.kv_cache.allocate_slots(request, num_new)
            if block_ids is None:
                break
            scheduled[request.request_id] = ScheduledChunk(request, 0, num_new, block_ids)
            budget -= num_new
        return budget

    def _lifetime_blocks(self, request: Request) -> int:
        return cdiv(request.num_prompt_tokens + request.max_tokens, self.kv_cache.block_size)
