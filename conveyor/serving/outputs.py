"""Records passed between scheduler, model runner and engine. No torch here."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from conveyor.serving.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: tokens [start, start + num_tokens) of its prompt+output."""

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]  # the request's whole block table after this step's allocation
    # Set at scheduling (read several times per chunk per step, before the step's tokens are appended):
    # a token is sampled only when the chunk reaches the request's last known token.
    samples: bool = field(init=False)
    is_prefill: bool = field(init=False)

    def __post_init__(self) -> None:
        request = self.request
        num_prompt = len(request.prompt_token_ids)
        end = self.start + self.num_tokens
        num_tokens = num_prompt + len(request.output_token_ids) + request.num_output_placeholders
        self.samples = end == num_tokens
        self.is_prefill = end < num_tokens or self.start < num_prompt

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that ended since the last step: the runner drops their per-request state (seeded generators).
    finished_ids: list[str] = field(default_factory=list)
    # Requests this schedule ended without a token (a grammar that failed to compile): the engine reports them.
    failed: list[Request] = field(default_factory=list)

    # Cached: read several times per step, and `chunks` is complete once the scheduler returns the output.
    @functools.cached_property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @functools.cached_property
    def num_kv_reads(self) -> int:
        """Key/value rows the step's attention reads: each token attends over its causal prefix, so a chunk of
        q tokens ending at e reads q * e - q * (q - 1) / 2 (a decode reads its context once)."""
        return sum(c.num_tokens * c.end - c.num_tokens * (c.num_tokens - 1) // 2 for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass
class StepTimings:
    """Where one step's wall time went (seconds). On CUDA the forward is asynchronous: its kernels finish inside
    sample_s, where the sampled tokens are copied to the host."""

    schedule_s: float = 0.0
    prepare_s: float = 0.0  # the runner's input tensors and attention metadata
    forward_s: float = 0.0  # the decoder (logits included)
    sample_s: float = 0.0
    output_s: float = 0.0  # scheduler update, token-level output records
    # Output processing (detokenizing, stop strings, RequestOutputs): after the core step, in the consumer's
    # process; 0 where the consumer is another process (ProcessEngine's parent does it).
    process_s: float = 0.0

    @property
    def host_s(self) -> float:
        """The core step's host work: everything but the forward."""
        return self.schedule_s + self.prepare_s + self.sample_s + self.output_s


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> the token id it sampled
    # The sampled tokens with their logprobs, for the requests that asked.
    logprobs: dict[str, SampledToken] = field(default_factory=dict)
    timings: StepTimings = field(default_factory=StepTimings)


@dataclass
class EngineStepStats:
    step_time_s: float = 0.0
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    batch_size: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    timings: StepTimings = field(default_factory=StepTimings)
    # time.monotonic() when the step's tokens were sampled (one clock for every process of a host): metrics time
    # tokens by it, since a step's outputs may reach them later, several steps at once (step_batching.py).
    finished_at: float = 0.0


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: a delta for streaming plus the totals so far."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    text: str
    token_ids: list[int]  # the request's output so far: a live list, copy it to keep a snapshot
    num_prompt_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    delta_logprobs: list[SampledToken] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: the deltas joined, the totals and the end of the last."""
    last = outputs[-1]
    logprobs = None
    if any(o.delta_logprobs is not None for o in outputs):
        logprobs = [entry for o in outputs for entry in (o.delta_logprobs or [])]
    return dataclasses.replace(
        last, delta_text="".join(o.delta_text for o in outputs),
        delta_token_ids=[t for o in outputs for t in o.delta_token_ids], delta_logprobs=logprobs,
        first_scheduled_time=outputs[0].first_scheduled_time, first_token_time=outputs[0].first_token_time)
