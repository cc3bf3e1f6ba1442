"""The engine deployment: one engine (EngineClient: ProcessEngine, or AsyncEngine) per Serve replica, streamed
through a DeploymentHandle. A dead engine process is restarted in place; what it had not started is handed back.

The request crossing the handle is a small dict (see `make_request`); what comes back is one small dict per
engine delta. Errors that belong to the client (bad input, full queue) come back as a single typed record
`{"error": kind, ...}` rather than an exception, so that nothing depends on how Ray pickles exception types
and the ingress can map them straight onto HTTP statuses.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from conveyor.router.drain import HAND_BACK, ROUTE_KEY
from conveyor.router.mux import MUX_KEY, SEQ_KEY, SUBSCRIBER_KEY, MuxHub, StreamMux
from conveyor.serving.config import EngineConfig
from conveyor.serving.engine_client import EngineDeadError
from conveyor.serving.outputs import RequestOutput, SampledToken, merge_outputs
from conveyor.serving.request import SamplingParams
from conveyor.serving.scheduler import QueueFullError

logger = logging.getLogger(__name__)

ROUTING_PREFIX_CHARS = 2048
# A subscription with no request attached ends after this long (the ingress opens a new one when it needs it).
# Serve counts it as an ongoing request, so a stopping replica (scale-in, redeploy, `serve delete`) waits for it
# to end: at 5 s each stop took 5-7 s longer than its streams. Opening one again is one call, and until it
# answers a new request's records take its own stream.
SUBSCRIPTION_IDLE_S = 1.0


def make_request(prompt: str | list[int] | None, params: SamplingParams, request_id: str, *,
                 messages: list[dict[str, str]] | None = None, stream: bool = True,
                 unset: list[str] | None = None) -> dict[str, Any]:
    """The record the ingress sends: the first positional argument of `generate`.

    `routing_prefix` is what the request router (conveyor/router/routing.py) reads for prefix affinity. It only needs
    to be a stable text for a shared prompt prefix: chat messages are rendered with a fixed pseudo-template
    (the ingress does not load the tokenizer), token-id prompts as their decimal ids.
    """
    if messages is not None:
        prefix = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
    elif isinstance(prompt, str):
        prefix = prompt
    else:
        prefix = ",".join(map(str, prompt or []))
    return {"prompt": prompt, "messages": messages, "params": params, "request_id": request_id,
            "routing_prefix": prefix[:ROUTING_PREFIX_CHARS], "stream": stream, "unset": unset or []}


def apply_generation_defaults(params: SamplingParams, defaults: dict[str, Any], unset: Any) -> SamplingParams:
    """Sampling settings the client left out (`unset`) take the model's generation-config values, as vLLM does
    (SmolLM2: temperature 0.2, top_p 0.9); what the client sent always wins."""
    chosen = {k: v for k, v in defaults.items() if k in unset}
    return dataclasses.replace(params, **chosen) if chosen else params


class LatencyWindow:
    """Samples of one latency over the last `window_s` seconds (bounded), for percentiles on demand."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 10_000) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, value: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, value))

    def percentile(self, q: float, now: float | None = None) -> float:
        cutoff = (time.monotonic() if now is None else now) - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        if not self._samples:
            return 0.0
        values = sorted(v for _, v in self._samples)
        return values[min(len(values) - 1, int(q * len(values)))]


