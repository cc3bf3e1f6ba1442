"""Engine configuration: frozen dataclasses, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's kv_cache_dtype values we support: "auto" is the model's dtype; "fp8" is fp8_e4m3, as in vLLM.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
# SchedulerConfig.admission_policy: refuse what would miss its TTFT target, or queue everything up to the bounds.
ADMISSION_POLICIES = ("slo", "queue")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Exactly one sizing rule applies: an explicit block count, a byte budget, or (neither given) a memory rule:
    # on CPU memory_fraction of MemAvailable; on CUDA gpu_memory_utilization (vLLM semantics): the engine may use
    # that fraction of the device's TOTAL memory, and the KV cache gets what the weights, a profiled max-size
    # step's peak activations and memory outside torch's allocator leave of it.
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    memory_fraction: float = 0.25
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # The KV cache's element type (vLLM's --kv-cache-dtype): "auto" is the model's dtype. A float32 model with a
    # bfloat16 cache halves the KV bytes: twice the blocks for the same budget, half the bytes decode reads. An fp8
    # cache (e4m3: 3 mantissa bits, largest 448; e5m2: 2 bits, largest 57344; no scales, writes saturate) quarters
    # them, at a cost in accuracy that benchmarks/kv_cache_quality.py measures; cpu and torch attention only.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # Bounded admission: past these the engine raises QueueFullError (HTTP 429 upstream).
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1 << 20
    # Overload shedding: refuse (429) a request whose expected wait for a batch slot exceeds this many seconds,
    # estimated from the running requests' remaining max_tokens and recent step times. An upper bound when
    # outputs stop early at EOS, so it sheds conservatively. None: only the queue bounds above apply.
    max_queue_wait_s: float | None = None
    # "continuous" (iteration-level) or "static" (the baseline: a batch runs until its longest member ends).
    scheduling: str = "continuous"
    enable_chunked_prefill: bool = True
    # Tail-latency mode: size every step's token budget so its predicted time stays under this inter-token
    # latency target (measured online), admitting prefill chunks only with the slack. None: fixed budget.
    itl_slo_ms: float | None = None
    # SLO-aware scheduling, on by default (Sarathi-Serve's stall-free batching with the chunk sized by time, not
    # by a fixed token count): while requests decode, each step carries the prefill tokens that keep its predicted
    # time (the fitted mean: TPOT is a mean over a request's tokens) under tpot_slo_ms * slo_headroom; a step with
    # no decodes takes up to max_num_batched_tokens. None: the fixed max_num_batched_tokens budget.
    tpot_slo_ms: float | None = 100.0
    # Admission by time to first token. "slo": a request whose predicted first-token time (the prefill queued
    # ahead of it at the pace the step budget allows, plus its own) exceeds ttft_slo_ms * slo_headroom is refused
    # at once (QueueFullError, HTTP 429 with Retry-After), so the requests admitted keep their SLO past capacity.
    # "queue": every request waits its turn up to the queue bounds, as vLLM does. None: no TTFT admission.
    ttft_slo_ms: float | None = 2000.0
    admission_policy: str = "slo"
    # Aim the step's prediction at this fraction of the SLO: it leaves room for the work between steps
    # (detokenizing, streaming) that the client sees in its inter-token gaps but the step timer does not.
    slo_headroom: float = 0.85
    # TPOT is a mean over a request's output tokens: a step may run longer than the target by the time the
    # slowest-paced running stream is ahead of its own pace, up to tpot_credit_max x the target (0: no credit).
    tpot_credit_max: float = 3.0
    # Tail-latency mode never lets pending prefill stall: each step gives it at least this many tokens, even
    # when the decodes alone fill the target (a long prompt waiting forever is worse than a slightly slow step).
    # 8, not 16: on 2 CPU cores a 16-token chunk of a 2k prompt made the step ~2.5x a plain decode step and broke
    # a 70 ms SLO (p99 71, max 323 ms); 8 kept it (p99 59, max 69) for ~30% more long-prompt TTFT (RESULTS.md).
    min_prefill_tokens: int = 8
    # vLLM's async scheduling: step N+1 is scheduled, and step N's tokens are turned into outputs, while step N's
    # forward runs (serving/step_pipeline.py). The engine learns a request ended one step late, so a request that
    # stops at EOS has one wasted token computed; steps with a request whose sampling reads its own output
    # (penalties, min_tokens, grammars) wait for the step before.
    async_scheduling: bool = False

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
        if not 0.0 < self.slo_headroom <= 1.0:
            raise ValueError("slo_headroom must be in (0, 1]")
        if self.max_queue_wait_s is not None and self.max_queue_wait_s <= 0:
            raise ValueError("max_queue_wait_s must be > 0")
        if self.min_prefill_tokens < 1:
            raise ValueError("min_prefill_tokens must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}")
        if self.async_scheduling and self.scheduling == "static":
            raise ValueError("async_scheduling needs scheduling 'continuous' (the static baseline stays synchronous)")


@dataclass(frozen=True)
class ModelConfig:
    model: str = "smollm2"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: str = "auto"
    # CPU float32, and bfloat16 where the CPU has native bf16: pre-pack weights for oneDNN (see models/cpu_packing.py).
    cpu_weight_packing: bool = True
    # CUDA only (ignored on CPU): replay captured CUDA graphs for pure-decode steps (see cuda_graphs.py).
    enable_cuda_graphs: bool = True
    # CPU float32, model converted from a GGUF: steps of at most gguf_max_rows tokens multiply by the file's own
    # quantized blocks (Q4_1/Q8_0), the same weights in 5-8.5 bits rather than 32 (see models/gguf_weights.py).
    # 0 turns it off; every step then uses the fp32 weights. None: by the CPU (kernels.gguf.default_max_rows).
    gguf_max_rows: int | None = None
    # CPU, every projection in GGUF blocks: a step of decodes only runs its decoder layers in one C++ call instead of
    # ~10 Python-driven kernel calls per layer, bit-identical (see models/decode_stack.py). The CPU's CUDA graph.
    cpu_decode_stack: bool = True
    # With that loop: a step mixing decodes and prefill chunks runs as two forwards, the decodes through the loop,
    # the chunks through the module path (model_runner.py _forward_split), rather than every row through the latter.
    split_mixed_steps: bool = True
    # Structured outputs: a grammar still compiling after this long fails its request (finish_reason "error").
    grammar_compile_timeout_s: float = 30.0
    # vLLM's stream_interval: a stream gets a request's tokens every this many (its first and last at once): fewer,
    # larger records for every process on the path, for a coarser stream.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.gguf_max_rows is not None and self.gguf_max_rows < 0:
            raise ValueError(f"gguf_max_rows must be >= 0, got {self.gguf_max_rows}")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton", "cuda", "flash"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")
