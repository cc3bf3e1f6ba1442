"""Every Prometheus metric Conveyor exports, defined once, here (design.md section 5).

Why module level in this importable module: prometheus-client registers a metric in the process-wide
default registry when it is created. Each Serve replica is its own process, so each replica imports this
module once and exports only its own series, told apart by the `model` and `replica` labels. A metric
defined in the file that declares a deployment would be pickled by value with the class and never reach
the registry that the replica's endpoint serves (design.md section 6).

`EngineMetrics` binds the label children for one engine replica once, so the per-step work on the engine
thread is a handful of lock-protected float updates and no dict lookups by label.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from conveyor.serving.outputs import EngineStepStats, RequestOutput

logger = logging.getLogger(__name__)

PREFIX = "conveyor_"
LABELS = ("model", "replica")

# Buckets span a GPU decode step (~1 ms) up to a CPU model that is busy for minutes, so that the same
# dashboards give usable quantiles on both. histogram_quantile interpolates inside a bucket: dense below 1 s,
# where SLOs live, sparse above.
_FINE = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
         0.3, 0.4, 0.5, 0.75, 1.0)
TTFT_BUCKETS = _FINE[1:] + (1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
ITL_BUCKETS = _FINE + (1.5, 2.0, 3.0, 5.0, 10.0)
STEP_BUCKETS = _FINE + (1.5, 2.0, 3.0, 5.0, 10.0)
QUEUE_BUCKETS = _FINE + (1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
               45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)

# ---- engine replica metrics -------------------------------------------------------------------------
TIME_TO_FIRST_TOKEN = Histogram(
    PREFIX + "time_to_first_token_seconds", "Arrival at the engine to the first output token.",
    LABELS, buckets=TTFT_BUCKETS)
INTER_TOKEN_LATENCY = Histogram(
    PREFIX + "inter_token_latency_seconds", "Time between two consecutive output tokens of one request.",
    LABELS, buckets=ITL_BUCKETS)
E2E_REQUEST_LATENCY = Histogram(
    PREFIX + "e2e_request_latency_seconds", "Arrival at the engine to the last token.",
    LABELS, buckets=E2E_BUCKETS)
REQUEST_QUEUE_TIME = Histogram(
    PREFIX + "request_queue_time_seconds",
    "Arrival until the step that produced the first token began (waiting + earlier prefill chunks).",
    LABELS, buckets=QUEUE_BUCKETS)
STEP_DURATION = Histogram(
    PREFIX + "step_duration_seconds", "Wall time of one engine step (schedule + forward + sample).",
    LABELS, buckets=STEP_BUCKETS)

REQUESTS_RUNNING = Gauge(PREFIX + "requests_running", "Requests in the running batch.", LABELS)
REQUESTS_WAITING = Gauge(PREFIX + "requests_waiting", "Admitted requests not yet scheduled.", LABELS)
KV_CACHE_USAGE = Gauge(PREFIX + "kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).", LABELS)
BATCH_SIZE = Gauge(PREFIX + "batch_size", "Requests scheduled in the last engine step.", LABELS)

PROMPT_TOKENS = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests that started.", LABELS)
GENERATION_TOKENS = Counter(PREFIX + "generation_tokens", "Output tokens generated.", LABELS)
PREEMPTIONS = Counter(PREFIX + "preemptions", "Requests preempted to free KV cache.", LABELS)
PREFIX_CACHE_QUERIES = Counter(PREFIX + "prefix_cache_queries", "Prefix-cache lookups (blocks).", LABELS)
PREFIX_CACHE_HITS = Counter(PREFIX + "prefix_cache_hits", "Prefix-cache lookups that hit (blocks).", LABELS)
SCHEDULED_TOKENS = Counter(PREFIX + "scheduled_tokens", "Tokens scheduled per step, by prefill or decode.",
                           LABELS + ("kind",))
REQUESTS_FINISHED = Counter(PREFIX + "requests_finished", "Requests finished, by finish reason.",
                            LABELS + ("reason",))
REQUESTS_REJECTED = Counter(PREFIX + "requests_rejected", "Requests refused before generation, by reason.",
                            LABELS + ("reason",))
# Counted by the ingress (replica label "ingress-<id>"): the replica that was generating is gone.
REQUESTS_CUT = Counter(PREFIX + "requests_cut", "Requests whose output was cut short because their replica "
                       "failed or was stopped past its drain time.", LABELS)
REQUESTS_HANDED_BACK = Counter(PREFIX + "requests_handed_back", "Requests sent to another replica because "
                               "theirs left the routing set (drain, redeploy) before they started.", LABELS)

# ---- fleet metrics (set by the ingress from what the autoscaling policy reports) -----------------------
REPLICAS_CURRENT = Gauge(PREFIX + "replicas_current", "Engine replicas running now.", ("model",))
REPLICAS_TARGET = Gauge(PREFIX + "replicas_target", "Engine replicas the autoscaler aims for.", ("model",))

METRICS = (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_REQUEST_LATENCY, REQUEST_QUEUE_TIME, STEP_DURATION,
           REQUESTS_RUNNING, REQUESTS_WAITING, KV_CACHE_USAGE, BATCH_SIZE, PROMPT_TOKENS, GENERATION_TOKENS,
           PREEMPTIONS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, SCHEDULED_TOKENS, REQUESTS_FINISHED,
           REQUESTS_REJECTED, REQUESTS_CUT, REQUESTS_HANDED_BACK, REPLICAS_CURRENT, REPLICAS_TARGET)
FLEET_METRICS = (REPLICAS_CURRENT, REPLICAS_TARGET)


def family_name(metric: Counter | Gauge | Histogram) -> str:
    """The name as exposed: prometheus-client appends `_total` to counters."""
    return metric._name + ("_total" if isinstance(metric, Counter) else "")  # noqa: SLF001


INGRESS_METRICS = (REQUESTS_CUT, REQUESTS_HANDED_BACK)  # counted where the request's stream is, not by an engine
ENGINE_FAMILIES = tuple(family_name(m) for m in METRICS if m not in FLEET_METRICS + INGRESS_METRICS)
INGRESS_FAMILIES = tuple(family_name(m) for m in INGRESS_METRICS)

# Per-request timestamps for requests not seen for this long are dropped: an aborted request never sends
# a finished output, and its entry must not live forever.
_STALE_AFTER_S = 600.0
_PRUNE_EVERY_STEPS = 1024


class EngineMetrics:
    """Feeds the metrics above from one engine. `observe_step` is an AsyncEngine step listener."""

    def __init__(self, model: str, replica: str) -> None:
        self.model, self.replica = model, replica
        lv = (model, replica)
        self._ttft = TIME_TO_FIRST_TOKEN.labels(*lv)
        self._itl = INTER_TOKEN_LATENCY.labels(*lv)
        self._e2e = E2E_REQUEST_LATENCY.labels(*lv)
        self._queue = REQUEST_QUEUE_TIME.labels(*lv)
        self._step = STEP_DURATION.labels(*lv)
        self._running = REQUESTS_RUNNING.labels(*lv)
        self._waiting = REQUESTS_WAITING.labels(*lv)
        self._kv = KV_CACHE_USAGE.labels(*lv)
        self._batch = BATCH_SIZE.labels(*lv)
        self._prompt = PROMPT_TOKENS.labels(*lv)
        self._gen = GENERATION_TOKENS.labels(*lv)
        self._preempt = PREEMPTIONS.labels(*lv)
        self._pc_queries = PREFIX_CACHE_QUERIES.labels(*lv)
        self._pc_hits = PREFIX_CACHE_HITS.labels(*lv)
        self._prefill = SCHEDULED_TOKENS.labels(*lv, "prefill")
        self._decode = SCHEDULED_TOKENS.labels(*lv, "decode")
        # Create the label sets a dashboard reads, so every family is present (at 0) from the first scrape.
        for reason in ("stop", "length"):
            REQUESTS_FINISHED.labels(*lv, reason)
        for reason in ("queue_full", "ttft_slo", "invalid_request"):
            REQUESTS_REJECTED.labels(*lv, reason)
        self._last_token: dict[str, float] = {}  # request_id -> time of its latest token (monotonic)
        self._steps = 0
        self._warned = False

    def observe_step(self, stats: EngineStepStats, outputs: Iterable[RequestOutput],
                     now: float | None = None) -> None:
        # An exception escaping a step listener makes AsyncEngine fail every live request: a metrics bug
        # must cost metrics, never requests.
        try:
            if now is None:
                now = stats.finished_at or time.monotonic()
            self._observe_step(stats, outputs, now)
        except Exception:  # noqa: BLE001
            if not self._warned:
                self._warned = True
                logger.exception("engine metrics update failed (further failures are not logged)")

    def _observe_step(self, stats: EngineStepStats, outputs: Iterable[RequestOutput], now: float) -> None:
        self._step.observe(stats.step_time_s)
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        self._kv.set(stats.kv_cache_usage)
        self._batch.set(stats.batch_size)
        for counter, count in ((self._prefill, stats.num_prefill_tokens), (self._decode, stats.num_decode_tokens),
                               (self._preempt, stats.num_preemptions),
                               (self._pc_queries, stats.num_prefix_cache_queries),
                               (self._pc_hits, stats.num_prefix_cache_hits)):
            if count:
                counter.inc(count)
        generated = 0
        for out in outputs:
            generated += len(out.delta_token_ids)
            self._observe_output(out, now, stats.step_time_s)
        if generated:
            self._gen.inc(generated)
        self._steps += 1
        if self._steps % _PRUNE_EVERY_STEPS == 0:
            self._prune(now)

    def _observe_output(self, out: RequestOutput, now: float, step_time_s: float) -> None:
        rid = out.request_id
        last = self._last_token.get(rid)
        if last is None:  # first token of this request
            first = out.first_token_time if out.first_token_time is not None else now
            self._ttft.observe(max(0.0, first - out.arrival_time))
            scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else first - step_time_s
            self._queue.observe(max(0.0, scheduled - out.arrival_time))
            self._prompt.inc(out.num_prompt_tokens)
        else:
            self._itl.observe(max(0.0, now - last))
        if out.finished:
            self._last_token.pop(rid, None)
            self._e2e.observe(max(0.0, now - out.arrival_time))
            REQUESTS_FINISHED.labels(self.model, self.replica, out.finish_reason or "unknown").inc()
        else:
            self._last_token[rid] = now

    def bind_load(self, load: Callable[[], Any]) -> None:
        """Read the queue and KV gauges from `load()` (an EngineLoad) at scrape time: set only after steps,
        they would keep showing a request that was aborted after the engine's last step."""
        self._running.set_function(lambda: load().num_running)
        self._waiting.set_function(lambda: load().num_waiting)
        self._kv.set_function(lambda: load().kv_cache_usage)

    def observe_rejected(self, reason: str) -> None:
        REQUESTS_REJECTED.labels(self.model, self.replica, reason).inc()

    def _prune(self, now: float) -> None:
        stale = [rid for rid, t in self._last_token.items() if now - t > _STALE_AFTER_S]
        for rid in stale:
            del self._last_token[rid]