@serve.deployment(name="EngineReplica", max_ongoing_requests=1024, health_check_period_s=5)
class EngineReplica:
    def __init__(self, engine_config: EngineConfig, torch_num_threads: int | None = None,
                 latency_window_s: float = 60.0, model_name: str | None = None,
                 engine_process: bool = True, engine_stall_timeout_s: float = 120.0,
                 test_hooks: bool = False) -> None:
        from conveyor.serving.priority import raised_priority

        # A replica that starts beside busy engines (scale-out, rolling update, a replaced replica) would get a
        # sliver of the CPU at Ray's niceness: its start-up runs at the engine's (conveyor/serving/priority.py).
        with raised_priority():
            self._start_engine(engine_config, torch_num_threads, engine_process)
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._num_aborted = 0  # streams closed before their end (client gone): evidence for tests
        self._ttft = LatencyWindow(latency_window_s)
        self._itl = LatencyWindow(latency_window_s)
        # Prometheus metrics (conveyor/serving/metrics.py): fed on the engine thread after every step, served on
        # this replica's own port and advertised for service discovery (conveyor/router/metrics_registry.py).
        from conveyor.router.metrics_registry import start_replica_endpoint
        from conveyor.serving.metrics import EngineMetrics

        self.metrics = EngineMetrics(model_name or engine_config.model.model, self._replica_id)
        # Liveness of the engine itself: a step completed recently, or nothing to do (see check_health).
        self._stall_timeout_s = engine_stall_timeout_s
        self._last_progress = time.monotonic()
        self._test_hooks = test_hooks
        self._attach_engine(self.engine)
        self._metrics_endpoint = start_replica_endpoint("engine", self.metrics.model)
        self._muxes = MuxHub()
        self._num_batches = self._num_muxed_records = 0  # evidence for tests: records per subscription message
        self._num_subscriptions_cancelled = 0  # evidence for tests: the ingress (or Serve for it) cancelled one

    def _start_engine(self, engine_config: EngineConfig, torch_num_threads: int | None,
                      engine_process: bool) -> None:
        # torch and the model load here (or in the engine's child process), not when the driver imports us.
        if engine_process:
            from conveyor.serving.engine_process import ProcessEngine as engine_cls
        else:
            from conveyor.serving.async_engine import AsyncEngine as engine_cls
        from conveyor.serving.models.loader import generation_defaults, resolve_model_path

        self.config = engine_config
        self._engine_factory = functools.partial(engine_cls.from_config, engine_config, torch_num_threads)
        self._restarting = False
        self._num_engine_restarts = 0
        self.engine = self._engine_factory()
        self._tokenizer = self.engine.tokenizer
        self._generation_defaults = generation_defaults(resolve_model_path(engine_config.model.model))

    def _attach_engine(self, engine: Any) -> None:
        engine.add_step_listener(self.metrics.observe_step)
        engine.add_step_listener(self._on_step)
        self.metrics.bind_load(engine.load)
        if hasattr(engine, "on_exit"):  # ProcessEngine: its child can die under us
            engine.on_exit = self._on_engine_exit

    def _on_engine_exit(self) -> None:
        """The engine process died (kill -9, OOM); its streams have failed already. Start a new one beside: the
        replica is unhealthy and hands back whatever arrives until it is up (seconds), so it is back well within
        Serve's replacement of the whole replica."""
        if self._restarting:
            return
        self._restarting = True
        logger.error("engine process of replica %s died; restarting it", self._replica_id)
        threading.Thread(target=self._restart_engine, name="conveyor-engine-restart", daemon=True).start()

    def _restart_engine(self) -> None:
        old = self.engine
        try:
            old.shutdown()
            engine = self._engine_factory()
        except Exception:  # noqa: BLE001 - the health check keeps failing: Serve replaces the replica
            logger.exception("engine restart failed on replica %s", self._replica_id)
            return
        self._attach_engine(engine)
        self.engine = engine
        self._last_progress = time.monotonic()
        self._num_engine_restarts += 1
        self._restarting = False
        logger.warning("engine process of replica %s restarted", self._replica_id)

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            prompt = self._prompt(request)
            params = self._params(request["params"], len(prompt), request.get("unset", ()))
            # Tokens that queued up while this replica was busy leave as one record, not one each.
            stream = self.engine.generate(prompt, params, request.get("request_id"), coalesce=True)
            start = time.monotonic()
            output = await anext(stream)
            if output.finish_reason == "error":  # ended before its first token
                raise ValueError("the request ended before its first token: its structured-output constraint "
                                 "could not be compiled for this model, or its settings left no token to sample "
                                 "(see the replica log)")
        except EngineDeadError as exc:  # nothing sent yet: the ingress sends it to another replica (streams.py)
            yield {"error": HAND_BACK, "message": str(exc)}
            return
        except QueueFullError as exc:
            self.metrics.observe_rejected(exc.reason)
            yield {"error": "queue_full", "message": str(exc), "retry_after_s": exc.retry_after_s}
            return
        except (ValueError, TypeError) as exc:  # UnicodeError is a ValueError: odd text lands here too
            self.metrics.observe_rejected("invalid_request")
            yield {"error": "invalid_request", "message": str(exc)}
            return
        except asyncio.CancelledError:  # the client left before the first token: the engine stream's close
            self._num_aborted += 1     # has aborted the request already
            raise
        # Closing the engine stream aborts the request: this runs when the ingress cancels us (client gone).
        try:
            last = time.monotonic()
            self._ttft.add(last - start)
            # A client that is not streaming reads nothing until the end: send it the rest as one record, not
            # one per token (each record costs both processes an RPC; ~850 a second in the overload drill).
            per_token = request.get("stream", True)
            mux = self._muxes.get(request.get(SUBSCRIBER_KEY)) if per_token else None
            yield self._record(output) | {"replica": self._replica_id, MUX_KEY: mux is not None}
            if mux is not None:
                latest = [output]  # _via_mux's latest output, for the abort count below
                try:
                    async for record in self._via_mux(mux, request.get(ROUTE_KEY, ""), latest, stream):
                        yield record
                finally:
                    output = latest[0]
                return
            pending: list[RequestOutput] = []
            while not output.finished:
                try:
                    output = await anext(stream)
                except EngineDeadError as exc:
                    if per_token:  # its client has tokens already: the stream ends with an error event
                        raise
                    # A client that is not streaming has been sent nothing yet: the ingress starts it over
                    # elsewhere (streams.py: read_whole), as it does a request handed back before its first token.
                    yield {"error": HAND_BACK, "message": str(exc)}
                    return
                now = time.monotonic()
                self._itl.add(now - last)
                last = now
                if per_token:
                    yield self._record(output)
                else:
                    pending.append(output)
            if pending:
                yield self._record(merge_outputs(pending))
        finally:
            if not output.finished:
                self._num_aborted += 1
            await stream.aclose()

    async def _via_mux(self, mux: StreamMux, key: str, latest: list[RequestOutput],
                       stream: AsyncIterator[RequestOutput]) -> AsyncIterator[dict[str, Any]]:
        """After the first record (latest[0]): the engine's outputs go to the ingress's subscription; this returns
        once the last has left in a batch. Records are yielded here only if the subscription closed meanwhile.
        latest[0] is kept at the newest output."""
        output = latest[0]
        request_id = output.request_id
        mux.attach(request_id, key)
        try:
            last = time.monotonic()
            while not output.finished and not mux.closed:
                output = latest[0] = await anext(stream)
                now = time.monotonic()
                self._itl.add(now - last)
                last = now
                mux.put(output)
            if not mux.closed:
                await mux.wait_final_taken(request_id)
        finally:
            leftover, seq = mux.detach(request_id)
        if not mux.closed:
            return
        # The subscription went away: what it did not take, and the rest, come on this stream.
        if leftover:
            yield self._record(merge_outputs(leftover)) | {SEQ_KEY: seq}
            seq += 1
        while not output.finished:
            output = latest[0] = await anext(stream)
            yield self._record(output) | {SEQ_KEY: seq}
            seq += 1

    async def subscribe(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """One ingress's subscription (router/mux.py): every step's records for its muxed streams, one message."""
        subscriber = request[SUBSCRIBER_KEY]
        if self._muxes.get(subscriber) is not None:  # it has one here: this one was meant for another replica
            yield {"duplicate": self._replica_id}
            return
        mux = self._muxes.open(subscriber)
        try:
            yield {"subscribed": self._replica_id}
            while True:
                batch = await mux.take(SUBSCRIPTION_IDLE_S)
                if batch is None:
                    if mux.num_attached == 0:
                        return
                    continue
                self._num_batches += 1
                self._num_muxed_records += len(batch)
                yield {"batch": [(key, seq, self._record(out)) for key, seq, out in batch]}
        except asyncio.CancelledError:
            self._num_subscriptions_cancelled += 1
            raise
        finally:
            self._muxes.close(subscriber, mux)

    def _prompt(self, request: dict[str, Any]) -> list[int]:
        """Token ids (tokenized once, here): the length decides an unset max_tokens."""
        prompt = request["prompt"]
        if request.get("messages") is not None:
            prompt = self.engine.apply_chat_template(request["messages"])
        return self.engine.tokenize(prompt)

    def _params(self, params: SamplingParams, num_prompt: int, unset: Any = ()) -> SamplingParams:
        params = apply_generation_defaults(params, self._generation_defaults, unset)
        # OpenAI clients often omit max_tokens ("up to the context"). The engine would refuse that when this
        # replica's KV cache is smaller than the context, so cap it at what can ever fit here instead.
        if params.max_tokens is not None:
            return params
        room = min(self.engine.max_model_len, self.engine.max_tokens_ever) - num_prompt
        return dataclasses.replace(params, max_tokens=room) if room >= 1 else params

    def _record(self, out: RequestOutput) -> dict[str, Any]:
        record: dict[str, Any] = {"text": out.delta_text, "num_tokens": len(out.delta_token_ids),
                                  "prompt_tokens": out.num_prompt_tokens}
        if out.finished:
            record["finish_reason"] = out.finish_reason
            record["cached_tokens"] = out.num_cached_tokens
        if out.delta_logprobs is not None:
            record["logprobs"] = [self._logprob_entry(s) for s in out.delta_logprobs]
        return record

    def _logprob_entry(self, sampled: SampledToken) -> dict[str, Any]:
        top = sampled.top_logprobs or {}
        return {"token": self._tokenizer.decode([sampled.token_id]), "logprob": sampled.logprob,
                "top": [(self._tokenizer.decode([tid]), lp) for tid, lp in top.items()]}

    # ---- what Serve and the routing/autoscaling policies read ---------------------------------------
    # The hooks Serve calls on a timer (and the ingress's probe) are coroutines: they only read state this process
    # holds. A plain method would run through anyio's to_thread, which under Serve starts and stops a thread for
    # every call (each call is its own root task): one every 0.5 s for the routing stats alone.
    async def record_routing_stats(self) -> dict[str, Any]:
        load = self.engine.load()
        sched = self.config.scheduler
        if not self.engine.is_alive():  # a saturated replica to the router: new traffic goes elsewhere
            return {"num_waiting": sched.max_waiting_requests, "num_running": sched.max_num_seqs,
                    "kv_cache_usage": 1.0, "max_num_seqs": sched.max_num_seqs,
                    "max_waiting_requests": sched.max_waiting_requests}
        return {"num_waiting": load.num_waiting, "num_running": load.num_running,
                "kv_cache_usage": load.kv_cache_usage, "max_num_seqs": sched.max_num_seqs,
                "max_waiting_requests": sched.max_waiting_requests}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        load = self.engine.load()
        return {"num_waiting": float(load.num_waiting), "num_running": float(load.num_running),
                "kv_cache_usage": float(load.kv_cache_usage), "ttft_p99_s": self._ttft.percentile(0.99),
                "itl_p99_s": self._itl.percentile(0.99)}

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s; after 3 failures in a row it replaces the replica.
        A dead engine process fails it, and so does a live one that has work but completed no step for
        engine_stall_timeout_s (a wedged engine: Serve would otherwise keep routing to it forever)."""
        if not self.engine.is_alive():
            raise RuntimeError("engine is restarting" if self._restarting else "engine is not running")
        stalled_s = self._stalled_s()
        if stalled_s > self._stall_timeout_s:
            raise RuntimeError(f"engine made no progress for {stalled_s:.0f} s with work queued "
                               f"(engine_stall_timeout_s={self._stall_timeout_s:g})")

    def _on_step(self, stats: Any, outputs: Any) -> None:
        self._last_progress = time.monotonic()

    def _stalled_s(self) -> float:
        """Seconds since the engine last showed progress while it had work; 0 while idle."""
        now = time.monotonic()
        if not self.engine.has_work():
            self._last_progress = now  # idle is progress: the clock starts when work is there
            return 0.0
        return now - self._last_progress

    async def ready(self) -> dict[str, Any]:
        """The ingress's readiness probe: answered only once __init__ has loaded the model and built the engine
        (Serve routes nothing to a replica before), refused while the engine is wedged."""
        await self.check_health()
        return {"replica": self._replica_id, "model": self.metrics.model}

    def stall_engine_for_test(self, seconds: float) -> None:
        if not self._test_hooks:
            raise RuntimeError("test hooks are off (ServeArgs.test_hooks)")
        self.engine.stall_for_test(seconds)

    def engine_state(self) -> dict[str, int]:
        """Block accounting, for tests: a finished or aborted request must hold no blocks."""
        load = self.engine.load()
        return self.engine.block_state() | {"num_waiting": load.num_waiting, "num_running": load.num_running,
                                            "num_aborted": self._num_aborted, "num_batches": self._num_batches,
                                            "num_engine_restarts": self._num_engine_restarts,
                                            "num_muxed_records": self._num_muxed_records,
                                            "num_subscriptions": self._muxes.num_open,
                                            "num_subscriptions_cancelled": self._num_subscriptions_cancelled,
                                            "num_muxed_streams": self._muxes.num_attached}

    def process_stats(self) -> dict[str, Any]:
        """Which replica answered, its pid and resident memory, with its block accounting: for soak tests
        (no replica restarted, memory flat, no leaked blocks on any replica)."""
        import os

        with open("/proc/self/statm") as f:  # Linux: resident pages are the second field
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return {"replica_id": self._replica_id, "pid": os.getpid(), "rss_bytes": rss} | self.engine_state()

    def __del__(self) -> None:
        endpoint = getattr(self, "_metrics_endpoint", None)
        if endpoint is not None:
            endpoint.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
