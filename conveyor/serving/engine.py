"""LLMEngine: the synchronous core. add_request / abort / step."""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from conveyor.kernels import gguf, ops
from conveyor.serving import grammar
from conveyor.serving.attention import uniform_sliding_window
from conveyor.serving.config import EngineConfig
from conveyor.serving.detokenizer import PromptSide
from conveyor.serving.kv_cache_manager import KVCacheManager, cdiv
from conveyor.serving.memory import block_bytes, keep_freed_memory_in_process, num_kv_blocks, resolve_kv_cache_dtype
from conveyor.serving.model_runner import ModelRunner, profile_step
from conveyor.serving.models.cpu_packing import packable_dtypes
from conveyor.serving.models.decode_stack import DecodeStack
from conveyor.serving.models.gguf_weights import (
    attach_gguf_weights,
    default_gguf_max_rows,
    gguf_weights_unavailable_reason,
    load_blocks,
    multiply_in_int8,
    multiply_prefills_in_bfloat16,
)
from conveyor.serving.models.loader import generation_eos_ids, load_model, resolve_device_dtype
from conveyor.serving.output_processor import CoreOutputs, OutputProcessor, RequestTimes
from conveyor.serving.outputs import EngineStepStats, ModelRunnerOutput, RequestOutput, SchedulerOutput
from conveyor.serving.request import Request, RequestStatus, SamplingParams
from conveyor.serving.scheduler import Scheduler
from conveyor.serving.static_scheduler import StaticScheduler
from conveyor.serving.step_pipeline import LaunchedStep, StepPipeline
from conveyor.serving.step_trace import StepTrace

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005  # an engine with only compiling requests sleeps this long per step, not spin


