"""Autoscaling on queue depth and tail latency: a Ray Serve custom policy for the engine deployment.

Configured in the Serve YAML through ServeArgs (see conveyor/router/app.py), which produces

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      metrics_interval_s: 0.5
      look_back_period_s: 2
      upscale_delay_s: 1
      downscale_delay_s: 10
      policy:
        policy_function: conveyor.router.autoscaling:QueueAndLatencyPolicy
        policy_kwargs: {target_queue_per_replica: 4, ttft_p99_slo_s: 2.0, itl_p99_slo_s: 0.2}

The decision itself is `decide(inputs, state, params) -> (target, state)`: a pure function, so it is unit
tested on synthetic inputs. `QueueAndLatencyPolicy.__call__(ctx)` only turns Serve's AutoscalingContext
(fed by the replicas' `record_autoscaling_stats()`) or, when `prometheus_url` is set, PromQL p99s into
`PolicyInputs`. Serve wraps the policy and still applies min/max, the scaling factors and the up/down delays.

This module is pickled by value into the ServeController (Serve does that for a policy given by import
path), so it keeps its own helpers here and imports other conveyor modules only inside functions.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray.serve.autoscaling_policy import PrometheusQueryMixin

logger = logging.getLogger("ray.serve")

STATE_CALM_SINCE = "conveyor_calm_since"  # when the fleet last became comfortably under every target
STATE_SCALE_IN_TO = "conveyor_scale_in_to"  # a scale-in we asked for and Serve has not applied yet
STATE_LAST_REASON = "conveyor_last_reason"


@dataclass(frozen=True)
class PolicyParams:
    target_queue_per_replica: float = 4.0  # waiting requests per replica we accept before adding one
    ttft_p99_slo_s: float = 2.0
    itl_p99_slo_s: float = 0.2
    min_replicas: int = 1
    max_replicas: int = 4
    scale_in_ratio: float = 0.5  # "comfortably under": every signal below this fraction of its target
    scale_in_sustain_s: float = 10.0  # ... for this long before one replica is removed
    max_scale_out_step: int = 0  # replicas added per decision at most; 0: double the fleet at most
    # Requests refused for capacity (429: queue bound or TTFT admission) as a share of those arriving. Past
    # capacity, TTFT admission keeps the queue short and the admitted requests' TTFT within the SLO, so refusals
    # are the one signal that shows the demand a fleet turns away.
    max_refused_fraction: float = 0.05


@dataclass(frozen=True)
class PolicyInputs:
    now: float
    current_replicas: int  # running
    target_replicas: int  # what Serve is already moving to
    num_waiting: float  # summed over replicas (plus requests queued in handles)
    num_running: float
    ttft_p99_s: float | None = None  # None: unknown (no traffic yet, or no data)
    itl_p99_s: float | None = None
    refused_fraction: float = 0.0  # the highest replica's share of arrivals refused for capacity


def decide(inputs: PolicyInputs, state: dict[str, Any], params: PolicyParams) -> tuple[int, dict[str, Any]]:
    """Target replica count and the new state. Scale out on any breach; scale in one at a time, only after
    every signal has been comfortably under its target for `scale_in_sustain_s`."""
    state = dict(state)
    lo, hi = params.min_replicas, max(params.min_replicas, params.max_replicas)
    current = max(inputs.current_replicas, 0)
    # While a scale-out is under way (target > current) the new replicas are not serving yet: hold the
    # target rather than "deciding" a smaller one from the old capacity, which Serve would treat as a
    # scale-in request and which is the classic source of flapping.
    base = max(inputs.target_replicas, lo)
    serving = max(current, 1)
    queue_ratio = inputs.num_waiting / (serving * params.target_queue_per_replica)
    idle = inputs.num_waiting <= 0 and inputs.num_running <= 0
    # Latency percentiles cover a trailing window: once nothing is running they describe requests that
    # are gone, so an idle fleet is judged on its queue alone.
    ttft_ratio = _ratio(inputs.ttft_p99_s, params.ttft_p99_slo_s, idle)
    itl_ratio = _ratio(inputs.itl_p99_s, params.itl_p99_slo_s, idle)
    refused_ratio = _ratio(inputs.refused_fraction, params.max_refused_fraction, False)
    ratios = {"queue": queue_ratio, "ttft": ttft_ratio, "itl": itl_ratio, "refused": refused_ratio}

    if max(ratios.values()) > 1.0:
        state[STATE_CALM_SINCE] = state[STATE_SCALE_IN_TO] = None
        want = serving + 1
        if queue_ratio > 1.0:  # enough replicas to bring the queue back to its target
            want = max(want, math.ceil(inputs.num_waiting / params.target_queue_per_replica))
        step = params.max_scale_out_step or serving
        want = min(want, serving + step)
        state[STATE_LAST_REASON] = max(ratios, key=ratios.__getitem__)
        return _clamp(max(want, base), lo, hi), state

    comfortable = max(ratios.values()) < params.scale_in_ratio
    if not comfortable or current != inputs.target_replicas:  # in the band, or still converging: hold
        state[STATE_CALM_SINCE] = state[STATE_SCALE_IN_TO] = None
        return _clamp(base, lo, hi), state
    pending = state.get(STATE_SCALE_IN_TO)
    if pending is not None and pending >= inputs.target_replicas:
        pending = None  # Serve has applied it (the next step down waits for its own calm period)
    fewer = pending if pending is not None else base - 1
    # Would the queue still be comfortable with one replica less? If not, removing it would trigger a
    # scale-out right after: stay.
    if fewer < lo or inputs.num_waiting / (max(fewer, 1) * params.target_queue_per_replica) >= (
            params.scale_in_ratio):
        state[STATE_SCALE_IN_TO] = None
        return _clamp(base, lo, hi), state
    if pending is not None:
        # Keep asking for it: Serve applies a scale-in only after downscale_delay_s of identical answers.
        return _clamp(pending, lo, hi), state
    since = state.get(STATE_CALM_SINCE)
    if since is None:
        state[STATE_CALM_SINCE] = inputs.now
        return _clamp(base, lo, hi), state
    if inputs.now - since >= params.scale_in_sustain_s:
        state[STATE_CALM_SINCE] = None
        state[STATE_SCALE_IN_TO] = fewer
        state[STATE_LAST_REASON] = "calm"
        return _clamp(fewer, lo, hi), state
    return _clamp(base, lo, hi), state


def _ratio(value: float | None, target: float, idle: bool) -> float:
    if idle or value is None or target <= 0:
        return 0.0
    return value / target


def _clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


def promql_p99(metric: str, model: str | None, window: str = "1m") -> str:
    selector = f'{{model="{model}"}}' if model else ""
    return f"histogram_quantile(0.99, sum by (le) (rate({metric}_bucket{selector}[{window}])))"


class QueueAndLatencyPolicy(PrometheusQueryMixin):
    """The Serve-facing policy. kwargs are `policy_kwargs` from the autoscaling config (JSON values)."""

    def __init__(self, target_queue_per_replica: float = 4.0, ttft_p99_slo_s: float = 2.0,
                 itl_p99_slo_s: float = 0.2, scale_in_ratio: float = 0.5, scale_in_sustain_s: float = 10.0,
                 max_scale_out_step: int = 0, max_refused_fraction: float = 0.05,
                 prometheus_url: str | None = None, model: str | None = None,
                 prometheus_window: str = "1m", prometheus_fetch_interval_s: float = 2.0,
                 report_to_registry: bool = True) -> None:
        self._ttft_query = promql_p99("conveyor_time_to_first_token_seconds", model, prometheus_window)
        self._itl_query = promql_p99("conveyor_inter_token_latency_seconds", model, prometheus_window)
        super().__init__(prometheus_address=prometheus_url or None,
                         prometheus_queries=[self._ttft_query, self._itl_query] if prometheus_url else [],
                         fetch_interval_s=prometheus_fetch_interval_s,
                         cache_ttl_s=max(15.0, 5 * prometheus_fetch_interval_s))
        self._use_prometheus = bool(prometheus_url)
        self.model = model
        self._params = dict(target_queue_per_replica=target_queue_per_replica, ttft_p99_slo_s=ttft_p99_slo_s,
                            itl_p99_slo_s=itl_p99_slo_s, scale_in_ratio=scale_in_ratio,
                            scale_in_sustain_s=scale_in_sustain_s, max_scale_out_step=max_scale_out_step,
                            max_refused_fraction=max_refused_fraction)
        self._reporter = _FleetReporter() if report_to_registry else None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        cfg = ctx.config
        params = PolicyParams(min_replicas=cfg.min_replicas, max_replicas=cfg.max_replicas, **self._params)
        inputs = self.inputs_from_context(ctx)
        target, state = decide(inputs, ctx.policy_state or {}, params)
        if self._reporter is not None:
            self._reporter.report(ctx.app_name, ctx.current_num_replicas, ctx.target_num_replicas, target)
        return target, state

    def inputs_from_context(self, ctx: Any) -> PolicyInputs:
        metrics = ctx.aggregated_metrics or {}
        waiting = sum(metrics.get("num_waiting", {}).values()) + float(ctx.total_queued_requests or 0)
        running = sum(metrics.get("num_running", {}).values())
        ttft = _max_or_none(metrics.get("ttft_p99_s", {}).values())
        itl = _max_or_none(metrics.get("itl_p99_s", {}).values())
        refused = _max_or_none(metrics.get("refused_fraction", {}).values()) or 0.0
        if self._use_prometheus:  # the fleet-wide p99 from the histograms, when Prometheus answers
            prom = self.prometheus_metrics or {}
            ttft = prom.get(self._ttft_query, ttft)
            itl = prom.get(self._itl_query, itl)
        now = ctx.current_time if getattr(ctx, "current_time", None) is not None else time.time()
        return PolicyInputs(now=now, current_replicas=ctx.current_num_replicas,
                            target_replicas=ctx.target_num_replicas, num_waiting=waiting, num_running=running,
                            ttft_p99_s=ttft, itl_p99_s=itl, refused_fraction=refused)


def _max_or_none(values: Any) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return max(values) if values else None


class _FleetReporter:
    """Writes (current, target) replica counts to the GCS key-value store (metrics_registry.py) so the ingress can
    export them. Only on change or every few seconds: this runs inside the ServeController's control loop, and a
    put is a blocking round trip to the GCS (the controller checkpoints its own state there the same way). After a
    failure (the GCS restarting) it pauses for retry_after_s rather than holding up every control-loop tick."""

    def __init__(self, every_s: float = 2.0, retry_after_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.retry_after_s, self.clock = every_s, retry_after_s, clock
        self._last: tuple[int, int] | None = None
        self._sent_at = 0.0
        self._failed_at: float | None = None

    def report(self, app: str, current: int, target: int, desired: int) -> None:
        now = self.clock()
        key = (current, target)
        if self._failed_at is not None and now - self._failed_at < self.retry_after_s:
            return
        if key == self._last and now - self._sent_at < self.every_s:
            return
        try:
            from conveyor.router.metrics_registry import report_fleet

            report_fleet(app, current, target, desired)  # one GCS put, only when the counts change or every every_s
            self._last, self._sent_at, self._failed_at = key, now, None
        except Exception:  # noqa: BLE001 - metrics must never break scaling
            if self._failed_at is None:  # one warning per outage, not one per retry
                logger.warning("conveyor autoscaler: cannot report replica counts; retrying every %.0f s",
                               self.retry_after_s, exc_info=True)
            self._failed_at = now


class AutoscalingArgs(BaseModel):
    """The `autoscaling:` block of the Serve YAML args (ServeArgs); becomes the engine deployment's
    Serve autoscaling_config with this module's policy."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    initial_replicas: int | None = Field(None, ge=1)
    target_queue_per_replica: float = Field(4.0, gt=0)
    ttft_p99_slo_s: float = Field(2.0, gt=0)
    itl_p99_slo_s: float = Field(0.2, gt=0)
    scale_in_ratio: float = Field(0.5, gt=0, lt=1)
    scale_in_sustain_s: float = Field(30.0, ge=0)
    max_scale_out_step: int = Field(0, ge=0)
    max_refused_fraction: float = Field(0.05, gt=0, le=1)
    upscale_delay_s: float = Field(2.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    metrics_interval_s: float = Field(0.5, gt=0)  # Serve's default (10 s) is far too slow for a queue signal
    look_back_period_s: float = Field(2.0, gt=0)
    prometheus_url: str | None = None  # read the fleet p99 TTFT/ITL from Prometheus instead of the replicas
    prometheus_window: str = "1m"

    @model_validator(mode="after")
    def _check(self) -> AutoscalingArgs:
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.max_replicas must be >= min_replicas")
        return self

    def serve_config(self, model: str) -> dict[str, Any]:
        kwargs = self.model_dump(include={"target_queue_per_replica", "ttft_p99_slo_s", "itl_p99_slo_s",
                                          "scale_in_ratio", "scale_in_sustain_s", "max_scale_out_step",
                                          "max_refused_fraction", "prometheus_url", "prometheus_window"})
        config = self.model_dump(include={"min_replicas", "max_replicas", "initial_replicas",
                                          "upscale_delay_s", "downscale_delay_s", "metrics_interval_s",
                                          "look_back_period_s"}, exclude_none=True)
        config["policy"] = {"policy_function": POLICY_PATH, "policy_kwargs": {**kwargs, "model": model}}
        return config


POLICY_PATH = "conveyor.router.autoscaling:QueueAndLatencyPolicy"
