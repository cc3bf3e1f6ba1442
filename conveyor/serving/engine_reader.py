"""The parent side's reader thread of ProcessEngine (engine_process.py), as a class it inherits: every message
from the engine process, in order (steps to the streams and step listeners, load reports, refusals, query replies),
and the end of the child (every stream and pending query fails at once, then the owner's on_exit hook).

It reads what ProcessEngine sets up: _conn, _process, _processor, _replies, _streams, _step_listeners, config,
on_exit, _shutting_down, and the StreamingClient methods _post and _deliver."""
from __future__ import annotations

import logging
import subprocess

from conveyor.serving import engine_messages as msg
from conveyor.serving.admission import REFUSAL_REASONS, QueueFullError
from conveyor.serving.engine_client import DeviceFaultError, EngineDeadError
from conveyor.serving.outputs import RequestOutput, merge_outputs

logger = logging.getLogger(__name__)


class EngineReader:
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
