"""Seeded arrivals and request lengths: everything a run draws from its seed, nothing from the wall clock."""
from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
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
    arrivals = _arrivals(rate, burstiness, seed)
    return [next(arrivals) for _ in range(num)]


def _arrivals(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """The send times of an endless gamma arrival process (see arrival_offsets)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    rng = random.Random(seed)
    return itertools.accumulate(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in itertools.count())


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


@dataclass(frozen=True)
class LogNormal:
    """A log-normal length given by its median and mean (what a workload description states), clipped."""
    median: float
    mean: float
    min_len: int
    max_len: int

    @property
    def sigma(self) -> float:
        # mean = median * exp(sigma^2 / 2) for a log-normal
        return math.sqrt(2.0 * math.log(self.mean / self.median))

    def draw(self, rng: random.Random) -> int:
        return min(self.max_len, max(self.min_len, round(rng.lognormvariate(math.log(self.median), self.sigma))))


# The goodput workload of issue 38 (design.md section 7): prompts median 163 / mean 210 tokens (max ~1,240),
# outputs median 48 / mean 68 (max 300).
LOGNORMAL_PROMPT = LogNormal(median=163, mean=210, min_len=16, max_len=1240)
LOGNORMAL_OUTPUT = LogNormal(median=48, mean=68, min_len=4, max_len=300)


def lognormal_lengths(num: int, seed: int = 0, prompt: LogNormal = LOGNORMAL_PROMPT,
                      output: LogNormal = LOGNORMAL_OUTPUT) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs, both log-normal (the shape of chat traffic), seeded."""
    rng = random.Random(seed)
    return [(prompt.draw(rng), output.draw(rng)) for _ in range(num)]


def derive_seed(seed: int, *parts: object) -> int:
    """A seed of its own for each (run seed, rate point, purpose): neighbouring points never share prompts
    (seed + index would hand point 1 of seed 0 the prompts of point 0 of seed 1). Stable across processes:
    random.Random hashes a str seed with SHA-512, not with the salted hash()."""
    return random.Random("/".join(str(x) for x in (seed, *parts))).getrandbits(62)


def _token_range(vocab_high: int) -> tuple[int, int]:
    return min(VOCAB_LOW, vocab_high // 4), vocab_high  # small test vocabularies still get ids above their specials


def shared_prefix(prefix_len: int, seed: int, vocab_high: int = VOCAB_HIGH) -> list[int]:
    """vLLM's --random-prefix-len: the same prefix_len tokens before every prompt of every rate point."""
    rng = random.Random(derive_seed(seed, "prefix"))
    low, high = _token_range(vocab_high)
    return [rng.randrange(low, high) for _ in range(prefix_len)]


def build_requests(lengths: list[tuple[int, int]], seed: int = 0, vocab_high: int = VOCAB_HIGH,
                   prefix: list[int] | None = None) -> list[BenchRequest]:
    """Random token-id prompts (after `prefix`, if any): every server sees exactly the same tokens, no tokenizer
    round trip."""
    rng = random.Random(seed + 1)
    low, high = _token_range(vocab_high)
    head = list(prefix or [])
    return [BenchRequest(head + [rng.randrange(low, high) for _ in range(p)], o) for p, o in lengths]


DATASETS = ("sharegpt", "random", "lognormal")


def make_workload(dataset: str, num: int, seed: int, prompt_len: int = 200, output_len: int = 64,
                  max_prompt: int = 512, max_output: int = 128, vocab_high: int = VOCAB_HIGH,
                  prefix: list[int] | None = None) -> list[BenchRequest]:
    if dataset == "sharegpt":
        lengths = sharegpt_like_lengths(num, seed, max_prompt=max_prompt, max_output=max_output)
    elif dataset == "random":
        lengths = fixed_lengths(num, prompt_len, output_len, seed=seed)
    elif dataset == "lognormal":
        lengths = lognormal_lengths(num, seed)
    else:
        raise ValueError(f"unknown dataset {dataset!r}; one of {', '.join(DATASETS)}")
    return build_requests(lengths, seed, vocab_high, prefix)


def timed_offsets(duration_s: float, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times of every arrival of the process before duration_s (the warm-up window): as many requests as
    the rate brings in that time, not a fixed count."""
    if duration_s <= 0 or math.isinf(rate):
        return []
    return list(itertools.takewhile(lambda t: t < duration_s, _arrivals(rate, burstiness, seed)))
