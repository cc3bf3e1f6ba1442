"""Seeded arrivals and request lengths: everything a run draws from its seed, nothing from the wall clock."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Token ids drawn for random prompts: above the special tokens, below any vocab we serve (SmolLM2: 49152).
VOCAB_LOW, VOCAB_HIGH = 100, 49_000


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from start) of `num` requests at mean `rate` req/s.

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): burstiness 1 is a Poisson process, < 1
    burstier, > 1 smoother; the mean gap is 1/rate either way. rate = inf sends everything at t=0.
    """
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def sharegpt_like_lengths(num: int, seed: int = 0, min_prompt: int = 16, max_prompt: int = 512,
                          min_output: int = 8, max_output: int = 128) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs with ShareGPT's shape: prompts log-uniform, outputs log-normal
    (median ~40) clipped, so a few requests run far longer than the rest."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(num):
        p = int(math.exp(rng.uniform(math.log(min_prompt), math.log(max_prompt))))
        o = int(min(max_output, max(min_output, rng.lognormvariate(math.log(40), 0.9))))
        pairs.append((p, o))
    return pairs


def fixed_lengths(num: int, prompt_len: int, output_len: int, range_ratio: float = 0.0,
                  seed: int = 0) -> list[tuple[int, int]]:
    """vLLM's `random` dataset: lengths uniform in [len*(1-r), len*(1+r)] (exactly len when r = 0)."""
    rng = random.Random(seed)

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    return [(draw(prompt_len), draw(output_len)) for _ in range(num)]


def build_requests(lengths: list[tuple[int, int]], seed: int = 0, vocab_high: int = VOCAB_HIGH
                   ) -> list[BenchRequest]:
    """Random token-id prompts: every server sees exactly the same tokens, no tokenizer round trip."""
    rng = random.Random(seed + 1)
    low = min(VOCAB_LOW, vocab_high // 4)  # small test vocabularies still get ids above their specials
    return [BenchRequest([rng.randrange(low, vocab_high) for _ in range(p)], o) for p, o in lengths]


def make_workload(dataset: str, num: int, seed: int, prompt_len: int = 200, output_len: int = 64,
                  max_prompt: int = 512, max_output: int = 128, vocab_high: int = VOCAB_HIGH
                  ) -> list[BenchRequest]:
    if dataset == "sharegpt":
        lengths = sharegpt_like_lengths(num, seed, max_prompt=max_prompt, max_output=max_output)
    elif dataset == "random":
        lengths = fixed_lengths(num, prompt_len, output_len, seed=seed)
    else:
        raise ValueError(f"unknown dataset {dataset!r}")
    return build_requests(lengths, seed, vocab_high)
