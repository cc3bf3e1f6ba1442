"""LLM: the offline, vLLM-style entry point. LLM(model).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.serving.engine import LLMEngine
from conveyor.serving.outputs import RequestOutput, SampledToken
from conveyor.serving.request import Request, SamplingParams
from conveyor.serving.scheduler import QueueFullError

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
    def __init__(self, model: str = "smollm2", *, scheduling: str = "continuous", max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_bytes: int | None = None, memory_fraction: float = 0.25,
                 enable_prefix_caching: bool = True, max_model_len: int | None = None, dtype: str = "auto",
                 device: str = "auto", attention_backend: str = "auto", seed: int = 0,
                 itl_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
                 ttft_slo_ms: float | None = None, gguf_max_rows: int | None = None,
                 kv_cache_dtype: str = "auto", async_scheduling: bool = False, cpu_decode_stack: bool = True,
                 split_mixed_steps: bool = True) -> None:
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed),
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks, kv_cache_bytes=kv_cache_bytes,
                              memory_fraction=memory_fraction, enable_prefix_caching=enable_prefix_caching,
                              kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      scheduling=scheduling, itl_slo_ms=itl_slo_ms, tpot_slo_ms=tpot_slo_ms,
                                      ttft_slo_ms=ttft_slo_ms,
                                      async_scheduling=async_scheduling),
            attention_backend=attention_backend, gguf_max_rows=gguf_max_rows, cpu_decode_stack=cpu_decode_stack,
            split_mixed_steps=split_mixed_steps)
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
