"""Pure routing logic for the engine deployment: load scores, prefix affinity, ranking.

Nothing here imports Ray, so the policy is unit-testable in milliseconds; `conveyor/router/routing.py` is the thin
Ray Serve adapter that feeds it replica stats and request prefixes.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A replica that has its waiting queue full is ranked after every replica that still has room, but keeps its
# relative order so that Serve can still fall back to the least-bad full replica.
SATURATED_PENALTY = 1_000.0


@dataclass(frozen=True)
class RoutingPolicy:
    """Knobs of the policy; every field can be overridden through `request_router_kwargs`."""

    chunk_chars: int = 64  # granularity of the prefix index
    min_match_chars: int = 256  # shorter shared prefixes are not worth giving up load balance for
    max_index_entries: int = 65_536  # LRU bound on chunk hashes (~32 per 2048-char prompt)
    # The owner keeps the request while score(owner) - min score <= this (0.5 = half a batch of extra queue).
    imbalance_threshold: float = 0.5
    wait_weight: float = 1.0  # queued work delays time-to-first-token directly
    run_weight: float = 0.5  # running sequences share the decode step, they slow it but do not block it
    kv_weight: float = 0.5  # a full KV cache forces preemption or queueing
    jitter: float = 0.01  # random tie-break; small so it only separates (near-)equal replicas
    default_max_num_seqs: int = 64  # used until a replica has published stats

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> RoutingPolicy:
        known = {k: v for k, v in kwargs.items() if k in cls.__dataclass_fields__}
        unknown = set(kwargs) - set(known)
        if unknown:
            raise ValueError(f"unknown routing policy options: {sorted(unknown)}")
        return cls(**known)


def score_replica(stats: Mapping[str, Any] | None, in_flight: int, policy: RoutingPolicy) -> float:
    """Load score of one replica: lower is better, ~1.0 means one full batch worth of work.

    `in_flight`: requests this router sent that the (stale) stats do not show yet; they count as waiting.
    """
    stats = stats or {}
    max_seqs = max(1, int(stats.get("max_num_seqs") or policy.default_max_num_seqs))
    waiting = int(stats.get("num_waiting", 0)) + max(0, in_flight)
    running = int(stats.get("num_running", 0))
    kv = float(stats.get("kv_cache_usage", 0.0))
    score = (policy.wait_weight * waiting + policy.run_weight * running) / max_seqs + policy.kv_weight * kv
    max_waiting = stats.get("max_waiting_requests")
    if max_waiting and waiting >= int(max_waiting):
        score += SATURATED_PENALTY
    return score


def choose(
    candidates: Sequence[Hashable],
    scores: Mapping[Hashable, float],
    owner: Hashable | None,
    policy: RoutingPolicy,
    rng: random.Random | None = None,
) -> list[Hashable]:
    """Rank `candidates` best first: the prefix owner if it is not overloaded, then by load score."""
    rng = rng or random
    ranked = sorted(candidates, key=lambda r: scores[r] + policy.jitter * rng.random())
    if owner is None or owner not in scores or not ranked:
        return ranked
    if scores[owner] - min(scores[r] for r in candidates) <= policy.imbalance_threshold:
        ranked.remove(owner)
        ranked.insert(0, owner)
    return ranked


class PrefixIndex:
    """Router-local map from prompt prefixes to the replica that last served them.

    Prefixes are cut into fixed-size character chunks; chunk i is keyed by a hash chained over chunks 0..i, so
    one dict lookup per chunk finds the longest indexed prefix without storing any text. The dict is an LRU
    bounded at `max_entries`: replicas' own prefix caches evict old blocks too, so old entries are worthless.
    """

    def __init__(self, chunk_chars: int = 64, max_entries: int = 65_536) -> None:
        if chunk_chars <= 0 or max_entries <= 0:
            raise ValueError("chunk_chars and max_entries must be positive")
        self.chunk_chars = chunk_chars
        self.max_entries = max_entries
        self._owners: OrderedDict[int, Hashable] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def _chain(self, text: str) -> Iterable[int]:
        # Only whole chunks: a partial tail would make "abc" and "abcd" different keys for no benefit.
        h = 0
        for start in range(0, len(text) - self.chunk_chars + 1, self.chunk_chars):
            h = hash((h, text[start:start + self.chunk_chars]))
            yield h

    def match(self, text: str) -> tuple[Hashable | None, int]:
        """(owner of the longest indexed prefix of `text`, its length in characters); (None, 0) if none."""
        owner: Hashable | None = None
        matched = 0
        for i, h in enumerate(self._chain(text)):
            found = self._owners.get(h)
            if found is None:
                break  # chained keys: no longer prefix can be present either (modulo LRU holes)
            owner, matched = found, (i + 1) * self.chunk_chars
            self._owners.move_to_end(h)
        return owner, matched

    def insert(self, text: str, owner: Hashable) -> None:
        """Record that `owner` now holds every whole-chunk prefix of `text` (the newest server wins)."""
        for h in self._chain(text):
            self._owners[h] = owner
            self._owners.move_to_end(h)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def remove_owner(self, owner: Hashable) -> None:
        """Forget a replica that left (O(entries); replica set changes are rare)."""
        for h in [h for h, o in self._owners.items() if o == owner]:
            del self._owners[h]


class LoadTracker:
    """Compensates stale replica stats with what this router sent since it last saw them change.

    Stats arrive every `request_routing_stats_period_s` through the controller; requests sent in between are
    invisible to them. Per replica we count sends since the stats last changed, capped by the requests still
    in flight (a request that already finished cannot be hiding in the queue).
    """

    def __init__(self) -> None:
        self._last_stats: dict[Hashable, Mapping[str, Any]] = {}
        self._sent_since_stats: dict[Hashable, int] = {}
        self._in_flight: dict[Hashable, int] = {}

    def observe_stats(self, replica: Hashable, stats: Mapping[str, Any] | None) -> None:
        """New stats account for as many of our sends as requests they show beyond the last ones. A change alone
        does not: a busy replica's stats change every period (its KV usage moves) before they count what was
        just sent, and forgetting those sends piled a burst onto it (7 of 8 streams in a drill)."""
        stats = stats or {}
        last = self._last_stats.get(replica)
        if last != stats:
            appeared = max(0, _num_requests(stats) - _num_requests(last or {}))
            self._sent_since_stats[replica] = max(0, self._sent_since_stats.get(replica, 0) - appeared)
            self._last_stats[replica] = dict(stats)

    def on_sent(self, replica: Hashable) -> None:
        self._sent_since_stats[replica] = self._sent_since_stats.get(replica, 0) + 1
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1

    def forget_send(self, replica: Hashable) -> None:
        """A send that carried no engine work (a subscription): not hiding in any queue."""
        self._sent_since_stats[replica] = max(0, self._sent_since_stats.get(replica, 0) - 1)

    def on_completed(self, replica: Hashable) -> None:
        # Clamp: a completion can be reported for a send this tracker never saw (e.g. after a replica update).
        self._in_flight[replica] = max(0, self._in_flight.get(replica, 0) - 1)

    def unseen(self, replica: Hashable) -> int:
        """Requests the replica's current stats most likely do not include yet."""
        return min(self._sent_since_stats.get(replica, 0), self._in_flight.get(replica, 0))

    def in_flight(self, replica: Hashable) -> int:
        return self._in_flight.get(replica, 0)

    def forget(self, keep: Iterable[Hashable]) -> None:
        keep = set(keep)
        for table in (self._last_stats, self._sent_since_stats, self._in_flight):
            for replica in [r for r in table if r not in keep]:
                del table[replica]


def _num_requests(stats: Mapping[str, Any]) -> int:
    return int(stats.get("num_waiting", 0)) + int(stats.get("num_running", 0))


def rank_replicas(
    candidates: Sequence[Hashable],
    stats: Mapping[Hashable, Mapping[str, Any] | None],
    prefix: str | None,
    index: PrefixIndex,
    tracker: LoadTracker,
    policy: RoutingPolicy,
    rng: random.Random | None = None,
) -> list[Hashable]:
    """The whole decision for one request, best replica first.

    Records the top choice in `index` optimistically, so a burst sharing a prefix sticks together before the
    first of it is routed; the router's `on_request_routed` corrects it if a fallback rank took the request.
    """
    for replica in candidates:
        tracker.observe_stats(replica, stats.get(replica))
    scores = {r: score_replica(stats.get(r), tracker.unseen(r), policy) for r in candidates}
    owner = None
    if prefix:
        owner, matched = index.match(prefix)
        if matched < policy.min_match_chars:
            owner = None
    ranked = choose(candidates, scores, owner, policy, rng)
    if prefix and ranked:
        index.insert(prefix, ranked[0])
    return ranked
