"""The records that cross the pipe between ProcessEngine (the replica's side) and its engine process
(engine_core_loop.py). One dataclass per message kind instead of string-tagged tuples: a reader matches on the
type, a field has a name, and a message the other side does not know fails loudly instead of unpacking wrongly.
Pickled by multiprocessing's Connection; slots keep each record as small on the wire as the tuple it replaced."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.serving.config import EngineConfig
from conveyor.serving.output_processor import CoreOutputs
from conveyor.serving.outputs import EngineStepStats
from conveyor.serving.request import SamplingParams


# ---- replica -> engine process ------------------------------------------------------------------------
@dataclass(slots=True)
class Start:
    config: EngineConfig
    torch_num_threads: int | None


@dataclass(slots=True)
class Add:
    """A request, tokenized and checked by the replica; the engine process makes its Request from these."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Set by the engine process's inbox thread once it has held the request against the TTFT target: final.
    ttft_admitted: bool = False


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Query:
    query_id: int
    name: str


@dataclass(slots=True)
class Stall:
    """A test hook (drills): the engine stops stepping for this long, as a wedged engine would."""

    seconds: float


# ---- engine process -> replica ------------------------------------------------------------------------
@dataclass(slots=True)
class CoreLoad:
    """The engine's queue state after the messages and step it just handled: admission and routing read it."""

    num_waiting: int
    num_running: int
    kv_cache_usage: float
    max_queued_requests: int
    expected_wait_s: float
    num_adds_applied: int  # running total of Add messages applied: the replica counts the rest as waiting


@dataclass(slots=True)
class Ready:
    info: dict[str, Any]


@dataclass(slots=True)
class BuildError:
    text: str


@dataclass(slots=True)
class Step:
    outputs: CoreOutputs
    stats: EngineStepStats
    load: CoreLoad


@dataclass(slots=True)
class StepBatch:
    """Consecutive steps in one message (step_batching.py): the replica handles them in order, then posts their
    outputs to the streams in one wake-up."""

    steps: list[Step]


@dataclass(slots=True)
class LoadReport:
    load: CoreLoad


@dataclass(slots=True)
class Reject:
    """The request ends without (more) output: refused (kind one of REFUSAL_REASONS), invalid ("invalid_request"),
    or failed in the engine ("engine_error")."""

    request_id: str
    kind: str
    message: str
    retry_after_s: float = 0.0


@dataclass(slots=True)
class Reply:
    query_id: int
    value: Any


@dataclass(slots=True)
class DeviceFault:
    """The last message of an engine process whose step met a GPU device-side fault (engine_client.device_fault):
    it exits right after, and its live requests end as when it dies."""

    text: str
