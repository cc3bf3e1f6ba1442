"""Engine-core outputs (token ids) -> RequestOutputs (text deltas, stop strings, running totals).

The engine core's step ends when the sampled ids are appended; turning them into text is the consumer's work,
as in vLLM V1, where the API server process detokenizes. In process (LLMEngine.step) the processor runs right
after the core step; behind ProcessEngine it runs in the parent while the child already computes the next step,
so detokenizing and building output records leave the step's critical path (at batch 256 of a one-layer model
they were more than half of its host time: benchmarks/step_overhead.py).

A stop string is only seen here. The caller then finishes the request in the core: at once in process; behind
ProcessEngine by an abort message, so the core may compute one more token, which is dropped here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.serving.detokenizer import IncrementalDetokenizer
from conveyor.serving.outputs import RequestOutput, SampledToken
from conveyor.serving.request import SamplingParams


@dataclass(slots=True)
class RequestTimes:
    """What a request's outputs carry apart from tokens: sent once, with its first output (as vLLM, the prefix
    hit counted is the first admission's), and stamped on every later output by the processor."""

    num_prompt_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None


@dataclass(slots=True)
class CoreOutputs:
    """One core step's outputs as columns, row i for request_ids[i]: built in one pass and pickled as a few flat
    lists (a record per request cost ~1 ms a step each way at batch 256 on a 2-core Zen 3, in the engine process
    that sends and the replica that reads). Sparse where few rows have something: finish reasons (EOS, a stop
    token, length, "error"), tokens with logprobs, and first outputs' RequestTimes."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int | None] = field(default_factory=list)  # None: ended without a token (finish "error")
    finish_reasons: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, SampledToken] = field(default_factory=dict)
    times: dict[int, RequestTimes] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, IncrementalDetokenizer] = {}
        # Requests whose first token has not come yet. Their detokenizer (which decodes the prompt's tail) is made
        # then: by that time the core has validated the prompt, and ids no tokenizer can decode never reach it.
        self._pending: dict[str, tuple[list[int], SamplingParams]] = {}
        self._times: dict[str, RequestTimes] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._pending[request_id] = (prompt_token_ids, params)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._times.pop(request_id, None)

    def sizes(self) -> dict[str, int]:
        """Entries per map: all 0 when no request is in flight (the engine's request_state reads these)."""
        return {"states": len(self._states), "pending": len(self._pending), "times": len(self._times)}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._pending

    def _first_output(self, request_id: str, times: RequestTimes | None) -> IncrementalDetokenizer | None:
        """A request's first output brings its RequestTimes; its detokenizer (which decodes the prompt's tail) is
        made then. None: not tracked (aborted, or a late token after its stop string)."""
        if times is None or (pending := self._pending.pop(request_id, None)) is None:
            return None
        prompt_token_ids, params = pending
        self._times[request_id] = times
        detok = self._states[request_id] = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        return detok

    def process(self, core: CoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """The outputs of one core step, and the ids of requests a stop string ended (finish them in the core).
        Outputs of requests no longer tracked (aborted, or a token computed after their stop string) are dropped."""
        outputs, stopped = [], []
        states, times_of = self._states, self._times
        finish_reasons, logprobs = core.finish_reasons, core.logprobs
        for row, (request_id, token_id) in enumerate(zip(core.request_ids, core.token_ids, strict=True)):
            detok = states.get(request_id) or self._first_output(request_id, core.times.get(row))
            if detok is None:
                continue
            times = times_of[request_id]
            new_ids = [] if token_id is None else [token_id]
            delta = detok.update(new_ids) if new_ids else ""
            finish_reason = finish_reasons.get(row)
            if finish_reason is None and detok.stopped:
                finish_reason = "stop"
                stopped.append(request_id)
            if finish_reason is not None:
                delta += detok.flush()
                del states[request_id]
                del times_of[request_id]
            # A row without a token (a failed request) reports no logprobs: the sampler drew nothing for it.
            sampled = logprobs.get(row) if new_ids else None
            # Positional, in RequestOutput's field order: matching 13 keywords cost ~1.2 us a row (Zen 3).
            outputs.append(RequestOutput(
                request_id, delta, new_ids, detok.text, detok.output_token_ids, times.num_prompt_tokens,
                finish_reason is not None, finish_reason, None if sampled is None else [sampled],
                times.num_cached_tokens, times.arrival_time, times.first_scheduled_time, times.first_token_time))
        return outputs, stopped
