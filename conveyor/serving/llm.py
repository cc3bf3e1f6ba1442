"""LLM: the offline, vLLM-style entry point. LLM(model).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.serving.admission import QueueFullError
from conveyor.serving.engine import LLMEngine
from conveyor.serving.outputs import RequestOutput, SampledToken
from conveyor.serving.request import Request, SamplingParams
from conveyor.serving.settings import ENGINE_KEYS, SURFACE_DEFAULTS, engine_config_from_flat, surface_defaults

Prompt = str | list[int]


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[SampledToken] | None = None
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str = ENGINE_KEYS["model"].default, **settings: Any) -> None:
        """Keywords: the flat engine keys (docs/configuration.md), with the offline defaults (SURFACE_DEFAULTS:
        no SLO step budget or TTFT admission, since no client waits on a first token)."""
        unknown = set(settings) - set(ENGINE_KEYS)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        config = engine_config_from_flat(SURFACE_DEFAULTS["offline"] | settings | {"model": model})
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[GenerationResult]:
        """Run every prompt to completion; results come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        # Validate everything first, so a bad prompt rejects the call before any work starts.
        requests = [self.engine.make_request(p, sp, self._new_id()) for p, sp in zip(prompts, params_list, strict=True)]
        finals: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[SampledToken]] = {r.request_id: [] for r in requests}
        pending = list(requests)
        while pending or self.engine.has_unfinished():
            pending = self._add_while_room(pending)
            outputs, _ = self.engine.step()
            for out in outputs:
                if out.delta_logprobs:
                    logprobs[out.request_id].extend(out.delta_logprobs)
                if out.finished:
                    finals[out.request_id] = out
        return [self._result(r, finals[r.request_id], logprobs[r.request_id] or None) for r in requests]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, sampling_params)

    def _add_while_room(self, pending: list) -> list:
        for i, request in enumerate(pending):
            try:
                self.engine.add_request(request)
            except QueueFullError:
                return pending[i:]
        return []

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                           n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} prompts")
        return list(params)

    def _new_id(self) -> str:
        self._next_id += 1
        return f"llm-{self._next_id}"

    @staticmethod
    def _result(request: Request, final: RequestOutput, logprobs: list[SampledToken] | None) -> GenerationResult:
        return GenerationResult(request.request_id, request.prompt_token_ids, final.text, list(final.token_ids),
                                final.finish_reason, logprobs, final.num_cached_tokens)


def _signature() -> inspect.Signature:
    """LLM.__init__'s signature as help() shows it: every engine key a keyword, with its offline default."""
    defaults = surface_defaults("offline")
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=defaults["model"])]
    params += [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=defaults[key],
                                 annotation=spec.annotation) for key, spec in ENGINE_KEYS.items() if key != "model"]
    return inspect.Signature(params, return_annotation=None)


LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
