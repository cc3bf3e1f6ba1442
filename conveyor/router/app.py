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

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from ray import serve
from ray.serve.config import RequestRouterConfig

from conveyor.router.autoscaling import AutoscalingArgs
from conveyor.router.ingress import Ingress, IngressSettings
from conveyor.router.replica import EngineReplica
from conveyor.serving.config import EngineConfig
from conveyor.serving.settings import ENGINE_KEYS, EngineKey, engine_config_from_flat, surface_defaults

logger = logging.getLogger(__name__)

DEFAULT_ROUTER = "conveyor.router.routing:LoadAwarePrefixRouter"
INGRESS_DRAIN_MARGIN_S = 5.0


class _ServeSettings(BaseModel):
    """Everything a deployment is configured with: the YAML `args`, `conveyor serve` flags and tests.

    The engine's keys (max_num_seqs, num_kv_blocks, ...) are not listed here: ServeArgs below adds one field per
    flat engine key (conveyor/serving/settings.py), typed, defaulted and described by the engine's dataclasses.
    """

    model_config = ConfigDict(extra="forbid")  # a misspelled key in a YAML file should fail the deploy

    # model and replicas
    served_model_name: str | None = Field(None, description="the id clients send as `model` (default: `model`)")
    num_replicas: int = Field(1, ge=1, description="engine replicas (fixed; see autoscaling)")
    autoscaling_config: dict[str, Any] | None = Field(None, description="a raw Serve autoscaling_config, passed as is")
    autoscaling: AutoscalingArgs | None = Field(
        None, description="Conveyor's queue + tail-latency autoscaling policy (conveyor/router/autoscaling.py); "
        "replaces num_replicas")
    num_cpus: float = Field(1.0, ge=0, description="CPUs per engine replica (Ray gives it as many torch threads); "
                            "`conveyor serve` without it: every core for a single CPU replica")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per engine replica")
    torch_num_threads: int | None = Field(None, ge=1, description="torch threads per replica (several replicas on "
                                          "one host: split the cores)")
    # Its own GIL, as vLLM's EngineCore: Serve's request machinery then cannot slow the steps down.
    engine_process: bool = Field(True, description="step the engine in a child process of the replica (False: a "
                                 "thread inside the replica process)")
    # One Ray worker fewer on every token's path (conveyor/router/local_engine.py): one fixed replica only.
    engine_in_ingress: bool = Field(False, description="run the single engine replica's engine client inside the "
                                    "ingress process instead of a replica of its own (num_replicas 1, no "
                                    "autoscaling; `conveyor serve` turns it on for one fixed replica)")
    # health
    engine_stall_timeout_s: float = Field(
        120.0, gt=0, description="a replica whose engine has work but completed no step, or whose engine "
        "restart has not finished, for this long fails its health check (Serve replaces it after 3 failed checks)")
    health_check_period_s: float = Field(5.0, gt=0, description="seconds between Serve's health checks")
    drain_timeout_s: float = Field(
        20.0, ge=0, description="a replica being removed (scale-in, redeploy, failed health checks) finishes its "
        "streams for at most this long before Serve kills it (Serve's graceful_shutdown_timeout_s)")
    max_surge_percent: int = Field(
        0, ge=0, le=100, description="a redeploy starts this share of extra replicas before it stops old ones "
        "(Serve's max_surge_percent): 100 keeps full capacity but needs room; 0 replaces a batch at a time")
    ready_timeout_s: float = Field(2.0, gt=0, description="/ready: how long to wait for an engine replica to answer")
    test_hooks: bool = Field(False, description="drills only: lets a test stall a replica's engine loop")
    # limits
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body; a 413 past it")
    replica_wait_timeout_s: float = Field(30.0, gt=0, description="how long the ingress waits for a replica to "
                                          "take a request")
    # deadlines (docs/limits.md)
    request_timeout_s: float | None = Field(
        1800.0, gt=0, description="queue + generation from arrival: a 408, or an SSE error event mid-stream, past "
        "it, its engine work aborted (None: no deadline)")
    parse_timeout_s: float = Field(5.0, gt=0, description="parsing + validating a body on the ingress's worker "
                                   "threads: a 413 past it")
    ingress_max_ongoing_requests: int = Field(1000, ge=1, description="Serve's max_ongoing_requests for the ingress")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer KEY' (default: $CONVEYOR_API_KEY)")
    # A Kubernetes Secret mounted in every pod: the key then appears in no config, flag or process list.
    api_key_file: str | None = Field(None, description="a file holding the API key, read by each ingress replica "
                                     "at its start")
    # routing
    request_router_class: str | None = Field(DEFAULT_ROUTER, description="None or '': Serve's default "
                                             "power-of-two router")
    request_routing_stats_period_s: float = Field(0.5, gt=0, description="how often replicas report load to the "
                                                  "router")
    stream_mux: bool = Field(True, description="each replica sends one message per engine step for all of an "
                             "ingress's streams (conveyor/router/mux.py)")

    @model_validator(mode="after")
    def _check_engine(self) -> _ServeSettings:
        if self.autoscaling is not None and self.autoscaling_config is not None:
            raise ValueError("set either autoscaling (Conveyor's policy) or autoscaling_config, not both")
        if self.engine_in_ingress and not self.fixed_single_replica():
            raise ValueError("engine_in_ingress needs num_replicas 1 and no autoscaling: replicas of their own are "
                             "what Serve routes between and scales")
        self.engine_config()  # the engine's own dataclass checks, at deploy time rather than in a replica
        return self

    def fixed_single_replica(self) -> bool:
        return self.num_replicas == 1 and self.autoscaling is None and self.autoscaling_config is None

    def engine_config(self) -> EngineConfig:
        return engine_config_from_flat({key: getattr(self, key) for key in ENGINE_KEYS})

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


