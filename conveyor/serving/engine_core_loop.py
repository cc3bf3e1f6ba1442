"""The child side of ProcessEngine (conveyor/serving/engine_process.py): build the engine, then step it and apply the
parent's commands until the pipe closes. Runs in a spawned process; nothing here is shared with the parent."""
from __future__ import annotations

import logging
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from conveyor.serving.config import EngineConfig
from conveyor.serving.priority import engine_niceness_setting, leave_batch_policy, set_engine_priority
from conveyor.serving.scheduler import QueueFullError

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # an idle engine blocks on the pipe; this only bounds how long a dead parent goes unseen


def main() -> None:
    """`python -m conveyor.serving.engine_core_loop FD`: FD is this process's end of the parent's socket pair."""
    conn = Connection(int(sys.argv[1]))
    # Before any thread exists: threads start at their creator's policy and niceness (serving/priority.py says why).
    leave_batch_policy()
    set_engine_priority(engine_niceness_setting())
    try:
        kind, config, torch_num_threads = conn.recv()
    except EOFError:
        return
    if kind == "start":
        run_engine_core(conn, config, torch_num_threads)


def run_engine_core(conn: Connection, config: EngineConfig, torch_num_threads: int | None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    try:
        engine = _build(config, torch_num_threads)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it in the replica
        conn.send(("build_error", traceback.format_exc()))
        return
    # Structured outputs need the tokenizer's byte-level view (~1 s of CPU for a 49k vocabulary): build it now, in
    # the compile pool, while the engine is idle, not when the first constrained request arrives at a busy engine
    # (a constrained half of a saturated batch then joined ~4 s late: 0.88x throughput, benchmarks/structured.py).
    engine.grammar_compiler()
    core = _Core(engine, conn)
    conn.send(("ready", core.info()))
    conn.send(("load", core.load()))
    try:
        core.run()
    except (EOFError, OSError, BrokenPipeError):
        pass  # the parent is gone: nobody to serve


def _build(config: EngineConfig, torch_num_threads: int | None):  # noqa: ANN202 - LLMEngine, imported late
    if torch_num_threads:
        import torch

        torch.set_num_threads(torch_num_threads)
    from conveyor.serving.engine import LLMEngine

    return LLMEngine(config)


class _Core:
    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.num_adds_applied = 0

    def info(self) -> dict[str, Any]:
        from conveyor.serving.openmp_runtime import loaded_openmp_runtime

        return {"openmp_runtime": loaded_openmp_runtime(),
                "max_model_len": self.engine.max_model_len, "max_tokens_ever": self.engine.kv_cache.max_tokens_ever()}

    def load(self) -> dict[str, Any]:
        scheduler = self.engine.scheduler
        return {"num_waiting": scheduler.num_waiting, "num_running": scheduler.num_running,
                "kv_cache_usage": self.engine.kv_cache.usage,
                "max_queued_requests": scheduler.max_queued_requests(),
                "expected_wait_s": scheduler.expected_queue_wait_s(),
                "num_adds_applied": self.num_adds_applied}

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            if busy or self.conn.poll(IDLE_POLL_S):
                applied = self._drain()
                if self.engine.has_unfinished():
                    self._step()
                elif applied:  # nothing to step (aborts, refusals): the parent's view must still move on
                    self.conn.send(("load", self.load()))

    def _step(self) -> None:
        try:
            outputs, stats = self.engine.core_step()
        except Exception as exc:  # keep serving, as AsyncEngine does: fail the live requests, not the process
            logger.exception("engine step failed")
            live = list(self.engine.scheduler.requests)
            self.engine.abort_requests(live)
            for request_id in live:
                self.conn.send(("reject", request_id, "engine_error", f"engine step failed: {exc}", 0.0))
            self.conn.send(("load", self.load()))
            return
        self.conn.send(("step", outputs, stats, self.load()))

    def _drain(self) -> int:
        applied = 0
        while self.conn.poll():
            self._apply(self.conn.recv())
            applied += 1
        return applied

    def _apply(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            self._add(*message[1:])
        elif kind == "abort":
            self.engine.abort_requests([message[1]])
        elif kind == "query":
            self.conn.send(("reply", message[1], self._answer(message[2])))
        elif kind == "stall":  # a test hook (drills): the step loop stops for this long, as a wedged engine
            logger.warning("engine loop stalled for %.1f s on request (test hook)", message[1])
            time.sleep(message[1])

    def _add(self, request_id: str, prompt: Any, params: Any) -> None:
        self.num_adds_applied += 1
        try:
            # The parent validated any structured-output constraint; a grammar that still fails to compile ends
            # its request with finish_reason "error".
            self.engine.add_request(self.engine.make_request(prompt, params, request_id, validate_grammar=False))
        except QueueFullError as exc:
            self.conn.send(("reject", request_id, exc.reason, str(exc), exc.retry_after_s))
        except (ValueError, TypeError) as exc:
            self.conn.send(("reject", request_id, "invalid_request", str(exc), 0.0))

    def _answer(self, name: str) -> Any:
        if name == "block_state":
            kv = self.engine.kv_cache
            return {"num_block_tables": len(kv.block_tables), "num_free_blocks": kv.num_free_blocks,
                    "num_blocks": kv.num_blocks}
        return None


if __name__ == "__main__":
    main()
