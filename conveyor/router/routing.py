"""Ray Serve request router for the engine deployment: load-aware with prefix affinity.

Configured on the engine deployment with
`RequestRouterConfig(request_router_class="conveyor.router.routing:LoadAwarePrefixRouter",
request_routing_stats_period_s=0.5, request_router_kwargs={...RoutingPolicy fields...})`.
It runs in every process that holds a handle to the engine (the ingress replicas). The policy itself lives in
`conveyor/router/prefix_index.py`; this class only translates Serve's objects and lifecycle hooks into it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

# Reached through its module: Serve pickles this module by value, and drain's registry holds a lock.
from conveyor.router import drain
from conveyor.router.prefix_index import LoadTracker, PrefixIndex, RoutingPolicy, rank_replicas

# Key the ingress puts in the request dict: the first 2048 characters of the rendered prompt.
ROUTING_PREFIX_KEY = "routing_prefix"


def _request_field(pending_request: PendingRequest | None, key: str) -> str | None:
    """A string field of the ingress's request record (conveyor/router/handle_records.make_request), or None
    (health probes and other callers do not send one)."""
    if pending_request is None:
        return None
    value = pending_request.kwargs.get(key) if pending_request.kwargs else None
    if value is None and pending_request.args:
        first = pending_request.args[0]
        value = first.get(key) if isinstance(first, Mapping) else getattr(first, key, None)
    return value if isinstance(value, str) and value else None


def routing_prefix(pending_request: PendingRequest | None) -> str | None:
    """The request's prompt prefix, or None."""
    return _request_field(pending_request, ROUTING_PREFIX_KEY)


class LoadAwarePrefixRouter(FIFOMixin, RequestRouter):
    """Sends a request to the replica that last served its prompt prefix unless that replica is overloaded
    relative to the least-loaded one; otherwise to the least-loaded replica by queue depth, running sequences,
    KV usage and this router's own unreported sends. Returns one replica per rank so Serve falls back in order
    when a replica is at `max_ongoing_requests`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Serve calls initialize_state(**request_router_kwargs) right after construction; defaults until then.
        self.initialize_state()

    def initialize_state(self, **kwargs: Any) -> None:
        self._policy = RoutingPolicy.from_kwargs(**kwargs)
        self._index = PrefixIndex(self._policy.chunk_chars, self._policy.max_index_entries)
        self._tracker = LoadTracker()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Without this Serve retries in a tight loop when every replica is at max_ongoing_requests.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranked = rank_replicas(
            list(by_id),
            {rid: r.routing_stats for rid, r in by_id.items()},
            routing_prefix(pending_request),
            self._index,
            self._tracker,
            self._policy,
        )
        return [[by_id[rid]] for rid in ranked]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._tracker.on_sent(replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._tracker.on_completed(replica_id)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        # The replica that accepted the request is the one that will hold its KV blocks: make it the owner
        # even if a fallback rank (not our first choice) took it.
        super().on_request_routed(pending_request, replica_id, result)
        if pending_request.metadata.call_method == "subscribe":
            self._tracker.on_completed(replica_id)  # a subscription (conveyor/router/mux.py) is no load: undo its send
            self._tracker.forget_send(replica_id)
            return
        prefix = routing_prefix(pending_request)
        if prefix:
            self._index.insert(prefix, replica_id)
        drain.DEPARTURES.on_routed(_request_field(pending_request, drain.ROUTE_KEY), replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        old_ids = set(self._replica_id_set)
        super().update_replicas(replicas)
        gone = old_ids - self._replica_id_set
        for replica_id in gone:
            self._index.remove_owner(replica_id)
        self._tracker.forget(self._replica_id_set)
        # A replica leaves the set when Serve starts stopping it: what still waits in its queue goes elsewhere.
        drain.DEPARTURES.on_joined(self._replica_id_set - old_ids)
        drain.DEPARTURES.on_left(gone)
