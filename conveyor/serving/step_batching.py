"""Engine-process side of stream batching (EngineConfig.stream_batching_interval_ms, Ray Serve LLM's
`stream_batching_interval_ms`): a decode step's outputs may wait in the engine process for later steps' and leave
with them in one message.

Every message the engine process sends wakes the replica's reader thread, its event loop, the ingress, and the
client, each of which takes a core from the engine's OpenMP team for a moment in the middle of its next step. At
2 req/s on 2 cores a served decode step of 2-8 rows took 16.6 ms against 11.4 ms in process (RESULTS.md): the
wake-ups cost more than the tokens. With a batching interval, outputs leave at most that often while only decodes
run. Whatever a latency target counts leaves at once: a request's first token (TTFT), its last (end of stream),
and everything before any other message (a refusal, a reply), so the replica sees the engine's messages in order.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.serving import engine_messages as msg


@dataclass
class StepBatcher:
    interval_s: float  # 0: every step leaves at once
    clock: Callable[[], float] = time.monotonic
    _held: list[msg.Step] = field(default_factory=list)
    _held_since: float = 0.0

    @property
    def num_held(self) -> int:
        return len(self._held)

    def add(self, step: msg.Step) -> msg.Step | msg.StepBatch | None:
        """Hold a step; the message to send now (this step and those held before it), or None to wait."""
        if not self._held:
            self._held_since = self.clock()
        self._held.append(step)
        outputs = step.outputs
        if (self.interval_s <= 0 or outputs.times or outputs.finish_reasons
                or self.clock() - self._held_since >= self.interval_s):
            return self.take()
        return None

    def due_within(self, next_step_s: float) -> bool:
        """Whether held outputs would wait past the interval if the next step (about next_step_s) ran first."""
        return bool(self._held) and self.clock() - self._held_since + next_step_s >= self.interval_s

    def take(self) -> msg.Step | msg.StepBatch | None:
        """Everything held, as one message (a lone step as itself); None when nothing is held."""
        held, self._held = self._held, []
        if not held:
            return None
        return held[0] if len(held) == 1 else msg.StepBatch(held)
