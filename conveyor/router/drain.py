"""Hand-back: a request still queued on an engine replica that leaves the routing set is sent elsewhere at once.

Serve takes a replica out of the running set the moment it decides to stop it (autoscaler scale-in, a redeploy,
a failed health check, `serve delete`), then waits for that replica's ongoing requests for at most
`graceful_shutdown_timeout_s` (our `drain_timeout_s`) before killing it. To Serve a request waiting in the
engine's queue is as ongoing as one that streams, so without this it would hold the drain open and then be lost
with the replica. The request router (conveyor/router/routing.py) sees both events in this process: which replica a
request was routed to, and which replicas left. `start_stream` (router/streams.py) watches for the second while it
waits for a request's first record; when it fires, it cancels the request there (the engine aborts it) and sends it
again. A request whose first record has arrived is streaming and stays where it is: the drain lets it finish.

The router may run on Serve's own event loop thread, the requests on the ingress's: events cross by
`call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# The record of a request whose replica's engine process died before anything of it reached the client (the
# first record, or any record of a request that is not streamed): the ingress sends it elsewhere, as it does a
# request whose replica drains (router/streams.py).
HAND_BACK = "hand_back"
ROUTE_KEY = "route_key"  # set on the request record per attempt by start_stream, read back by the router
MAX_REMEMBERED_LEFT = 64  # a request routed just before its replica left must still learn it left


@dataclass
class _Watched:
    loop: asyncio.AbstractEventLoop
    left: asyncio.Event = field(default_factory=asyncio.Event)
    replica: Any = None


class ReplicaDeparture:
    """Which replica each watched request went to; wakes a request whose replica leaves the routing set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[str, _Watched] = {}
        self._left: deque[Any] = deque(maxlen=MAX_REMEMBERED_LEFT)

    @contextmanager
    def watch(self, request_id: str) -> Iterator[asyncio.Event]:
        """An event set when the replica this request is routed to leaves; watched until the block exits."""
        watched = _Watched(asyncio.get_running_loop())
        with self._lock:
            self._watched[request_id] = watched
        try:
            yield watched.left
        finally:
            with self._lock:
                if self._watched.get(request_id) is watched:
                    del self._watched[request_id]

    def on_routed(self, request_id: str | None, replica: Any) -> None:
        with self._lock:
            watched = self._watched.get(request_id) if request_id else None
            if watched is None:
                return
            watched.replica = replica
            gone = replica in self._left
        if gone:
            _wake(watched)

    def on_left(self, replicas: Iterable[Any]) -> None:
        left = set(replicas)
        if not left:
            return
        with self._lock:
            self._left.extend(left)
            woken = [w for w in self._watched.values() if w.replica in left]
        for watched in woken:
            _wake(watched)

    def on_joined(self, replicas: Iterable[Any]) -> None:
        """A replica id back in the running set (Serve recovered it) no longer counts as gone."""
        back = set(replicas)
        with self._lock:
            kept = [r for r in self._left if r not in back]
            self._left.clear()
            self._left.extend(kept)


def _wake(watched: _Watched) -> None:
    try:
        watched.loop.call_soon_threadsafe(watched.left.set)
    except RuntimeError:  # that request's loop is closed: nobody is waiting any more
        pass


# One per process: the router instances (one per handle) and the ingress's requests meet here.
DEPARTURES = ReplicaDeparture()
