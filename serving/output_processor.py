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

from dataclasses import dataclass
from typing import Any

from conveyor.serving.detokenizer import IncrementalDetokenizer
from conveyor.serving.outputs import RequestOutput, SampledToken
from conveyor.serving.request import SamplingParams


@dataclass(slots=True)
class CoreOutput:
    """One request's token from one core step. finish_reason: set when the core ended the request (EOS, a stop
    token, length); sampled: the token with its logprobs, when the request asked for them."""

    request_id: str
    token_id: int | None  # None: the core ended the request without a token (finish_reason "error")
    finish_reason: str | None
    sampled: SampledToken | None
    num_prompt_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, IncrementalDetokenizer] = {}
        # Requests whose first token has not come yet. Their detokenizer (which decodes the prompt's tail) is made
        # then: by that time the core has validated the prompt, and ids no tokenizer can decode never reach it.
        self._pending: dict[str, tuple[list[int], SamplingParams]] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._pending[request_id] = (prompt_token_ids, params)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._pending.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._pending

    def _detokenizer(self, request_id: str) -> IncrementalDetokenizer | None:
        detok = self._states.get(request_id)
        if detok is None and (pending := self._pending.pop(request_id, None)) is not None:
            prompt_token_ids, params = pending
            detok = self._states[request_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        return detok

    def process(self, core_outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The outputs of one core step, and the ids of requests a stop string ended (finish them in the core).
        Outputs of requests no longer tracked (aborted, or a token computed after their stop string) are dropped."""
        outputs, stopped = [], []
        for core in core_outputs:
            detok = self._detokenizer(core.request_id)
            if detok is None:
                continue
            new_ids = [] if core.token_id is None else [core.token_id]  # None: ended without a token (error)
            delta = detok.update(new_ids) if new_ids else ""
            finish_reason = core.finish_reason
            if finish_reason is None and detok.stopped:
                finish_reason = "stop"
                stopped.append(core.request_id)
            if finish_reason is not None:
                delta += detok.flush()
                del self._states[core.request_id]
            outputs.append(RequestOutput(
                request_id=core.request_id, delta_text=delta, delta_token_ids=new_ids, text=detok.text,
                token_ids=detok.output_token_ids, num_prompt_tokens=core.num_prompt_tokens,
                finished=finish_reason is not None, finish_reason=finish_reason,
                delta_logprobs=None if core.sampled is None else [core.sampled],
                num_cached_tokens=core.num_cached_tokens, arrival_time=core.arrival_time,
                first_scheduled_time=core.first_scheduled_time, first_token_time=core.first_token_time))
        return outputs, stopped