class LLMEngine(PromptSide):
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self._pipeline = StepPipeline() if config.scheduler.async_scheduling else None
        self._on_step_thread(self._build)

    def _on_step_thread(self, fn: Callable[[], Any]) -> Any:
        """fn() on the thread that makes every torch call of this engine, its build included: the pipeline's under
        async scheduling (step_pipeline.py), else the caller's."""
        return fn() if self._pipeline is None else self._pipeline.call(fn)

    def _build(self) -> None:
        config = self.config
        self.device, self.dtype = resolve_device_dtype(config.model.device, config.model.dtype, config.model.model)
        torch.manual_seed(config.model.seed)
        if self.device.type == "cpu":
            keep_freed_memory_in_process()
        self.attention_backend = ops.resolve_backend(config.attention_backend, self.device)
        # Before the weights load: a backend that cannot hold this cache fails fast.
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype, self.attention_backend)
        self.model, self.hf_config, self.tokenizer = load_model(
            config.model.model, self.dtype, self.device, self.attention_backend, config.model.max_model_len)
        hf = self.hf_config
        self.num_params = sum(p.numel() for p in self.model.parameters())
        if config.cpu_weight_packing and self.device.type == "cpu" and self.dtype in packable_dtypes():
            self.model.pack_for_cpu()
        self.gguf_max_rows = default_gguf_max_rows(config) if config.gguf_max_rows is None else config.gguf_max_rows
        self.num_gguf_linears = self._attach_gguf_weights(self.gguf_max_rows)
        if config.cpu_prefill_dtype == "bfloat16":
            self._multiply_prefills_in_bfloat16()
        elif config.cpu_prefill_dtype == "int8":
            self._multiply_in_int8()
        self.model.decode_stack = self._decode_stack() if config.cpu_decode_stack and self.num_gguf_linears else None
        context_len = getattr(hf, "max_position_embeddings", 2048)
        self.max_model_len = min(config.model.max_model_len or context_len, context_len)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        block_size = config.cache.block_size
        per_block = block_bytes(hf.num_hidden_layers, block_size, hf.num_key_value_heads, head_dim,
                                self.kv_cache_dtype)
        sched_cfg = config.scheduler
        num_blocks = num_kv_blocks(config.cache, per_block, self.device, profile_step=functools.partial(
            profile_step, self.model, hf.num_hidden_layers, hf.num_key_value_heads, head_dim, block_size,
            self.device, self.dtype, num_tokens=sched_cfg.max_num_batched_tokens, num_seqs=sched_cfg.max_num_seqs,
            max_model_len=self.max_model_len, kv_cache_dtype=self.kv_cache_dtype))
        # Blocks leave the cache behind the window only where every layer slides with one window (Mistral).
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching,
                                       sliding_window=uniform_sliding_window(self.model))
        scheduler_cls = StaticScheduler if config.scheduler.scheduling == "static" else Scheduler
        self.scheduler = scheduler_cls(config.scheduler, self.kv_cache, self.max_model_len)
        self.runner = ModelRunner(self.model, hf.num_hidden_layers, hf.num_key_value_heads, head_dim,
                                  num_blocks, block_size, self.device, self.dtype,
                                  attention_backend=self.attention_backend, max_model_len=self.max_model_len,
                                  # a decode batch never exceeds the token budget: no graph above it
                                  max_num_seqs=min(sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens),
                                  cuda_graphs="capture" if config.enable_cuda_graphs else "off",
                                  kv_cache_dtype=self.kv_cache_dtype, split_mixed_steps=config.split_mixed_steps)
        self.eos_token_id = self.tokenizer.eos_token_id
        # A chat model may end its turn with a token other than the tokenizer's EOS (Gemma 3's <end_of_turn>, Llama
        # 3's <|eot_id|>): generation_config.json lists them, and they stop requests as stop tokens (as in vLLM).
        self.extra_eos_token_ids = tuple(t for t in generation_eos_ids(self.model.source_dir) if t != self.eos_token_id)
        if self.extra_eos_token_ids:
            logger.info("stop tokens from generation_config.json besides EOS: %s", list(self.extra_eos_token_ids))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammars: grammar.GrammarCompiler | None = None  # made at the first structured-output request
        self.step_trace = StepTrace.from_env()
        logger.info("engine ready: model=%s device=%s dtype=%s kv_cache_dtype=%s backend=%s kv_blocks=%d "
                    "(%d tokens) async_scheduling=%s", config.model.model, self.device, self.dtype,
                    self.kv_cache_dtype, self.attention_backend, num_blocks, num_blocks * block_size,
                    sched_cfg.async_scheduling)

    def _attach_gguf_weights(self, max_rows: int) -> int:
        if max_rows == 0:
            return 0
        blocks = load_blocks(self.model.source_dir)
        if blocks is None:
            return 0  # not converted from a GGUF: nothing to say
        reason = gguf_weights_unavailable_reason(self.device, self.dtype)
        if reason is not None:
            logger.info("GGUF blocks not used, all steps read fp32 weights: %s", reason)
            return 0
        count = attach_gguf_weights(self.model, blocks, max_rows)
        logger.info("%d linears read the GGUF's quantized blocks in steps of <= %d tokens", count, max_rows)
        return count

    def _multiply_prefills_in_bfloat16(self) -> None:
        if not self.num_gguf_linears:
            raise ValueError("cpu_prefill_dtype bfloat16 applies to a GGUF model's linears on CPU in float32 with "
                             "gguf_max_rows > 0; this engine reads no GGUF blocks")
        if torch.bfloat16 not in packable_dtypes():
            raise ValueError("cpu_prefill_dtype bfloat16 needs a CPU that multiplies bf16 natively (AVX512-BF16 or "
                             "AMX) and oneDNN; elsewhere bf16 is emulated, slower than float32")
        count = multiply_prefills_in_bfloat16(self.model)
        logger.info("%d linears multiply steps of > %d tokens in bfloat16", count, self.gguf_max_rows)

    def _multiply_in_int8(self) -> None:
        if not self.num_gguf_linears:
            raise ValueError("cpu_prefill_dtype int8 applies to a GGUF model's linears on CPU in float32 with "
                             "gguf_max_rows > 0; this engine reads no GGUF blocks")
        if not gguf.has_int8_kernel():
            raise ValueError("cpu_prefill_dtype int8 needs a CPU with AVX512-VNNI or AVX2 (the int8 kernels' "
                             "vpdpbusd, vpmaddubsw)")
        count = multiply_in_int8(self.model)
        logger.info("%d linears multiply steps of > %d rows (up to %d) with int8 activations", count,
                    gguf.ROWS_KERNEL_MAX_ROWS[gguf.Q4_1], self.gguf_max_rows)

    def _decode_stack(self) -> DecodeStack | None:
        try:
            stack = DecodeStack(self.model)
        except ValueError as exc:
            logger.info("decode steps run layer by layer from Python: %s", exc)
            return None
        logger.info("decode steps of <= %d tokens run their layers in one C++ call", stack.max_rows)
        return stack

    # ---- requests ----------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, *, validate_grammar: bool = True) -> Request:
        """Tokenize and validate; raises ValueError for input the engine can never serve. validate_grammar=False,
        or a constraint marked validated (the HTTP ingress checked it): the grammar is not checked again here (a
        large one takes tens of ms); one that fails to compile ends its request with finish_reason "error"."""
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab_size = self.hf_config.vocab_size
        if any(not 0 <= t < vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if any(t >= vocab_size for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
        num_prompt = len(token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(f"prompt has {num_prompt} tokens; this model's context is {self.max_model_len} "
                             "tokens and at least one must be left to generate")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                             f"context of {self.max_model_len} tokens")
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) exceeds max_tokens ({max_tokens})")
        capacity = self.kv_cache.max_tokens_ever()
        if cdiv(num_prompt + max_tokens, self.kv_cache.block_size) > self.kv_cache.num_blocks:
            raise ValueError(f"prompt + max_tokens ({num_prompt + max_tokens} tokens) can never fit this "
                             f"replica's KV cache of {capacity} tokens")
        if params.structured is not None and validate_grammar and not params.structured.validated:
            grammar.validate(params.structured)
        extra_eos = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
        if extra_eos and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *extra_eos))
        return Request(request_id or uuid.uuid4().hex, token_ids, params, eos_token_id=self.eos_token_id,
                       max_tokens=max_tokens)

    def add_request(self, request: Request, *, process_outputs: bool = True, check_ttft: bool = True) -> None:
        """Queue a request made by make_request; raises QueueFullError past the waiting bound. process_outputs=False:
        another process turns this engine's core outputs into text (engine_core_loop.py), so nothing is registered
        in this engine's output processor, which never runs there and would keep every request's prompt.
        check_ttft=False: TTFT admission decided already (the engine process's inbox thread)."""
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        structured = request.sampling_params.structured
        if structured is not None and request.grammar is None:
            request.grammar = self.grammar_compiler().submit(structured)
        self.scheduler.add_request(request, check_ttft=check_ttft)
        if process_outputs:
            self.output_processor.add(request.request_id, request.prompt_token_ids, request.sampling_params)

    def grammar_compiler(self) -> grammar.GrammarCompiler:
        if self.grammars is None:
            self.grammars = grammar.GrammarCompiler(self.tokenizer, self.hf_config.vocab_size,
                                                    timeout_s=self.config.grammar_compile_timeout_s)
        return self.grammars

    def abort_requests(self, request_ids: list[str]) -> None:
        for request in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            self.output_processor.remove(request.request_id)

    def release_finished(self) -> None:
        """On an idle engine: the model runner frees the rows, generators and last tokens of requests that ended
        at the start of its next step, which an idle engine never takes. An empty step carries their ids there
        now, so an engine at rest holds no per-request state."""
        if self.has_unfinished():
            return
        sched = self.scheduler.schedule()  # nothing to schedule: only the ended requests' ids
        self._on_step_thread(functools.partial(self.runner.execute, sched))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pipeline is not None and self._pipeline.in_flight)

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], EngineStepStats]:
        """A core step, then its outputs processed here (text, stop strings)."""
        core_outputs, stats = self.core_step()
        return self.process_outputs(core_outputs, stats), stats

    def process_outputs(self, core_outputs: CoreOutputs, stats: EngineStepStats) -> list[RequestOutput]:
        """A core step's outputs as RequestOutputs; requests a stop string ended are finished in the core at once.
        The time it took goes into stats.timings.process_s."""
        start = time.perf_counter()
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        stats.timings.process_s = time.perf_counter() - start
        return outputs

    def core_step(self) -> tuple[CoreOutputs, EngineStepStats]:
        """Schedule, run the model, sample, append: token ids out, no text (see output_processor.py). Under async
        scheduling the step whose outputs this returns was scheduled the call before, and the next one is
        already running when it returns (step_pipeline.py)."""
        pipeline = self._pipeline
        if pipeline is None:
            return self._finish(self._launch(self.runner.execute))
        submit = functools.partial(pipeline.submit, self.runner.execute)
        if not pipeline.in_flight:
            pipeline.push(self._launch(submit))
        if pipeline.has_room and self.scheduler.has_unfinished() and self._can_schedule_ahead():
            pipeline.push(self._launch(submit))
        return self._finish(pipeline.pop())

    def _can_schedule_ahead(self) -> bool:
        """No running request whose token in flight its next sampling reads (penalties, min_tokens, grammar)."""
        return not any(r.num_output_placeholders and r.reads_output for r in self.scheduler.running)

    def _launch(self, run: Callable[[SchedulerOutput], Any]) -> LaunchedStep:
        start = time.perf_counter()
        queries, hits = self.kv_cache.num_prefix_queries, self.kv_cache.num_prefix_hits
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.preempted_ids:
            self._wait_for_grammars()
        schedule_s = time.perf_counter() - start
        return LaunchedStep(sched, start, schedule_s, self.kv_cache.num_prefix_queries - queries,
                            self.kv_cache.num_prefix_hits - hits, run(sched))

    def _finish(self, step: LaunchedStep) -> tuple[CoreOutputs, EngineStepStats]:
        runner_out, execute_s = step.wait()
        executed = time.perf_counter()
        sched = step.sched
        # Classify chunks before update() appends the sampled tokens and moves the requests on.
        num_prefill = sum(c.num_tokens for c in sched.chunks if c.is_prefill)
        updated = self.scheduler.update(sched, runner_out)
        outputs = self._core_outputs(updated, sched.failed, runner_out)
        timings = runner_out.timings
        timings.schedule_s = step.schedule_s
        timings.output_s = time.perf_counter() - executed
        # Synchronous: the step's wall time. Async: the same parts, though scheduling overlapped the step before.
        step_time_s = step.schedule_s + execute_s + timings.output_s
        self.scheduler.observe_step(sched, step_time_s)
        stats = EngineStepStats(
            step_time_s=step_time_s, timings=timings,
            num_scheduled_tokens=sched.num_scheduled_tokens,
            num_prefill_tokens=num_prefill, num_decode_tokens=sched.num_scheduled_tokens - num_prefill,
            batch_size=len(sched.chunks), num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting, kv_cache_usage=self.kv_cache.usage,
            num_preemptions=len(sched.preempted_ids),
            num_prefix_cache_queries=step.num_prefix_queries, num_prefix_cache_hits=step.num_prefix_hits,
            finished_at=time.monotonic())
        if self.step_trace is not None:
            self.step_trace.write(stats)
        return outputs, stats

    def _wait_for_grammars(self, timeout_s: float = GRAMMAR_WAIT_S) -> None:
        """Nothing could be scheduled: if that is because grammars are compiling, wait a moment for one rather
        than spin (the caller's loop steps again at once while requests are unfinished)."""
        pending = [r.grammar for r in self.scheduler.waiting if r.grammar is not None and r.grammar.compiling]
        if pending:
            pending[0].wait(timeout_s)

    @staticmethod
    def _core_outputs(updated: list[Request], failed: list[Request], runner_out: ModelRunnerOutput) -> CoreOutputs:
        """The step's outputs as columns: a token per updated request, none for the failed; finish reasons,
        logprobs and RequestTimes only on the rows that have them."""
        request_ids = [r.request_id for r in updated]
        sampled = runner_out.sampled
        token_ids: list[int | None] = [sampled[rid] for rid in request_ids]
        out = CoreOutputs(request_ids, token_ids)
        if failed:
            request_ids += [r.request_id for r in failed]
            token_ids += [None] * len(failed)
            updated = updated + failed
        if runner_out.logprobs:
            out.logprobs = {row: runner_out.logprobs[rid] for row, rid in enumerate(request_ids)
                            if rid in runner_out.logprobs}
        now, running = time.monotonic(), RequestStatus.RUNNING
        for row, request in enumerate(updated):
            if request.status is not running and (reason := request.status.finish_reason) is not None:
                out.finish_reasons[row] = reason
            if request.first_token_time is None:
                request.first_token_time = now
                out.times[row] = RequestTimes(len(request.prompt_token_ids), request.num_cached_tokens,
                                              request.arrival_time, request.first_scheduled_time, now)
        return out
