"""AsyncEngine: one background thread steps the engine; each request is an async stream of deltas. The same
EngineClient contract (engine_client.py) as ProcessEngine, which the replica uses by default."""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from conveyor.serving.admission import QueueFullError
from conveyor.serving.config import EngineConfig
from conveyor.serving.engine import LLMEngine
from conveyor.serving.engine_client import DeviceFaultError, EngineLoad, StreamingClient, device_fault
from conveyor.serving.outputs import RequestOutput
from conveyor.serving.request import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine(StreamingClient):
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        """engine: a built engine, or a factory that the engine thread calls to build it (see from_config)."""
        super().__init__()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.engine: LLMEngine | None = engine if isinstance(engine, LLMEngine) else None
        factory = None if isinstance(engine, LLMEngine) else engine
        self._thread = threading.Thread(target=self._run, args=(factory,), name="conveyor-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    @classmethod
    def from_config(cls, config: EngineConfig, torch_num_threads: int | None = None) -> AsyncEngine:
        """Builds the engine on its own stepping thread. Where a model is loaded and where it runs matters on
        CPU: each thread that runs torch ops owns an OpenMP team, and once libgomp manages more threads than
        there are cores it stops spinning between parallel regions, so every op of a step sleeps and wakes
        its workers (measured: SmolLM2 decode step 35 ms built and run on one thread, 45-49 ms loaded on one
        and stepped on another). The thread count is per thread too (OpenMP's nthreads ICV), so it is set
        there: torch_num_threads, else whatever OMP_NUM_THREADS says (Ray sets it to a replica's num_cpus)."""

        def build() -> LLMEngine:
            if torch_num_threads:
                import torch

                torch.set_num_threads(torch_num_threads)
            return LLMEngine(config)

        return cls(build)

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_tokens_ever(self) -> int:
        return self.engine.kv_cache.max_tokens_ever()

    def block_state(self) -> dict[str, int]:
        """Block accounting (read without locks: may be mid-step), for tests and soak checks."""
        kv = self.engine.kv_cache
        return {"num_block_tables": len(kv.block_tables), "num_free_blocks": kv.num_free_blocks,
                "num_blocks": kv.num_blocks}

    def load(self) -> EngineLoad:
        sched = self.engine.scheduler
        return EngineLoad(sched.num_waiting, sched.num_running, self.engine.kv_cache.usage)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       coalesce: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Closing the iterator early (client gone) aborts the request.
        coalesce: outputs that queued up while the consumer was busy come as one (RequestStream.outputs).

        Raises ValueError for bad input and QueueFullError when the waiting queue is at its bound, both
        before the first output, so a server can still answer with a status code.
        """
        request = self.engine.make_request(prompt, params, request_id)
        self._check_queue_room()
        stream = self._open_stream(request.request_id)
        self._commands.put(("add", request))
        finished = False
        try:
            async for item in stream.outputs(coalesce):
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self._commands.put(("abort", request.request_id))

    def is_alive(self) -> bool:
        """False once the engine thread has stopped (shutdown, crash, a device fault): a health check reads this."""
        return self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout=10)

    def _check_queue_room(self) -> None:
        scheduler = self.engine.scheduler
        if scheduler.num_waiting + self._commands.qsize() >= scheduler.max_queued_requests():
            raise QueueFullError("waiting queue full")

    # ---- engine thread -----------------------------------------------------------------------------
    def _run(self, factory: Callable[[], LLMEngine] | None) -> None:
        try:
            if factory is not None:
                self.engine = factory()
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor's caller
            self._build_error = exc
            return
        finally:
            self._built.set()
        while not self._stopped.is_set():
            try:
                block = not self.engine.has_unfinished()
                self._drain_commands(block)
                if self.engine.has_unfinished():
                    outputs, stats = self.engine.step()
                    self._deliver(outputs, self.engine.config.stream_interval)
                    for listener in self._step_listeners:
                        listener(stats, outputs)
            except Exception as exc:  # keep serving: fail the live streams rather than dying silently
                if (fault := device_fault(exc)) is not None:  # the GPU faulted: nothing here can step again
                    self._stop_on_device_fault(fault, exc)
                    return
                logger.exception("engine step failed")
                self._fail_all(exc)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, arg) -> None:  # noqa: ANN001
        if kind == "add":
            if arg.request_id not in self._streams:
                return  # the consumer left before the engine saw the request
            try:
                self.engine.add_request(arg)
            except (ValueError, QueueFullError) as exc:
                self._post(arg.request_id, exc)
            except Exception as exc:  # noqa: BLE001 - a fault on one request's command fails that request only
                logger.exception("engine failed to add request %s", arg.request_id)
                self.engine.abort_requests([arg.request_id])
                self._post(arg.request_id, RuntimeError(f"engine failed on this request: {exc}"))
        elif kind == "abort":
            self.engine.abort_requests([arg])

    def _fail_all(self, exc: Exception) -> None:
        live = list(self._streams)
        self.engine.abort_requests(live)
        for rid in live:
            self._post(rid, RuntimeError(f"engine step failed: {exc}"))

    def _stop_on_device_fault(self, fault: str, exc: Exception) -> None:
        """The thread ends (is_alive False) and every stream gets DeviceFaultError: one that has had no output can
        be served elsewhere (the replica hands it back); this process's replica must be replaced."""
        logger.critical("GPU device-side fault in the engine step: the engine stops and its replica must be "
                        "replaced", exc_info=exc)
        self._device_fault = fault
        error = DeviceFaultError(f"engine stopped on a GPU device-side fault: {fault}")
        for rid in list(self._streams):
            self._post(rid, error)
