"""build_app(args) -> serve.Application: the import_path of deploy/serve.yaml and what `conveyor serve` runs.

    applications:
      - name: conveyor
        import_path: conveyor.router.app:build_app
        args: {model: smollm2, num_replicas: 2, num_cpus: 1, max_num_seqs: 32}
"""
from __future__ import annotations

import importlib
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.serve.config import RequestRouterConfig

from conveyor.router.autoscaling import AutoscalingArgs
from conveyor.router.ingress import Ingress, IngressSettings
from conveyor.router.replica import EngineReplica
from conveyor.serving.config import KV_CACHE_DTYPES, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

logger = logging.getLogger(__name__)

DEFAULT_ROUTER = "conveyor.router.routing:LoadAwarePrefixRouter"
INGRESS_DRAIN_MARGIN_S = 5.0


class ServeArgs(BaseModel):
    """Everything a deployment is configured with: the YAML `args`, `conveyor serve` flags and tests."""

    model_config = ConfigDict(extra="forbid")  # a misspelled key in a YAML file should fail the deploy

    # model and replicas
    model: str = "smollm2"
    served_model_name: str | None = None  # the id clients send as `model`; default: `model`
    num_replicas: int = Field(1, ge=1)
    autoscaling_config: dict[str, Any] | None = None  # a raw Serve autoscaling_config, passed as is
    # Conveyor's queue + tail-latency policy (conveyor/router/autoscaling.py); replaces num_replicas.
    autoscaling: AutoscalingArgs | None = None
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    torch_num_threads: int | None = Field(None, ge=1)  # several replicas on one host: split the cores
    # Step the engine in a child process of the replica (its own GIL, as vLLM's EngineCore): Serve's request
    # machinery then cannot slow the steps down. False: a thread inside the replica process.
    engine_process: bool = True
    # engine
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_bytes: int | None = Field(None, ge=1)
    # the KV cache's dtype (vLLM's kv_cache_dtype): auto is the model's; bfloat16 on a float32 CPU model halves it
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = "auto"
    memory_fraction: float = Field(0.25, gt=0, le=1)  # CPU: of MemAvailable
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # CUDA: of total device memory (vLLM semantics)
    enable_cuda_graphs: bool = True  # CUDA only: replay captured graphs for decode steps
    gguf_max_rows: int | None = Field(None, ge=0)  # CPU, GGUF model: steps this small read the quantized blocks;
    # 0 off, None by the CPU (64 with AVX-512 or AVX2, else 8)
    cpu_decode_stack: bool = True  # CPU, GGUF model: a decode step's layers in one C++ call (models/decode_stack.py)
    grammar_compile_timeout_s: float = Field(30.0, gt=0)  # structured outputs: a slower compile fails its request
    # vLLM's --stream-interval: streamed tokens leave the replica every this many (the first and last at once)
    stream_interval: int = Field(1, ge=1)
    # health: a replica whose engine has work but completed no step for this long fails its health check (Serve
    # replaces it after 3 failed checks, health_check_period_s apart)
    engine_stall_timeout_s: float = Field(120.0, gt=0)
    health_check_period_s: float = Field(5.0, gt=0)
    # a replica being removed (scale-in, redeploy, replaced after failed health checks) finishes its streams for at
    # most this long before Serve kills it (Serve's graceful_shutdown_timeout_s)
    drain_timeout_s: float = Field(20.0, ge=0)
    # a redeploy that restarts replicas (any change under `args`) starts this share of extra replicas before it
    # stops old ones (Serve's max_surge_percent): 100 keeps full capacity but needs room for the extra replicas;
    # 0 (Serve's default) replaces them a batch at a time, each draining first
    max_surge_percent: int = Field(0, ge=0, le=100)
    ready_timeout_s: float = Field(2.0, gt=0)  # /ready: how long to wait for an engine replica to answer
    test_hooks: bool = False  # drills only: lets a test stall a replica's engine loop
    block_size: int = Field(16, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    scheduling: Literal["continuous", "static"] = "continuous"
    itl_slo_ms: float | None = Field(None, gt=0)  # tail-latency mode: step budget sized to this ITL target
    # SLO-aware scheduling (conveyor/serving/step_budget.py): steps sized to the TPOT target; requests predicted to miss
    # the TTFT target refused with 429 under admission_policy "slo"
    tpot_slo_ms: float | None = Field(100.0, gt=0)
    ttft_slo_ms: float | None = Field(2000.0, gt=0)
    admission_policy: Literal["slo", "queue"] = "slo"
    async_scheduling: bool = False  # schedule each step while the one before runs (conveyor/serving/step_pipeline.py)
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    # limits
    max_waiting_requests: int = Field(256, ge=1)
    max_waiting_tokens: int = Field(1 << 20, ge=1)
    max_queue_wait_s: float | None = Field(None, gt=0)  # shed (429) what would wait longer for a batch slot
    max_body_bytes: int = Field(1 << 20, ge=1024)
    replica_wait_timeout_s: float = Field(30.0, gt=0)
    # deadlines (docs/limits.md): queue + generation from arrival (None: none), a 408 or an SSE error past it; and
    # parsing + validating a body on the ingress's worker threads, a 413 past it
    request_timeout_s: float | None = Field(1800.0, gt=0)
    parse_timeout_s: float = Field(5.0, gt=0)
    ingress_max_ongoing_requests: int = Field(1000, ge=1)
    api_key: str | None = None
    # a file holding the API key, read by each ingress replica at its start (a Kubernetes Secret mounted in every
    # pod): the key then appears in no config, flag or process list
    api_key_file: str | None = None
    # routing
    request_router_class: str | None = DEFAULT_ROUTER  # None or "": Serve's default power-of-two router
    request_routing_stats_period_s: float = Field(0.5, gt=0)
    # streaming: each replica sends one message per engine step for all of an ingress's streams (conveyor/router/mux.py)
    stream_mux: bool = True

    @model_validator(mode="after")
    def _check_engine(self) -> ServeArgs:
        if self.autoscaling is not None and self.autoscaling_config is not None:
            raise ValueError("set either autoscaling (Conveyor's policy) or autoscaling_config, not both")
        self.engine_config()  # the engine's own dataclass checks, at deploy time rather than in a replica
        return self

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype, device=self.device,
                              max_model_len=self.max_model_len, seed=self.seed),
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_kv_blocks,
                              kv_cache_bytes=self.kv_cache_bytes, memory_fraction=self.memory_fraction,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              enable_prefix_caching=self.enable_prefix_caching,
                              kv_cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs, scheduling=self.scheduling,
                                      max_waiting_requests=self.max_waiting_requests,
                                      max_waiting_tokens=self.max_waiting_tokens,
                                      max_queue_wait_s=self.max_queue_wait_s,
                                      itl_slo_ms=self.itl_slo_ms, tpot_slo_ms=self.tpot_slo_ms,
                                      ttft_slo_ms=self.ttft_slo_ms, admission_policy=self.admission_policy,
                                      async_scheduling=self.async_scheduling),
            attention_backend=self.attention_backend, enable_cuda_graphs=self.enable_cuda_graphs,
            gguf_max_rows=self.gguf_max_rows, cpu_decode_stack=self.cpu_decode_stack,
            grammar_compile_timeout_s=self.grammar_compile_timeout_s, stream_interval=self.stream_interval)

    def ingress_settings(self) -> IngressSettings:
        name = self.served_model_name or self.model
        aliases = [self.model] if name != self.model else []
        return IngressSettings(model_name=name, model_aliases=aliases, api_key=self.api_key,
                               api_key_file=self.api_key_file,
                               max_body_bytes=self.max_body_bytes,
                               replica_wait_timeout_s=self.replica_wait_timeout_s,
                               ready_timeout_s=self.ready_timeout_s, stream_mux=self.stream_mux,
                               request_timeout_s=self.request_timeout_s, parse_timeout_s=self.parse_timeout_s)

    def replica_options(self) -> dict[str, Any]:
        # The engine's waiting queue is the admission bound (it answers 429); Serve must not cap or queue
        # in front of it, so its per-replica limit sits just above what the engine admits.
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "max_ongoing_requests": self.max_num_seqs + self.max_waiting_requests + 8,
            "request_router_config": self.router_config(),
            "health_check_period_s": self.health_check_period_s,
            "graceful_shutdown_timeout_s": self.drain_timeout_s,
            "max_surge_percent": self.max_surge_percent,
        }
        if self.autoscaling is not None:
            name = self.served_model_name or self.model
            options["autoscaling_config"] = self.autoscaling.serve_config(name)
        elif self.autoscaling_config is not None:
            options["autoscaling_config"] = self.autoscaling_config  # Serve refuses it with num_replicas
        else:
            options["num_replicas"] = self.num_replicas
        return options

    def router_config(self) -> RequestRouterConfig:
        period = self.request_routing_stats_period_s
        path = self.request_router_class
        if path and not _importable(path):
            logger.warning("request router %r cannot be imported; using Serve's default router", path)
            path = None
        if not path:
            return RequestRouterConfig(request_routing_stats_period_s=period)
        return RequestRouterConfig(request_router_class=path, request_routing_stats_period_s=period)


def _importable(path: str) -> bool:
    module, _, attr = path.replace(":", ".").rpartition(".")
    try:
        return hasattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 - any failure to import means "not available", logged by the caller
        return False


def build_app(args: dict[str, Any] | ServeArgs | None = None) -> serve.Application:
    cfg = args if isinstance(args, ServeArgs) else ServeArgs.model_validate(args or {})
    engine = EngineReplica.options(**cfg.replica_options()).bind(
        cfg.engine_config(), cfg.torch_num_threads, model_name=cfg.served_model_name or cfg.model,
        engine_process=cfg.engine_process, engine_stall_timeout_s=cfg.engine_stall_timeout_s,
        test_hooks=cfg.test_hooks)
    # I/O only: never take an engine's CPU. A redeploy replaces the ingress too: it must outlast the engines'
    # drain, or it would cut the streams they are finishing.
    ingress = Ingress.options(max_ongoing_requests=cfg.ingress_max_ongoing_requests,
                              ray_actor_options={"num_cpus": 0},
                              graceful_shutdown_timeout_s=cfg.drain_timeout_s + INGRESS_DRAIN_MARGIN_S)
    return ingress.bind(engine, cfg.ingress_settings())
