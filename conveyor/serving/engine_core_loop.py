"""The child side of ProcessEngine (conveyor/serving/engine_process.py): build the engine, then step it and apply the
parent's messages (engine_messages.py) until the pipe closes. Runs in a spawned process; nothing here is shared with
the parent. A request leaves no state here once it ends: the core registers nothing for output processing (the parent
does that), and an engine that goes idle hands its model runner the ids of the requests that just ended."""
from __future__ import annotations

import gc
import logging
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from conveyor.serving import engine_messages as msg
from conveyor.serving.admission import QueueFullError
from conveyor.serving.config import EngineConfig
from conveyor.serving.engine_client import DeviceFaultError, device_fault
from conveyor.serving.engine_inbox import Inbox
from conveyor.serving.priority import engine_niceness_setting, leave_batch_policy, set_engine_priority
from conveyor.serving.step_batching import StepBatcher
from conveyor.serving.ttft_forecast import cached_prefix_tokens

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # an idle engine blocks on the pipe; this only bounds how long a dead parent goes unseen
EXIT_DEVICE_FAULT = 3  # the exit code after a GPU device-side fault (its parent logs it)


def main() -> None:
    """`python -m conveyor.serving.engine_core_loop FD`: FD is this process's end of the parent's socket pair."""
    conn = Connection(int(sys.argv[1]))
    # Before any thread exists: threads start at their creator's policy and niceness (serving/priority.py says why).
    leave_batch_policy()
    set_engine_priority(engine_niceness_setting())
    try:
        start = conn.recv()
    except EOFError:
        return
    if isinstance(start, msg.Start):
        run_engine_core(conn, start.config, start.torch_num_threads)


