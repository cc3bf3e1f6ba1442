"""Replica side of stream multiplexing: the records of all of one ingress's streams leave in one message.

Without it every streamed token is one message on its request's own Serve stream, replica to ingress: at
saturation 64 streams cost 64 gRPC messages (and their pickling, wake-ups and Serve bookkeeping in both
processes) per engine step. With it, each ingress keeps one long-lived `subscribe` call open to each replica it
uses (conveyor/router/demux.py), and the replica sends on it, per step, every record that waits for that ingress: one
message for all of them. A request's own stream still carries its first record (so admission, errors and
hand-back work as before), stays open while the request runs (closing it aborts the request), and takes over
again if the subscription goes away while the request runs. Records carry a sequence number per request, so
the ingress restores their order whichever way each came.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from conveyor.serving.outputs import RequestOutput, merge_outputs

MUX_KEY = "mux"  # the first record says whether the rest comes on the ingress's subscription
SEQ_KEY = "seq"  # a record's position in its request's stream (the first record, which carries none, is 0)
SUBSCRIBER_KEY = "subscriber"  # the request names the ingress whose subscription may carry it


@dataclass
class _Attached:
    key: str  # the attempt's route key: the ingress tells a retried request's attempts apart by it
    next_seq: int = 1
    final_taken: asyncio.Event = field(default_factory=asyncio.Event)


class StreamMux:
    """The records waiting for one ingress's subscription. Lives on the replica's event loop."""

    def __init__(self) -> None:
        self._pending: dict[str, list[RequestOutput]] = {}
        self._attached: dict[str, _Attached] = {}
        self._wake = asyncio.Event()
        self.closed = False

    @property
    def num_attached(self) -> int:
        return len(self._attached)

    def attach(self, request_id: str, key: str) -> None:
        self._attached[request_id] = _Attached(key)

    def put(self, output: RequestOutput) -> None:
        self._pending.setdefault(output.request_id, []).append(output)
        self._wake.set()

    async def wait_final_taken(self, request_id: str) -> None:
        """Until the request's finished output has left in a batch, or the mux closed."""
        await self._attached[request_id].final_taken.wait()

    def detach(self, request_id: str) -> tuple[list[RequestOutput], int]:
        """Forget the request; what it still had waiting, and the sequence number its next record gets."""
        attached = self._attached.pop(request_id, None)
        leftover = self._pending.pop(request_id, [])
        return leftover, attached.next_seq if attached is not None else 1

    async def take(self, timeout_s: float) -> list[tuple[str, int, RequestOutput]] | None:
        """Everything waiting, one merged output per request with its route key and sequence number; None after
        timeout_s with nothing waiting."""
        while not self._pending:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout_s)
            except asyncio.TimeoutError:
                return None
        batch, self._pending = self._pending, {}
        taken = []
        for request_id, outputs in batch.items():
            attached = self._attached.get(request_id)
            if attached is None:
                continue  # detached (its client left) after these were put
            output = merge_outputs(outputs) if len(outputs) > 1 else outputs[0]
            taken.append((attached.key, attached.next_seq, output))
            attached.next_seq += 1
            if output.finished:
                attached.final_taken.set()
        return taken

    def close(self) -> None:
        """The subscription went away: attached requests take their records back onto their own streams."""
        self.closed = True
        for attached in self._attached.values():
            attached.final_taken.set()


class MuxHub:
    """The replica's muxes, one per subscribed ingress."""

    def __init__(self) -> None:
        self._muxes: dict[str, StreamMux] = {}

    @property
    def num_open(self) -> int:
        return len(self._muxes)

    @property
    def num_attached(self) -> int:
        return sum(m.num_attached for m in self._muxes.values())

    def open(self, subscriber: str) -> StreamMux:
        """The caller has checked that `subscriber` has none open (EngineReplica.subscribe turns a second away)."""
        mux = self._muxes[subscriber] = StreamMux()
        return mux

    def get(self, subscriber: str | None) -> StreamMux | None:
        mux = self._muxes.get(subscriber) if subscriber else None
        return mux if mux is not None and not mux.closed else None

    def close(self, subscriber: str, mux: StreamMux) -> None:
        mux.close()
        if self._muxes.get(subscriber) is mux:
            del self._muxes[subscriber]
