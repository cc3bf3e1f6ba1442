"""The predicted wait for a first token, as a frozen record that can be read off the engine's step thread.

StepBudget.ttft_forecast() takes it between steps; the scheduler holds a new request's uncached prompt against it
(TTFT admission), and the engine process's pipe reader refuses with it at once a request that the scheduler would
refuse anyway, instead of the request waiting out the step in flight for its 429 (engine_core_loop.py). No torch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from conveyor.serving.block_pool import ROOT_HASH, hash_block


@dataclass(frozen=True, slots=True)
class TtftForecast:
    """The prefill queued ahead of a new request and the pace steps grant it, under the linear step-cost model
    t = a + b * tokens + c * seqs + d * kv_reads (d here already scaled): the sum over the steps is exact for it,
    whatever the chunking."""

    coef: tuple[float, float, float, float]
    num_decodes: int
    decode_kv_reads: int
    num_seqs: int  # the running sequences and the new one
    prefill_per_step: int
    backlog_tokens: int
    backlog_kv_reads: int
    limit_s: float

    def predict_s(self, start: int, end: int) -> float:
        """Seconds until the backlog and then the new prompt's tokens [start, end) are computed."""
        a, b, c, d = self.coef
        num_tokens = self.backlog_tokens + end - start
        num_steps = math.ceil(num_tokens / self.prefill_per_step)
        kv_reads = self.backlog_kv_reads + causal_kv_reads(start, end)
        return (a * num_steps + b * (num_steps * self.num_decodes + num_tokens) + c * num_steps * self.num_seqs
                + d * (num_steps * self.decode_kv_reads + kv_reads))

    def with_backlog(self, ranges: Sequence[tuple[int, int]]) -> TtftForecast:
        """This forecast with the prompt token ranges [start, end) queued behind its backlog (requests admitted
        since it was taken)."""
        if not ranges:
            return self
        return replace(self, backlog_tokens=self.backlog_tokens + sum(end - start for start, end in ranges),
                       backlog_kv_reads=self.backlog_kv_reads + sum(causal_kv_reads(*r) for r in ranges))

    def step_s(self) -> float:
        """One step at this pace (its prefill's own KV reads left out): what the step in flight takes off the
        backlog before a request that arrives during it is looked at."""
        a, b, c, d = self.coef
        return a + b * (self.num_decodes + self.prefill_per_step) + c * self.num_seqs + d * self.decode_kv_reads


def causal_kv_reads(start: int, end: int) -> int:
    """KV rows that computing a prompt's tokens [start, end) reads: each token attends to its causal prefix."""
    return (end * (end + 1) - start * (start + 1)) // 2


def cached_prefix_tokens(pool, block_size: int, token_ids: Sequence[int]) -> int:  # noqa: ANN001 - BlockPool
    """Tokens of token_ids whose full blocks the prefix cache holds now (as KVCacheManager finds them, leaving one
    token to compute). Reads the pool only and memoizes nothing, so another thread may call it during a step: a
    block evicted meanwhile makes this an estimate, never an error."""
    num_full = (len(token_ids) - 1) // block_size
    parent, num_hits = ROOT_HASH, 0
    for i in range(num_full):
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        block_hash = hash_block(parent, tokens)
        if pool.lookup(block_hash, parent, tokens) is None:
            break
        parent, num_hits = block_hash, num_hits + 1
    return num_hits * block_size