def run_engine_core(conn: Connection, config: EngineConfig, torch_num_threads: int | None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    try:
        engine = _build(config, torch_num_threads)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it in the replica
        conn.send(msg.BuildError(traceback.format_exc()))
        return
    # Structured outputs need the tokenizer's byte-level view (~1 s of CPU for a 49k vocabulary): build it now, in
    # the compile pool, while the engine is idle, not when the first constrained request arrives at a busy engine
    # (a constrained half of a saturated batch then joined ~4 s late: 0.88x throughput, benchmarks/structured.py).
    engine.grammar_compiler()
    core = _Core(engine, conn)
    conn.send(msg.Ready(core.info()))
    conn.send(msg.LoadReport(core.load()))
    core.inbox.start()
    try:
        core.run()
    except (EOFError, OSError, BrokenPipeError):
        pass  # the parent is gone: nobody to serve
    except DeviceFaultError:
        # The CUDA context is poisoned: no teardown in it (freeing its memory can hang or fault again). The
        # parent has the DeviceFault message; it fails the live streams and its replica asks to be replaced.
        logging.shutdown()
        os._exit(EXIT_DEVICE_FAULT)


def _build(config: EngineConfig, torch_num_threads: int | None):  # noqa: ANN202 - LLMEngine, imported late
    if torch_num_threads:
        import torch

        torch.set_num_threads(torch_num_threads)
    from conveyor.serving.engine import LLMEngine

    return LLMEngine(config)


def per_request_state(engine: Any) -> dict[str, int]:
    """The size of every per-request map of an engine core: all 0 once no request is in flight and the engine has
    gone idle (the 10,000-request test and soak checks read this through a Query)."""
    kv, runner, scheduler, processor = engine.kv_cache, engine.runner, engine.scheduler, engine.output_processor
    return {"scheduler.requests": len(scheduler.requests), "scheduler.waiting": len(scheduler.waiting),
            "scheduler.running": len(scheduler.running), "scheduler.finished_ids": len(scheduler._finished_ids),
            "kv.block_tables": len(kv.block_tables), "kv.block_ids": len(kv._block_ids),
            "kv.num_registered": len(kv._num_registered), "kv.hashes": len(kv._hashes),
            "runner.generators": len(runner._generators), "runner.last_sampled": len(runner.last_sampled),
            "runner.rows": len(runner.input_batch.rows),
            **{f"output_processor.{name}": size for name, size in processor.sizes().items()}}


class _Core:
    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        kv = engine.kv_cache
        self.inbox = Inbox(conn, lambda token_ids: cached_prefix_tokens(kv.pool, kv.block_size, token_ids))
        self.num_adds_applied = 0
        self.batcher = StepBatcher(engine.config.stream_batching_interval_ms / 1000)
        self._last_step_s = 0.0
        self.handlers = {msg.Add: self._add, msg.Abort: self._abort, msg.Query: self._query, msg.Stall: self._stall}

    def info(self) -> dict[str, Any]:
        from conveyor.serving.openmp_runtime import loaded_openmp_runtime

        return {"openmp_runtime": loaded_openmp_runtime(),
                "max_model_len": self.engine.max_model_len, "max_tokens_ever": self.engine.kv_cache.max_tokens_ever()}

    def load(self) -> msg.CoreLoad:
        scheduler = self.engine.scheduler
        return msg.CoreLoad(scheduler.num_waiting, scheduler.num_running, self.engine.kv_cache.usage,
                            scheduler.max_queued_requests(), scheduler.expected_queue_wait_s(),
                            self.num_adds_applied + self.inbox.num_refused_early)

    def run(self) -> None:
        worked = False  # stepped or applied a message since the engine last went idle
        while True:
            if not self.engine.has_unfinished():
                if worked:  # just gone idle: nothing of the requests that ended may stay behind
                    self._flush()
                    self._release_finished()
                    worked = False
                message = self.inbox.get(IDLE_POLL_S)
                if message is None:
                    continue
                self._apply(message)
            applied = self._drain()
            if self.engine.has_unfinished():
                self._step()
                worked = True
            elif applied:  # nothing to step (aborts, refusals): the parent's view must still move on
                self._send(msg.LoadReport(self.load()))
                worked = True

    def _send(self, message: Any) -> None:
        """Held steps leave first: the parent sees the engine's messages in the order they were made."""
        self._flush()
        self.inbox.send(message)

    def _flush(self) -> None:
        if (held := self.batcher.take()) is not None:
            self.inbox.send(held)

    def _release_finished(self) -> None:
        try:
            self.engine.release_finished()  # a step of the model runner: it can meet a device fault too
        except Exception as exc:  # noqa: BLE001 - bookkeeping of ended requests: the next step releases them anyway
            self._stop_on_device_fault(exc)
            logger.exception("releasing ended requests failed")

    def _stop_on_device_fault(self, exc: Exception) -> None:
        """A GPU device-side fault ends this process (DeviceFaultError, after telling the parent); others return."""
        fault = device_fault(exc)
        if fault is None:
            return
        logger.critical("GPU device-side fault in the engine step: this engine process stops and its replica "
                        "must be replaced", exc_info=exc)
        self._send(msg.DeviceFault(fault))
        raise DeviceFaultError(fault) from exc

    def _step(self) -> None:
        if self.batcher.due_within(self._last_step_s):
            self._flush()  # held outputs would otherwise wait a whole step past the interval
        try:
            outputs, stats = self.engine.core_step()
        except Exception as exc:  # keep serving, as AsyncEngine does: fail the live requests, not the process
            self._stop_on_device_fault(exc)  # ... unless the GPU faulted: then nothing here can step again
            logger.exception("engine step failed")
            live = list(self.engine.scheduler.requests)
            self.engine.abort_requests(live)
            for request_id in live:
                self._send(msg.Reject(request_id, "engine_error", f"engine step failed: {exc}"))
            self._send(msg.LoadReport(self.load()))
            return
        self.inbox.set_forecast(self.engine.scheduler.ttft_forecast())
        self._last_step_s = stats.step_time_s
        if (ready := self.batcher.add(msg.Step(outputs, stats, self.load()))) is not None:
            self.inbox.send(ready)

    def _drain(self) -> int:
        applied = 0
        while (message := self.inbox.get()) is not None:
            self._apply(message)
            applied += 1
        self.inbox.set_forecast(self.engine.scheduler.ttft_forecast())
        return applied

    def _apply(self, message: Any) -> None:
        """One message; an exception while handling it fails that message's request only, never the process."""
        handler = self.handlers.get(type(message))
        if handler is None:
            logger.error("engine process got an unknown message %r: ignored", type(message).__name__)
            return
        try:
            handler(message)
        except (EOFError, OSError):
            raise  # the pipe itself: the parent is gone
        except Exception as exc:  # noqa: BLE001 - one bad message must not end every request of the replica
            logger.exception("engine process failed on a %s message", type(message).__name__)
            request_id = getattr(message, "request_id", None)
            if request_id is not None:
                self._fail_request(request_id, exc)
            elif isinstance(message, msg.Query):
                self._send(msg.Reply(message.query_id, None))

    def _fail_request(self, request_id: str, exc: Exception) -> None:
        try:
            self.engine.abort_requests([request_id])
        except Exception:  # noqa: BLE001 - the request may be half-added; what it holds is logged, not fatal
            logger.exception("aborting %s after a failure failed", request_id)
        self._send(msg.Reject(request_id, "engine_error", f"engine failed on this request: {exc}"))

    def _add(self, message: msg.Add) -> None:
        self.num_adds_applied += 1
        try:
            # The parent validated any structured-output constraint; a grammar that still fails to compile ends
            # its request with finish_reason "error".
            request = self.engine.make_request(message.prompt_token_ids, message.params, message.request_id,
                                               validate_grammar=False)
            self.engine.add_request(request, process_outputs=False, check_ttft=not message.ttft_admitted)
        except QueueFullError as exc:
            self._send(msg.Reject(message.request_id, exc.reason, str(exc), exc.retry_after_s))
        except (ValueError, TypeError) as exc:
            self._send(msg.Reject(message.request_id, "invalid_request", str(exc)))

    def _abort(self, message: msg.Abort) -> None:
        self.engine.abort_requests([message.request_id])

    def _query(self, message: msg.Query) -> None:
        self._send(msg.Reply(message.query_id, self._answer(message.name)))

    def _stall(self, message: msg.Stall) -> None:
        logger.warning("engine loop stalled for %.1f s on request (test hook)", message.seconds)
        self._flush()
        time.sleep(message.seconds)

    def _answer(self, name: str) -> Any:
        if name == "block_state":
            kv = self.engine.kv_cache
            return {"num_block_tables": len(kv.block_tables), "num_free_blocks": kv.num_free_blocks,
                    "num_blocks": kv.num_blocks}
        if name == "request_state":
            return per_request_state(self.engine)
        if name == "python_heap":  # live Python allocations (after a collection): what any kept record shows in
            gc.collect()
            return sys.getallocatedblocks()
        if name == "fail_next_add":  # a test hook: the next Add raises inside the engine, as a bug there would
            self.handlers[msg.Add] = self._add_that_raises
            return True
        if name == "device_fault_next_step":  # a test hook: the next step raises as a faulting CUDA kernel does
            self.engine.core_step = _raise_device_fault
            return True
        return None

    def _add_that_raises(self, message: msg.Add) -> None:
        self.handlers[msg.Add] = self._add
        raise RuntimeError("injected failure (test hook)")


def _raise_device_fault() -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered (injected: test hook)")


if __name__ == "__main__":
    main()
