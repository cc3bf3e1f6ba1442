"""The engine deployment: one engine (EngineClient: ProcessEngine, or AsyncEngine) per Serve replica, streamed
through a DeploymentHandle. The engine is kept running by an EngineSupervisor (engine_supervisor.py: a dead engine
process is restarted in place; what it had not started is handed back). The records crossing the handle are
handle_records.py's.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from conveyor.router.drain import HAND_BACK, ROUTE_KEY
from conveyor.router.engine_supervisor import EngineSupervisor
from conveyor.router.handle_records import engine_inputs, output_record
from conveyor.router.latency_window import LatencyWindow
from conveyor.router.mux import MUX_KEY, SEQ_KEY, SUBSCRIBER_KEY, MuxHub, StreamMux
from conveyor.serving.admission import QueueFullError
from conveyor.serving.config import EngineConfig
from conveyor.serving.engine_client import EngineClient, EngineDeadError
from conveyor.serving.outputs import RequestOutput, merge_outputs

REFUSED_WINDOW_S = 10.0

logger = logging.getLogger(__name__)

# A subscription with no request attached ends after this long (the ingress opens a new one when it needs it).
# Serve counts it as an ongoing request, so a stopping replica (scale-in, redeploy, `serve delete`) waits for it
# to end: at 5 s each stop took 5-7 s longer than its streams. Opening one again is one call, and until it
# answers a new request's records take its own stream.
SUBSCRIPTION_IDLE_S = 1.0


@serve.deployment(name="EngineReplica", max_ongoing_requests=1024, health_check_period_s=5)
class EngineReplica:
    def __init__(self, engine_config: EngineConfig, torch_num_threads: int | None = None,
                 latency_window_s: float = 60.0, model_name: str | None = None,
                 engine_process: bool = True, engine_stall_timeout_s: float = 120.0,
                 test_hooks: bool = False) -> None:
        from conveyor.router.metrics_registry import start_replica_endpoint
        from conveyor.serving.metrics import EngineMetrics
        from conveyor.serving.priority import raised_priority

        self.config = engine_config
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._num_aborted = 0  # streams closed before their end (client gone): evidence for tests
        self._ttft = LatencyWindow(latency_window_s)
        self._itl = LatencyWindow(latency_window_s)
        # 1.0 per request refused for capacity, 0.0 per admitted; a short window, so that the share falls soon
        # after a scale-out instead of asking for more replicas for a minute.
        self._refused = LatencyWindow(REFUSED_WINDOW_S)
        # Prometheus metrics (conveyor/serving/metrics.py): fed on the engine thread after every step, served on
        # this replica's own port and advertised for service discovery (conveyor/router/metrics_registry.py).
        self.metrics = EngineMetrics(model_name or engine_config.model.model, self._replica_id)
        # A replica that starts beside busy engines (scale-out, rolling update, a replaced replica) would get a
        # sliver of the CPU at Ray's niceness: its start-up runs at the engine's (conveyor/serving/priority.py).
        with raised_priority():
            self._start_engine(engine_config, torch_num_threads, engine_process, engine_stall_timeout_s)
        self._test_hooks = test_hooks
        self._metrics_endpoint = start_replica_endpoint("engine", self.metrics.model)
        self._muxes = MuxHub()
        self._num_batches = self._num_muxed_records = 0  # evidence for tests: records per subscription message
        self._num_subscriptions_cancelled = 0  # evidence for tests: the ingress (or Serve for it) cancelled one

    def _start_engine(self, engine_config: EngineConfig, torch_num_threads: int | None, engine_process: bool,
                      stall_timeout_s: float) -> None:
        # torch and the model load here (or in the engine's child process), not when the driver imports us.
        if engine_process:
            from conveyor.serving.engine_process import ProcessEngine as engine_cls
        else:
            from conveyor.serving.async_engine import AsyncEngine as engine_cls
        from conveyor.serving.models.loader import generation_defaults, resolve_model_path

        factory = functools.partial(engine_cls.from_config, engine_config, torch_num_threads)
        self._supervisor = EngineSupervisor(factory, stall_timeout_s=stall_timeout_s, name=self._replica_id,
                                            on_start=self._bind_metrics)
        self._tokenizer = self.engine.tokenizer
        self._generation_defaults = generation_defaults(resolve_model_path(engine_config.model.model))

    def _bind_metrics(self, engine: EngineClient) -> None:
        engine.add_step_listener(self.metrics.observe_step)
        self.metrics.bind_load(engine.load)

    @property
    def engine(self) -> EngineClient:
        """The engine now running (a restart replaces it)."""
        return self._supervisor.engine

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            prompt, params = engine_inputs(request, self.engine, self._generation_defaults)
            # Tokens that queued up while this replica was busy leave as one record, not one each.
            stream = self.engine.generate(prompt, params, request.get("request_id"), coalesce=True)
            start = time.monotonic()
            output = await anext(stream)
            self._refused.add(0.0)
            if output.finish_reason == "error":  # ended before its first token
                raise ValueError("the request ended before its first token: its structured-output constraint "
                                 "could not be compiled for this model, or its settings left no token to sample "
                                 "(see the replica log)")
        except EngineDeadError as exc:  # nothing sent yet: the ingress sends it to another replica (streams.py)
            yield {"error": HAND_BACK, "message": str(exc)}
            return
        except QueueFullError as exc:
            self._refused.add(1.0)
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

    def _record(self, out: RequestOutput) -> dict[str, Any]:
        return output_record(out, self._tokenizer)

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
                "itl_p99_s": self._itl.percentile(0.99), "refused_fraction": self._refused.mean()}

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s; after 3 failures in a row it replaces the replica.
        EngineSupervisor.health_problem says what fails it (a dead, restarting or wedged engine)."""
        problem = self._supervisor.health_problem()
        if problem is not None:
            raise RuntimeError(problem)

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
                                            "num_engine_restarts": self._supervisor.num_restarts,
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

    def __del__(self) -> None:  # Serve calls it when it stops the replica
        self.close()

    def close(self) -> None:
        """Stop the metrics endpoint and the engine (idempotent: each one's own close is)."""
        endpoint = getattr(self, "_metrics_endpoint", None)
        if endpoint is not None:
            endpoint.close()
        supervisor = getattr(self, "_supervisor", None)
        if supervisor is not None:
            supervisor.shutdown()
