"""Seeded offline workloads: prompt and output lengths with a long tail, prompts as random token ids."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int


def long_tail_workload(num_requests: int, seed: int = 0, vocab_low: int = 100, vocab_high: int = 49_000,
                       min_prompt: int = 16, max_prompt: int = 512, min_output: int = 8,
                       max_output: int = 256) -> list[WorkItem]:
    """Prompt lengths log-uniform in [min_prompt, max_prompt]; output lengths log-normal (median ~40)
    clipped to [min_output, max_output], so a few requests run far longer than the rest."""
    rng = random.Random(seed)
    items = []
    for _ in range(num_requests):
        prompt_len = int(math.exp(rng.uniform(math.log(min_prompt), math.log(max_prompt))))
        output_len = int(min(max_output, max(min_output, rng.lognormvariate(math.log(40), 0.9))))
        prompt = [rng.randrange(vocab_low, vocab_high) for _ in range(prompt_len)]
        items.append(WorkItem(prompt, output_len))
    return items
