"""Ingress side of stream multiplexing (conveyor/router/mux.py): one subscription per engine replica, its batches handed
to the streams they belong to.

A stream is registered under its attempt's route key before its request is sent, so a batch that overtakes the
request's own first record still finds it. A subscription opens when a first record shows a replica this
ingress has none to; until then (and if it cannot open) that replica's streams use their own Serve streams.

A subscription is routed like a request, not pinned: Serve's FIFO routing hands the replica found for one call
to whichever call waits first, so a pinned call could land elsewhere and hold up the requests behind it. With
one replica it lands there; with several it lands by load, a replica that has one already turns it away, and
the next first record from an uncovered replica tries again. Which replica carries a record does not matter for
correctness: records are matched to streams by route key.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any

from ray.serve.handle import DeploymentHandle

from conveyor.router.mux import SUBSCRIBER_KEY

logger = logging.getLogger("ray.serve")

OPEN_TIMEOUT_S = 5.0  # a subscription no replica takes for this long is given up (and tried again later)
RETRY_AFTER_S = 1.0  # after a subscription failed or was turned away, before the next try

# Put into the queue of each stream a subscription carried when it ends: after it, nothing more comes that way.
SUBSCRIPTION_ENDED = object()


class Demux:
    def __init__(self, handle: DeploymentHandle, subscriber: str) -> None:
        self._handle = handle
        self.subscriber = subscriber
        self._queues: dict[str, asyncio.Queue] = {}
        self._replicas: dict[str, str] = {}  # a muxed stream's key -> the replica whose subscription carries it
        self._subscriptions: dict[str, asyncio.Task] = {}  # by the replica each one landed on
        self._opening: asyncio.Task | None = None
        self._last_failure = -RETRY_AFTER_S

    def register(self, key: str) -> asyncio.Queue:
        """The queue that batches put this stream's (seq, record) pairs into."""
        self._queues[key] = queue = asyncio.Queue()
        return queue

    def bind(self, key: str, replica: str) -> None:
        """The stream's records come on `replica`'s subscription (its first record said so)."""
        self._replicas[key] = replica

    def unregister(self, key: str) -> None:
        self._queues.pop(key, None)
        self._replicas.pop(key, None)

    def ensure_subscribed(self, replica: str | None) -> None:
        """Open a subscription unless `replica` has one, one is opening, or one failed a moment ago."""
        if not replica or replica in self._subscriptions or self._opening is not None:
            return
        if time.monotonic() - self._last_failure < RETRY_AFTER_S:
            return
        # An empty context, not the request's that asked: Serve cancels the calls a request made when its client
        # leaves, and the subscription serves every stream of this ingress (a batch in flight was lost with it).
        self._opening = asyncio.get_running_loop().create_task(self._pump(), context=contextvars.Context())

    async def _pump(self) -> None:
        request: dict[str, Any] = {SUBSCRIBER_KEY: self.subscriber}
        gen = self._handle.options(stream=True).subscribe.remote(request)
        replica = None
        try:
            first = await self._first_answer(gen)
            replica = first.get("subscribed")
            if replica is None:  # it landed on a replica that has one already
                self._last_failure = time.monotonic()
                return
            self._subscriptions[replica] = asyncio.current_task()
            async for item in gen:
                queues = self._queues
                for key, seq, record in item["batch"]:
                    queue = queues.get(key)
                    if queue is not None:  # else its client left: nothing waits for it
                        queue.put_nowait((seq, record))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - gone, stopping, or never answered: the streams fall back
            logger.info("subscription to replica %s ended: %r", replica, exc)
            self._last_failure = time.monotonic()
        finally:
            gen.cancel()
            if replica is not None and self._subscriptions.get(replica) is asyncio.current_task():
                del self._subscriptions[replica]
                self._tell_streams_ended(replica)

    async def _first_answer(self, gen: Any) -> dict[str, Any]:
        """The replica's first answer. Only the wait for a replica to take the call is bounded (OPEN_TIMEOUT_S:
        all replicas full): once at a replica, the call is never given up for being slow, since the replica may
        have sent a batch on it already and cancelling lost those records. A replica that dies ends it with an
        error. The assignment future is a private hook of Serve's handle (streams._wait_assigned uses it too);
        without it the whole wait is bounded, as before."""
        fetch = getattr(gen, "_fetch_future_result_async", None)
        try:
            if fetch is None:
                return await asyncio.wait_for(gen.__anext__(), OPEN_TIMEOUT_S)
            await asyncio.wait_for(fetch(), OPEN_TIMEOUT_S)
        finally:
            if self._opening is asyncio.current_task():
                self._opening = None  # another replica's subscription may open while this one is answered
        return await gen.__anext__()

    def _tell_streams_ended(self, replica: str) -> None:
        """A stream whose own Serve stream has ended too can stop waiting for records now (they were lost with a
        replica that died), rather than after MUXED_TAIL_TIMEOUT_S. One whose own stream runs reads on: the
        replica sends what its subscription did not take on that stream."""
        for key, bound in self._replicas.items():
            queue = self._queues.get(key)
            if bound == replica and queue is not None:
                queue.put_nowait(SUBSCRIPTION_ENDED)

