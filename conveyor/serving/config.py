"""Engine configuration: frozen dataclasses, validated at construction.

These dataclasses are the one source of every engine setting: its type, default and help text (the field's
metadata). `conveyor serve`'s ServeArgs, the `conveyor` flags and `LLM(...)`'s keywords are derived from them
(conveyor/serving/settings.py), and docs/configuration.md is generated from them (scripts/config_docs.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# vLLM's kv_cache_dtype values we support: "auto" is the model's dtype; "fp8" is fp8_e4m3, as in vLLM.
CPU_PREFILL_DTYPES = ("float32", "bfloat16", "int8")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
# SchedulerConfig.admission_policy: refuse what would miss its TTFT target, or queue everything up to the bounds.
ADMISSION_POLICIES = ("slo", "queue")
SCHEDULING_POLICIES = ("continuous", "static")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "cuda", "flash")


def setting(default: Any, help: str, *, choices: tuple[str, ...] | None = None) -> Any:  # noqa: A002
    """A dataclass field carrying its help text (and allowed values) for the flags, ServeArgs and the docs."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = setting(16, "tokens per KV cache block (a power of two)")
    # Exactly one sizing rule applies: an explicit block count, a byte budget, or (neither given) a memory rule.
    num_blocks: int | None = setting(None, "KV cache size in blocks (None: from kv_cache_bytes or the memory rule)")
    kv_cache_bytes: int | None = setting(None, "KV cache size in bytes (None: from the memory rule)")
    memory_fraction: float = setting(0.25, "CPU: the KV cache takes this fraction of MemAvailable")
    gpu_memory_utilization: float = setting(
        0.9, "CUDA (vLLM semantics): the engine may use this fraction of the device's total memory; the KV cache "
        "gets what the weights, a profiled max-size step's peak activations and memory outside torch leave of it")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of a prompt prefix seen before")
    # A float32 model with a bfloat16 cache halves the KV bytes: twice the blocks for the same budget, half the bytes
    # decode reads. fp8 has no scales (writes saturate); benchmarks/kv_cache_quality.py measures its accuracy cost.
    kv_cache_dtype: str = setting(
        "auto", "the KV cache's element type (vLLM's --kv-cache-dtype; auto: the model's dtype); bfloat16 on a "
        "float32 model holds twice the tokens, fp8 (e4m3) four times (cpu and torch attention only)",
        choices=KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = setting(512, "token budget per step (prefill chunks + decodes)")
    max_num_seqs: int = setting(64, "sequences per step")
    # Bounded admission: past these the engine raises QueueFullError (HTTP 429 upstream).
    max_waiting_requests: int = setting(1024, "waiting-queue bound; beyond it a request is refused (429)")
    max_waiting_tokens: int = setting(1 << 20, "bound on the prompt tokens waiting; beyond it 429")
    # Estimated from the running requests' remaining max_tokens and recent step times: an upper bound when outputs
    # stop early at EOS, so it sheds conservatively.
    max_queue_wait_s: float | None = setting(
        None, "also refuse (429) a request whose expected wait for a batch slot exceeds this many seconds "
        "(None: only the queue bounds)")
    scheduling: str = setting(
        "continuous", "continuous (iteration-level) or static (the baseline: a batch runs until its longest member "
        "ends)", choices=SCHEDULING_POLICIES)
    enable_chunked_prefill: bool = setting(True, "split long prompts into chunks that share steps with decodes")
    itl_slo_ms: float | None = setting(
        None, "tail-latency mode: size every step's token budget so its predicted time stays under this "
        "inter-token latency target, prefill chunks only with the slack (None: fixed budget)")
    # Sarathi-Serve's stall-free batching with the chunk sized by time, not by a fixed token count.
    tpot_slo_ms: float | None = setting(
        100.0, "while requests decode, each step carries the prefill that keeps its predicted mean time under "
        "tpot_slo_ms x slo_headroom (None: the fixed max_num_batched_tokens budget)")
    ttft_slo_ms: float | None = setting(
        2000.0, "with admission_policy slo, a request whose predicted first-token time exceeds ttft_slo_ms x "
        "slo_headroom is refused at once (429 with Retry-After) (None: no TTFT admission)")
    admission_policy: str = setting(
        "slo", "slo: refuse what would miss its TTFT target, so admitted requests keep their SLO past capacity; "
        "queue: every request waits its turn up to the queue bounds, as vLLM does", choices=ADMISSION_POLICIES)
    # Room for the work between steps (detokenizing, streaming) that the client sees but the step timer does not.
    slo_headroom: float = setting(0.85, "aim each step's prediction at this fraction of the SLO targets")
    tpot_credit_max: float = setting(
        3.0, "a step may exceed the TPOT target by the time the slowest-paced stream is ahead of its pace, up to "
        "this many targets (TPOT is a mean; 0: no credit)")
    tpot_credit_quantile: float | None = setting(
        0.1, "a stream's credit also counts the tokens it is expected to go on for, this lower quantile of recent "
        "finished requests' output lengths (among those longer than it), each worth the target less the mean step "
        "time (None: pace only)")
    # A 210-token prompt beside 20 decodes in 5 chunks took 449 ms of steps; whole, then 4 decode-only steps (the
    # same tokens): 373 ms (bf16 prefill, Zen 4, RESULTS.md): small chunks pay the step's decode rows and fixed
    # cost again and run the linears at a small-GEMM rate.
    min_chunk_tokens: int | None = setting(
        None, "while requests decode, a step takes prefill only if the TPOT target (with its credit) lets it take "
        "at least this many tokens, or all that is pending; otherwise it runs the decodes alone, which puts the "
        "streams ahead of their pace and grows the credit, for at most tpot_credit_max targets (None: any chunk)")
    # 8, not 16: on 2 CPU cores a 16-token chunk of a 2k prompt made the step ~2.5x a plain decode step and broke
    # a 70 ms SLO (p99 71, max 323 ms); 8 kept it (p99 59, max 69) for ~30% more long-prompt TTFT (RESULTS.md).
    min_prefill_tokens: int = setting(
        8, "tail-latency mode: every step gives pending prefill at least this many tokens, so it never stalls")
    # The engine learns a request ended one step late (one wasted token at EOS); steps with a request whose sampling
    # reads its own output (penalties, min_tokens, grammars) wait for the step before.
    async_scheduling: bool = setting(
        False, "vLLM's async scheduling: schedule step N+1 while step N's forward runs (serving/step_pipeline.py)")

    def __post_init__(self) -> None:
        for name in ("itl_slo_ms", "tpot_slo_ms", "ttft_slo_ms"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of milliseconds or None, got {value}")
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission_policy must be one of {', '.join(ADMISSION_POLICIES)}; "
                             f"got {self.admission_policy!r}")
        if not 0.0 <= self.tpot_credit_max < float("inf"):
            raise ValueError(f"tpot_credit_max must be a finite number >= 0, got {self.tpot_credit_max}")
        if self.tpot_credit_quantile is not None and not 0.0 <= self.tpot_credit_quantile < 1.0:
            raise ValueError(f"tpot_credit_quantile must be in [0, 1) or None, got {self.tpot_credit_quantile}")
        if not 0.0 < self.slo_headroom <= 1.0:
            raise ValueError("slo_headroom must be in (0, 1]")
        if self.max_queue_wait_s is not None and self.max_queue_wait_s <= 0:
            raise ValueError("max_queue_wait_s must be > 0")
        if self.min_chunk_tokens is not None and self.min_chunk_tokens < 1:
            raise ValueError(f"min_chunk_tokens must be >= 1 or None, got {self.min_chunk_tokens}")
        for name in ("min_prefill_tokens", "max_num_batched_tokens", "max_num_seqs", "max_waiting_requests",
                     "max_waiting_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}")
        if self.async_scheduling and self.scheduling == "static":
            raise ValueError("async_scheduling needs scheduling 'continuous' (the static baseline stays synchronous)")


@dataclass(frozen=True)
class ModelConfig:
    model: str = setting("smollm2", "'smollm2', a local HF directory, or a .gguf file")
    dtype: str = setting(
        "auto", "the model's dtype (auto: the checkpoint's where the device computes it natively, else float32: "
        "CUDA runs bf16/fp16 as stored, a CPU bf16 only with AVX512-BF16 or AMX; a GGUF float32 on CPU, bf16 on "
        "CUDA)")
    device: str = setting("auto", "auto, cpu or cuda")
    max_model_len: int | None = setting(
        None, "context length (None: the model's own); past a LongRoPE model's original context: its long factors")
    seed: int = setting(0, "the engine's random seed (requests without their own seed)")

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: str = setting("auto", "attention implementation", choices=ATTENTION_BACKENDS)
    cpu_weight_packing: bool = setting(
        True, "CPU float32, and bfloat16 where the CPU has native bf16: pre-pack weights for oneDNN "
        "(models/cpu_packing.py)")
    enable_cuda_graphs: bool = setting(
        True, "CUDA only: replay captured CUDA graphs for pure-decode steps (cuda_graphs.py)")
    # The same weights in 5-8.5 bits rather than 32 (models/gguf_weights.py).
    gguf_max_rows: int | None = setting(
        None, "CPU float32, model from a GGUF: steps of at most this many tokens multiply by the file's quantized "
        "blocks (0: always the fp32 weights; None: by the CPU, 64 with AVX-512 or AVX2, else 8; with "
        "cpu_prefill_dtype bfloat16 64 where AVX512-BF16 gives the blocks a bf16 kernel, else 12; with int8 "
        "every step)")
    # Prefill is most of a CPU server's work; oneDNN's packed bf16 GEMM runs it at ~1.8x fp32's where bf16 is native.
    cpu_prefill_dtype: str = setting(
        "float32", "CPU, model from a GGUF: the element type the decoder layers' linears multiply in for steps "
        "past gguf_max_rows (prefill chunks, large decode batches), and with AVX512-BF16 the blocks' steps of "
        "8 rows or more too; bfloat16 needs AVX512-BF16 or AMX, ~1.8x the float32 rate, and rounds those "
        "matmuls' inputs and weights to bf16, so greedy outputs may differ from float32's; int8 (AVX512-VNNI "
        "or AVX2) multiplies every step past 3 rows (Q8_0: 6) over the blocks with each block of 32 activations "
        "rounded to int8, llama.cpp's arithmetic, ~1.5x bfloat16's rate (AVX2: 1.8-2.2x float32's), with the same "
        "caveat",
        choices=CPU_PREFILL_DTYPES)
    # The CPU's CUDA graph: ~10 Python-driven kernel calls per layer become one C++ call, bit-identical.
    cpu_decode_stack: bool = setting(
        True, "CPU, every projection in GGUF blocks: a decode-only step runs its layers in one C++ call "
        "(models/decode_stack.py)")
    # Off: on a 2-core Zen 4 the two forwards cost what one mixed forward does (RESULTS.md, "Step cost").
    split_mixed_steps: bool = setting(
        False, "with cpu_decode_stack: a step mixing decodes and prefill chunks runs as two forwards, the decodes "
        "through the C++ loop (model_runner.py _forward_split)")
    grammar_compile_timeout_s: float = setting(
        30.0, "structured outputs: a grammar still compiling after this many seconds fails its request")
    # Fewer, larger records for every process on the path, for a coarser stream.
    stream_interval: int = setting(
        1, "vLLM's stream_interval: a stream gets a request's tokens every this many (its first and last at once)")
    # One message per decode step wakes every process on the path mid-step (step_batching.py).
    stream_batching_interval_ms: float = setting(
        0.0, "Ray Serve LLM's stream_batching_interval_ms: the engine process sends decode steps' outputs at most "
        "this often, several steps in one message (a first token, a last one and errors at once; 0: every step)")

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if not self.stream_batching_interval_ms >= 0:
            raise ValueError(f"stream_batching_interval_ms must be >= 0, got {self.stream_batching_interval_ms}")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.cpu_prefill_dtype not in CPU_PREFILL_DTYPES:
            raise ValueError(f"cpu_prefill_dtype must be one of {CPU_PREFILL_DTYPES}, got {self.cpu_prefill_dtype!r}")
        if self.gguf_max_rows is not None and self.gguf_max_rows < 0:
            raise ValueError(f"gguf_max_rows must be >= 0, got {self.gguf_max_rows}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")