def _engine_field(spec: EngineKey) -> tuple[Any, Any]:
    annotation = Literal[spec.choices] if spec.choices else spec.annotation
    return annotation, Field(SERVE_DEFAULTS[spec.key], description=spec.help)


SERVE_DEFAULTS = surface_defaults("serve")
# One field per flat engine key, from the dataclasses: a default or a type cannot drift from the engine's.
ServeArgs = create_model("ServeArgs", __base__=_ServeSettings, __module__=__name__,
                         **{key: _engine_field(spec) for key, spec in ENGINE_KEYS.items()})
ServeArgs.__doc__ = _ServeSettings.__doc__
SERVE_ONLY_KEYS = tuple(_ServeSettings.model_fields)


def _importable(path: str) -> bool:
    module, _, attr = path.replace(":", ".").rpartition(".")
    try:
        return hasattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 - any failure to import means "not available", logged by the caller
        return False


def build_app(args: dict[str, Any] | _ServeSettings | None = None) -> serve.Application:
    cfg = args if isinstance(args, _ServeSettings) else ServeArgs.model_validate(args or {})
    engine_args = {"engine_config": cfg.engine_config(), "torch_num_threads": cfg.torch_num_threads,
                   "model_name": cfg.served_model_name or cfg.model, "engine_process": cfg.engine_process,
                   "engine_stall_timeout_s": cfg.engine_stall_timeout_s, "test_hooks": cfg.test_hooks}
    if cfg.engine_in_ingress:
        # The ingress holds the engine: it takes the replica's resources and health checks, and drains as one.
        ingress = Ingress.options(max_ongoing_requests=cfg.ingress_max_ongoing_requests,
                                  ray_actor_options={"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus},
                                  health_check_period_s=cfg.health_check_period_s,
                                  graceful_shutdown_timeout_s=cfg.drain_timeout_s)
        return ingress.bind(None, cfg.ingress_settings(), engine_here=engine_args)
    engine = EngineReplica.options(**cfg.replica_options()).bind(**engine_args)
    # I/O only: never take an engine's CPU. A redeploy replaces the ingress too: it must outlast the engines'
    # drain, or it would cut the streams they are finishing.
    ingress = Ingress.options(max_ongoing_requests=cfg.ingress_max_ongoing_requests,
                              ray_actor_options={"num_cpus": 0},
                              graceful_shutdown_timeout_s=cfg.drain_timeout_s + INGRESS_DRAIN_MARGIN_S)
    return ingress.bind(engine, cfg.ingress_settings())
