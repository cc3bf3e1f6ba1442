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

The reader thread that takes the child's messages is engine_reader.py's EngineReader, which this class inherits.

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
from conveyor.serving.admission import QueueFullError
from conveyor.serving.config import EngineConfig
from conveyor.serving.engine_client import EngineDeadError, EngineLoad, StreamingClient
from conveyor.serving.engine_reader import EngineReader
from conveyor.serving.openmp_runtime import engine_child_env
from conveyor.serving.output_processor import OutputProcessor
from conveyor.serving.outputs import RequestOutput
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


class ProcessEngine(EngineReader, StreamingClient):
    def __init__(self, config: EngineConfig, torch_num_threads: int | None = None) -> None:
        super().__init__()  # _device_fault: set by the reader when the child reports a GPU device-side fault
        # A fresh interpreter on one end of a socket pair: fork would copy the parent's threads' locks mid-use,
        # and multiprocessing's spawn re-imports the parent's __main__ (a user script, Ray's worker).
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "conveyor.serving.engine_core_loop", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=engine_child_env(os.environ, torch_num_threads))
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
