"""ProcessEngine: the EngineClient contract (engine_client.py) with the engine stepping in a child process.

In a Serve replica the engine thread shares one GIL with Serve's own request machinery (an RPC per request,
one per streamed record, metrics). Under overload that machinery held ~45% of the GIL in a py-spy sample and the
tiny model's steps (mostly Python) took 6 ms instead of 3. A child process steps with a GIL of its own, as
vLLM's EngineCore does. The parent keeps the streams, the admission check (from the child's last load report)
and the step listeners (metrics); the child owns the model, the scheduler and the KV cache.

Wire protocol: one socket pair wrapped in multiprocessing Connections, carrying the pickled records of
engine_messages.py (parent -> child: Start, then Add | Abort | Query | Stall; child -> parent: Ready | BuildError,
then Step | LoadReport | Reject | Reply).
The child steps the engine core only (CoreOutputs: token ids). The parent tokenizes prompts and turns token ids
into text (output_processor.py) while the child computes the next step: neither is on the step's critical path.
A stop string is found here, so the parent aborts that request in the child, which may have computed one more
token for it by then (dropped).

Faults: a message that fails on either side ends its own request(s) only. When the child dies, every stream and
every later generate gets EngineDeadError at once, and on_exit lets the owner (the replica) start a new engine. A
step that meets a GPU device-side fault ends the child the same way, after a DeviceFault message: `device_fault`
says so, and the owner has its replica replaced instead (engine_client.device_fault says why).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from conveyor.serving import engine_messages as msg
from conveyor.serving import grammar
from conveyor.serving.admission import REFUSAL_REASONS, QueueFullError
from conveyor.serving.config import EngineConfig
from conveyor.serving.engine_client import DeviceFaultError, EngineDeadError, EngineLoad, StreamingClient
from conveyor.serving.openmp_runtime import engine_child_env
from conveyor.serving.output_processor import OutputProcessor
from conveyor.serving.outputs import RequestOutput, merge_outputs
from conveyor.serving.request import SamplingParams

logger = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 600.0  # model conversion on first use can take minutes on a slow disk
QUERY_TIMEOUT_S = 30.0


def _load_tokenizer_in_background(model: str) -> Future:
    """The model's tokenizer, loaded on a daemon thread while the child builds the engine. Where the model still
    has to be fetched or converted, the file lock in serving/models/hub.py makes this thread and the child do it
    once. A failure stays in the Future: the child reports the same one, and that is what the replica raises."""
    result: Future = Future()

    def run() -> None:
        try:
            from conveyor.serving.models.loader import load_tokenizer, resolve_model_path

            result.set_result(load_tokenizer(resolve_model_path(model)))
        except BaseException as exc:  # noqa: BLE001 - re-raised only if the child built fine
            result.set_exception(exc)

    threading.Thread(target=run, name="conveyor-tokenizer-load", daemon=True).start()
    return result


class ProcessEngine(StreamingClient):
    def __init__(self, config: EngineConfig, torch_num_threads: int | None = None) -> None:
        super().__init__()  # _device_fault: set by the reader when the child reports a GPU device-side fault
        # A fresh interpreter on one end of a socket pair: fork would copy the parent's threads' locks mid-use,
        # and multiprocessing's spawn re-imports the parent's __main__ (a user script, Ray's worker).
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "conveyor.serving.engine_core_loop", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=engine_child_env(os.environ))
        theirs.close()  # only the child holds its end: it reads EOF when this process dies, and exits
        self._conn = Connection(ours.detach())
        self._conn.send(msg.Start(config, torch_num_threads))
        self._send_lock = threading.Lock()
        self._replies: dict[int, Future] = {}
        self._query_ids = itertools.count()
        # Adds sent and adds the child has applied (its running total): the difference counts as waiting.
        # Each counter has one writer (the event loop, the reader thread), so no lock is needed.
        self._num_adds_sent = 0
        self._num_adds_applied = 0
        self._load = msg.CoreLoad(0, 0, 0.0, 1, 0.0, 0)
        self._stopped: Exception | None = None  # set by the reader when the child is gone: no stream may wait then
        self._shutting_down = False
        # Called on the reader thread once the child has died (not at shutdown), after every stream has failed:
        # the replica restarts its engine from here.
        self.on_exit: Callable[[], None] | None = None
        # The parent tokenizes (chat templates, default max_tokens). Loading the tokenizer, transformers' import
        # included, takes 2-4 s on 2 cores: it runs while the child builds, not after it.
        tokenizer = _load_tokenizer_in_background(config.model.model)
        self.info = self._await_ready()
        logger.info("engine process %d runs on %s OpenMP", self._process.pid, self.info.get("openmp_runtime"))
        self.config = config
        self.tokenizer = tokenizer.result()
        self._processor = OutputProcessor(self.tokenizer)
        self._reader = threading.Thread(target=self._read, name="conveyor-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def from_config(cls, config: EngineConfig, torch_num_threads: int | None = None) -> ProcessEngine:
        return cls(config, torch_num_threads)

    def _await_ready(self) -> dict[str, Any]:
        if not self._conn.poll(BUILD_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"engine process did not start within {BUILD_TIMEOUT_S:.0f}s")
        try:
            reply = self._conn.recv()
        except EOFError:
            code = self._process.wait(timeout=10)
            raise RuntimeError(f"engine process died while starting (exit code {code})") from None
        if not isinstance(reply, msg.Ready):
            raise RuntimeError(f"engine process failed to start:\n{getattr(reply, 'text', reply)}")
        # The child's first load report follows at once: read it here, so the first requests are checked against
        # the real queue bound, not the placeholder's (which refused all but one of a burst at start).
        first = self._conn.recv()
        if isinstance(first, msg.LoadReport):
            self._set_load(first.load)
        return reply.info

    # ---- what the replica reads ----------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.info["max_model_len"]

    @property
    def max_tokens_ever(self) -> int:
        return self.info["max_tokens_ever"]

    def load(self) -> EngineLoad:
        load = self._load
        return EngineLoad(load.num_waiting, load.num_running, load.kv_cache_usage)

    def block_state(self) -> dict[str, int]:
        """The child's block accounting, asked now (not from the last report): for tests and soak checks."""
        return self._query("block_state")

    def request_state(self) -> dict[str, int]:
        """The size of every per-request map, the child's (asked now) and this side's: all 0 at rest."""
        return self._query("request_state") | {
            "client.streams": len(self._streams), "client.replies": len(self._replies),
            **{f"client.{name}": size for name, size in self._processor.sizes().items()}}

    def is_alive(self) -> bool:
        return self._stopped is None and self._process.poll() is None and self._reader.is_alive()

    # ---- requests ------------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       coalesce: bool = False) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate: ValueError or QueueFullError before the first output; closing early aborts."""
        self._check_queue_room()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt_token_ids = self.tokenize(prompt)
        # Here, not in the child, whose loop is the step's (the library drops the GIL while it checks a grammar);
        # not at all for a constraint the HTTP ingress has validated already.
        if params.structured is not None and not params.structured.validated:
            await asyncio.to_thread(grammar.validate, params.structured)
        stream = self._open_stream(request_id)
        if self._stopped is not None:  # after the reader failed every stream: nobody would ever post to this one
            self._streams.pop(request_id, None)
            raise self._stopped
        self._processor.add(request_id, prompt_token_ids, params)
        self._num_adds_sent += 1
        finished = False
        try:
            self._send(msg.Add(request_id, prompt_token_ids, params))
            async for item in stream.outputs(coalesce):
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            self._processor.remove(request_id)
            if not finished:
                self.abort(request_id)

    def stall_for_test(self, seconds: float) -> None:
        """Test hook (drills): the engine process stops stepping for `seconds`, as a wedged engine would."""
        self._send(msg.Stall(float(seconds)))

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(RuntimeError):  # no engine, nothing to abort
            self._send(msg.Abort(request_id))

    def shutdown(self) -> None:
        self._shutting_down = True
        # shutdown(), not just close(): our reader thread sits in recv() on this socket, and a close() does not
        # end that call, so the socket stayed open, the child never read EOF and the wait below ran out (10 s
        # for every replica that stopped).
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)  # the child reads EOF and exits; our reader's recv() returns
        with contextlib.suppress(OSError):
            self._conn.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _check_queue_room(self) -> None:
        """The child decides (and may still refuse); refusing here when it surely would saves it the work."""
        load = self._load
        num_unacked = self._num_adds_sent - self._num_adds_applied
        if load.num_waiting + num_unacked >= load.max_queued_requests:
            raise QueueFullError("waiting queue full")
        max_wait_s = self.config.scheduler.max_queue_wait_s
        if max_wait_s is not None and num_unacked == 0 and load.expected_wait_s > max_wait_s:
            wait_s = load.expected_wait_s
            raise QueueFullError(f"expected wait for a batch slot ({wait_s:.1f} s) exceeds max_queue_wait_s",
                                 retry_after_s=min(wait_s, 60.0))

    def _send(self, message: object) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, EOFError, ValueError) as exc:  # child gone: the reader fails the streams
                raise EngineDeadError("engine process is not running") from exc

    def _query(self, name: str) -> Any:
        if self._stopped is not None:
            raise self._stopped
        query_id = next(self._query_ids)
        future: Future = Future()
        self._replies[query_id] = future
        self._send(msg.Query(query_id, name))
        try:
            return future.result(QUERY_TIMEOUT_S)
        finally:
            self._replies.pop(query_id, None)

    # ---- reader thread ---------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, msg.DeviceFault):  # the child's last message: it exits now
                    self._device_fault = message.text
                    break
                try:
                    self._dispatch(message)
                except Exception:  # noqa: BLE001 - one bad message (a listener's bug) must not stop every stream
                    logger.exception("engine process reader failed on a %s message", type(message).__name__)
                    self._fail_requests_of(message)
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - an unreadable message: fail the streams below rather than hang them
            logger.exception("engine process reader failed")
        self._stopped = self._death()
        self._fail_all(self._stopped)
        if self.on_exit is not None and not self._shutting_down:
            try:
                self.on_exit()
            except Exception:  # noqa: BLE001 - the owner's hook; the streams are failed already
                logger.exception("engine exit hook failed")

    def _death(self) -> EngineDeadError:
        """What every stream gets now that the child is gone: after a device fault, once it has exited."""
        if self._device_fault is None:
            return EngineDeadError(f"engine process stopped (exit code {self._process.poll()})")
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # stuck in a driver call of the faulted context: it is of no use now
            self._process.kill()
        logger.error("engine process %d stopped on a GPU device-side fault: %s", self._process.pid, self._device_fault)
        return DeviceFaultError(f"engine process stopped on a GPU device-side fault: {self._device_fault}")

    def _dispatch(self, message: object) -> None:
        if (steps := _steps_in(message)) is not None:
            self._on_steps(steps)
        elif isinstance(message, msg.LoadReport):
            self._set_load(message.load)
        elif isinstance(message, msg.Reject):
            self._post(message.request_id, _rejection(message))
        elif isinstance(message, msg.Reply):
            future = self._replies.get(message.query_id)
            if future is not None:
                future.set_result(message.value)
        else:
            raise TypeError(f"unknown message from the engine process: {type(message).__name__}")

    def _on_steps(self, steps: list[msg.Step]) -> None:
        """Steps in order; their outputs reach the streams together, one record per request (one wake-up of each
        event loop)."""
        per_step = [self._on_step(step) for step in steps]
        if len(per_step) == 1:  # the common case (no batching): a request appears once in a step
            self._deliver(per_step[0], self.config.stream_interval)
            return
        by_request: dict[str, list[RequestOutput]] = {}
        for outputs in per_step:
            for output in outputs:
                by_request.setdefault(output.request_id, []).append(output)
        self._deliver([merge_outputs(outs) if len(outs) > 1 else outs[0] for outs in by_request.values()],
                      self.config.stream_interval)

    def _on_step(self, step: msg.Step) -> list[RequestOutput]:
        self._set_load(step.load)
        outputs, stopped = self._processor.process(step.outputs)
        for request_id in stopped:
            self.abort(request_id)
        # Listeners first: whoever sees a request finish can rely on its metrics being counted already.
        for listener in self._step_listeners:
            listener(step.stats, outputs)
        return outputs

    def _fail_requests_of(self, message: object) -> None:
        """After a failure handling `message`: the requests it carried end with an error; others go on."""
        exc = RuntimeError("engine client failed on this request's output")
        if (steps := _steps_in(message)) is not None:
            ids = {rid for step in steps for rid in step.outputs.request_ids}
        else:
            ids = {rid} if (rid := getattr(message, "request_id", None)) is not None else set()
        for request_id in ids:
            self._post(request_id, exc)
            self.abort(request_id)

    def _set_load(self, load: msg.CoreLoad) -> None:
        self._num_adds_applied = load.num_adds_applied
        self._load = load

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self._post(request_id, exc)
        for future in list(self._replies.values()):
            if not future.done():
                future.set_exception(exc)


def _rejection(reject: msg.Reject) -> Exception:
    if reject.kind in REFUSAL_REASONS:
        return QueueFullError(reject.message, reject.retry_after_s, reject.kind)
    return ValueError(reject.message) if reject.kind == "invalid_request" else RuntimeError(reject.message)


def _steps_in(message: object) -> list[msg.Step] | None:
    """The steps a message from the engine process carries (a Step, or a StepBatch of them); None for any other."""
    if isinstance(message, msg.Step):
        return [message]
    return message.steps if isinstance(message, msg.StepBatch) else None
