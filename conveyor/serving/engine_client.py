"""The contract between the replica and an engine, whichever side of a process boundary the engine steps on:
AsyncEngine (a thread of this process: LLM in process, tests) and ProcessEngine (a child process: the replica's
default) both implement EngineClient, and both hand outputs to their consumers through RequestStream."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from conveyor.serving.detokenizer import PromptSide
from conveyor.serving.outputs import EngineStepStats, RequestOutput, merge_outputs
from conveyor.serving.request import SamplingParams

StepListener = Callable[[EngineStepStats, list[RequestOutput]], None]


@dataclass
class RequestStream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    held_error: BaseException | None = None  # met while coalescing: raised after what came before it
    # stream_interval's outputs not yet posted, and whether the first one left (only the posting thread reads them)
    unposted: list[RequestOutput] = field(default_factory=list)
    first_posted: bool = False

    def through_interval(self, output: RequestOutput, interval: int) -> RequestOutput | None:
        """vLLM's stream_interval: what to post of this output, or None to hold it. Outputs leave once `interval`
        tokens have gathered, merged into one; the first (time to first token) and the finished one at once."""
        if interval == 1:
            return output
        self.unposted.append(output)
        if (self.first_posted and not output.finished
                and sum(len(o.delta_token_ids) for o in self.unposted) < interval):
            return None
        held, self.unposted, self.first_posted = self.unposted, [], True
        return merge_outputs(held) if len(held) > 1 else held[0]

    def post(self, item: RequestOutput | BaseException) -> None:
        """Hand an output (or the request's failure) to the stream's event loop; callable from any thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def outputs(self, coalesce: bool = False) -> AsyncIterator[RequestOutput]:
        """What the engine posts for one request, up to its finished output; a posted exception is raised.

        coalesce: outputs already waiting when the consumer asks are merged into one (never waiting for
        more), so a consumer that fell behind catches up in one record instead of one per token.
        """
        while True:
            if self.held_error is not None:
                raise self.held_error
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if coalesce:
                item = self._take_waiting(item)
            yield item
            if item.finished:
                return

    def _take_waiting(self, item: RequestOutput) -> RequestOutput:
        waiting: list[RequestOutput] = []
        while not item.finished and not (waiting and waiting[-1].finished) and not self.queue.empty():
            later = self.queue.get_nowait()
            if isinstance(later, BaseException):
                self.held_error = later
                break
            waiting.append(later)
        return merge_outputs([item, *waiting]) if waiting else item


def post_all(pairs: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """Hand one step's outputs to their streams with one wake-up per event loop, not one per output."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
    for stream, item in pairs:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot for routing and autoscaling; read without locks, so it may be one step stale."""

    num_waiting: int
    num_running: int
    kv_cache_usage: float


class EngineDeadError(RuntimeError):
    """The engine process is gone (killed, out of memory): raised into every live stream and every later
    generate. A request that has had no output yet can be served again elsewhere (router/replica.py hands it back)."""


# What torch, cuBLAS and our kernels say when a kernel faults on the GPU. Such a fault is sticky: the process's CUDA
# context is poisoned, every later launch fails or computes garbage, so the engine must not step on in it. Running
# out of memory is not one of them: the context survives it (an allocation failed, nothing ran), so it stays an
# ordinary step error.
DEVICE_FAULT_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS", "cudaError",
                        "CUDNN_STATUS", "unspecified launch failure", "misaligned address", "illegal instruction")
NOT_DEVICE_FAULTS = ("out of memory", "ALLOC_FAILED")


def device_fault(exc: BaseException | None) -> str | None:
    """The message of a GPU device-side fault in exc (or an exception it was raised from), or None for any other
    error. Classified by message: torch raises these as RuntimeError (AcceleratorError in newer versions)."""
    for _ in range(8):  # a chain of causes is short; the bound keeps a cyclic one from looping
        if exc is None:
            return None
        text = str(exc)
        if (isinstance(exc, RuntimeError) and any(m in text for m in DEVICE_FAULT_MARKERS)
                and not any(m in text for m in NOT_DEVICE_FAULTS)):
            return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        exc = exc.__cause__ or exc.__context__
    return None


class DeviceFaultError(EngineDeadError):
    """The engine met a GPU device-side fault (device_fault): it steps no more, and its replica must be replaced
    (a new process gets a new CUDA context). Raised into every live stream, as when the engine process dies."""


class StreamingClient(PromptSide):
    """What AsyncEngine and ProcessEngine share: the prompt side, a RequestStream per request in flight, the step
    listeners, and the device fault that stopped the engine."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._step_listeners: list[StepListener] = []
        self._device_fault: str | None = None

    def add_step_listener(self, fn: StepListener) -> None:
        """fn runs after every step, on the thread that takes the engine's outputs: keep it cheap (metrics, not
        I/O)."""
        self._step_listeners.append(fn)

    def has_work(self) -> bool:
        """Requests in flight (streams not yet finished), as this process sees them: an engine process's own
        reports stop when it is wedged."""
        return bool(self._streams)

    @property
    def device_fault(self) -> str | None:
        return self._device_fault

    def _open_stream(self, request_id: str) -> RequestStream:
        stream = self._streams[request_id] = RequestStream(asyncio.get_running_loop(), asyncio.Queue())
        return stream

    def _post(self, request_id: str, item: RequestOutput | BaseException) -> None:
        if (stream := self._streams.get(request_id)) is not None:
            stream.post(item)

    def _deliver(self, outputs: list[RequestOutput], interval: int) -> None:
        """One step's outputs to their streams, through stream_interval; none to a stream that is gone (its consumer
        left: the abort is on its way)."""
        post_all([(stream, item) for out in outputs if (stream := self._streams.get(out.request_id)) is not None
                  and (item := stream.through_interval(out, interval)) is not None])


class EngineClient(Protocol):
    """What the replica (router/replica.py) may call on its engine."""

    tokenizer: Any

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_tokens_ever(self) -> int: ...

    def tokenize(self, prompt: str | list[int]) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...

    def load(self) -> EngineLoad: ...

    def block_state(self) -> dict[str, int]: ...

    def add_step_listener(self, fn: StepListener) -> None: ...

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 coalesce: bool = False) -> AsyncIterator[RequestOutput]:
        """A request's outputs; ValueError (bad input) or QueueFullError (refused) before the first one; closing the
        iterator early aborts the request; an engine that fails or dies raises RuntimeError into the stream."""
        ...

    def has_work(self) -> bool: ...

    def is_alive(self) -> bool:
        """False once the engine can serve no more: its process or thread is gone, or it met a device fault."""
        ...

    @property
    def device_fault(self) -> str | None:
        """The GPU device-side fault that stopped the engine (its first line), or None: then the replica must be
        replaced rather than its engine restarted in the same place."""
        ...

    def abort(self, request_id: str) -> None: ...

    def shutdown(self) -> None: ...
