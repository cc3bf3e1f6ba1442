"""LoadAwarePrefixRouter: the pure policy (milliseconds) and one real two-replica Serve deployment."""
from __future__ import annotations

import os
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from conveyor.router.prefix_index import (  # noqa: E402 - RAY_AUTH_MODE must be set before ray is imported
    SATURATED_PENALTY,
    LoadTracker,
    PrefixIndex,
    RoutingPolicy,
    choose,
    rank_replicas,
    score_replica,
)

POLICY = RoutingPolicy(jitter=0.0)


def stats(waiting: int = 0, running: int = 0, kv: float = 0.0, max_seqs: int = 16,
          max_waiting: int = 256) -> dict[str, Any]:
    return {"num_waiting": waiting, "num_running": running, "kv_cache_usage": kv,
            "max_num_seqs": max_seqs, "max_waiting_requests": max_waiting}


def text(seed: int, n: int = 600) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def rank(prefix: str | None, replica_stats: dict[str, dict[str, Any] | None], index: PrefixIndex,
         tracker: LoadTracker | None = None, policy: RoutingPolicy = POLICY, seed: int = 0) -> list[str]:
    return rank_replicas(list(replica_stats), replica_stats, prefix, index, tracker or LoadTracker(), policy,
                         random.Random(seed))


# ---- pure policy -------------------------------------------------------------------------------------------

def test_score_orders_by_queue_running_and_kv() -> None:
    idle = score_replica(stats(), 0, POLICY)
    assert idle == 0.0
    assert score_replica(stats(waiting=4), 0, POLICY) > score_replica(stats(running=4), 0, POLICY) > idle
    assert score_replica(stats(kv=0.9), 0, POLICY) > idle
    # Normalised by batch size: 8 waiting on a 64-seq replica is lighter than 8 waiting on a 16-seq one.
    small_batch = score_replica(stats(waiting=8), 0, POLICY)
    assert score_replica(stats(waiting=8, max_seqs=64), 0, POLICY) < small_batch
    assert score_replica(stats(waiting=256), 0, POLICY) >= SATURATED_PENALTY
    assert score_replica(None, 0, POLICY) == 0.0  # no stats published yet


def test_affinity_holds_across_suffixes_and_tie_breaks() -> None:
    index = PrefixIndex()
    shared = text(1)
    index.insert(shared + " first question", "b")
    for seed in range(50):  # any random tie-break must keep the owner first
        policy = RoutingPolicy(jitter=0.05)
        assert rank(shared + f" question {seed}", {"a": stats(), "b": stats()}, index, policy=policy,
                    seed=seed)[0] == "b"


def test_overloaded_owner_is_bypassed_but_mildly_busy_owner_is_kept() -> None:
    index = PrefixIndex()
    shared = text(2)
    index.insert(shared, "a")
    # 4 extra waiting on a 16-seq replica = 0.25 < threshold 0.5: the cache hit is worth it.
    assert rank(shared, {"a": stats(waiting=4), "b": stats()}, index)[0] == "a"
    index.insert(shared, "a")
    # 12 extra waiting = 0.75 > 0.5: go to the idle replica.
    assert rank(shared, {"a": stats(waiting=12), "b": stats()}, index) == ["b", "a"]


def test_least_loaded_first_and_full_ranking_for_fallback() -> None:
    replica_stats = {"a": stats(waiting=3), "b": stats(running=2), "c": stats(kv=0.95),
                     "d": stats(waiting=256)}
    # b: 2 running = 0.06; a: 3 waiting = 0.19; c: 95% KV = 0.48; d: waiting queue full.
    assert rank(None, replica_stats, PrefixIndex()) == ["b", "a", "c", "d"]


def test_no_prefix_or_short_match_means_load_only() -> None:
    index = PrefixIndex()
    index.insert(text(3), "a")
    replica_stats = {"a": stats(waiting=1), "b": stats()}
    assert rank(None, replica_stats, index)[0] == "b"
    assert rank("", replica_stats, index)[0] == "b"
    # Only 192 shared characters (< min_match_chars=256): not worth a less loaded choice.
    assert rank(text(3)[:192] + text(4), replica_stats, index)[0] == "b"


def test_equal_load_ties_are_broken_randomly() -> None:
    equal = {"a": stats(), "b": stats()}
    firsts = Counter(rank(None, equal, PrefixIndex(), policy=RoutingPolicy(), seed=s)[0] for s in range(200))
    assert firsts["a"] > 50 and firsts["b"] > 50


def test_stale_stats_are_compensated_by_in_flight_counts() -> None:
    tracker = LoadTracker()
    same = {"a": stats(), "b": stats()}
    chosen = [rank(None, same, PrefixIndex(), tracker, seed=i)[0] for i in range(6)]
    for replica in chosen:  # what Serve's on_send_request does after each choice
        tracker.on_sent(replica)
    assert tracker.unseen("a") + tracker.unseen("b") == 6
    # Sending without seeing new stats must alternate, not pile onto the replica that looked idle.
    tracker2 = LoadTracker()
    order = []
    for i in range(6):
        order.append(rank(None, same, PrefixIndex(), tracker2, seed=i)[0])
        tracker2.on_sent(order[-1])
    assert Counter(order) == {"a": 3, "b": 3}
    # Fresh stats now include those requests: the router's own count resets so nothing is counted twice.
    tracker2.observe_stats("a", stats(waiting=3))
    assert tracker2.unseen("a") == 0 and tracker2.unseen("b") == 3
    # Finished requests cannot hide in a queue: unseen is capped by what is still in flight.
    for _ in range(3):
        tracker2.on_completed("b")
    assert tracker2.unseen("b") == 0
    tracker2.on_completed("b")  # a completion we never saw sent must not go negative
    assert tracker2.in_flight("b") == 0


def test_a_burst_alternates_while_a_busy_replica_s_stats_keep_changing() -> None:
    """A busy replica's stats change every period (KV usage) before they count what was just sent: that alone
    must not make the router forget its sends (it did: 7 of a burst of 8 went to the busy replica)."""
    tracker, order = LoadTracker(), []
    for i in range(8):
        snapshot = {"a": stats(running=1, kv=0.01 * (i + 1), max_seqs=2), "b": stats(max_seqs=2)}
        order.append(rank(None, snapshot, PrefixIndex(), tracker, policy=RoutingPolicy(), seed=i)[0])
        tracker.on_sent(order[-1])
    assert Counter(order) == {"a": 4, "b": 4}, order
    # Stats that show the sent requests do account for them.
    tracker.observe_stats("a", stats(waiting=3, running=2, kv=0.5, max_seqs=2))
    assert tracker.unseen("a") == 0


def test_burst_sharing_a_prefix_sticks_before_any_is_routed() -> None:
    index, tracker = PrefixIndex(), LoadTracker()
    shared = text(5)
    first = rank(shared + "1", {"a": stats(), "b": stats()}, index, tracker, seed=1)[0]
    tracker.on_sent(first)
    # The owner now has one unseen request (1/16 = 0.06 extra load), well under the threshold.
    assert rank(shared + "2", {"a": stats(), "b": stats()}, index, tracker, seed=2)[0] == first


def test_prefix_index_lru_bound_and_longest_match() -> None:
    index = PrefixIndex(chunk_chars=4, max_entries=10)
    index.insert("aaaabbbbcccc", "x")  # 3 chunks
    assert index.match("aaaabbbbccccdd") == ("x", 12)
    assert index.match("aaaabbbbzzzz") == ("x", 8)
    index.insert("aaaabbbbccccdddd", "y")  # the newest server of the longer prefix wins it
    assert index.match("aaaabbbbccccdddd") == ("y", 16)
    index.insert("aaaa", "z")
    assert index.match("aaaabbbbcccc") == ("y", 12)  # deeper chunks keep their (older) owner
    for i in range(20):
        index.insert(f"{i:04d}{i:04d}", "w")
        assert len(index) <= 10
    assert index.match("aaaabbbb") == (None, 0)  # least recently used: evicted
    index.insert("zzzz", "q")
    index.remove_owner("q")
    assert index.match("zzzz") == (None, 0)


def test_choose_ignores_owner_not_among_candidates() -> None:
    assert choose(["a", "b"], {"a": 0.2, "b": 0.1}, "gone", POLICY) == ["b", "a"]


def test_policy_from_kwargs_rejects_typos() -> None:
    assert RoutingPolicy.from_kwargs(imbalance_threshold=2.0).imbalance_threshold == 2.0
    with pytest.raises(ValueError, match="imbalance_treshold"):
        RoutingPolicy.from_kwargs(imbalance_treshold=2.0)


def test_routing_prefix_extraction_tolerates_absence() -> None:
    from conveyor.router.routing import routing_prefix

    def pending(*args: Any, **kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(args=list(args), kwargs=kwargs)

    assert routing_prefix(pending({"routing_prefix": "hello", "prompt": "x"})) == "hello"
    assert routing_prefix(pending(SimpleNamespace(routing_prefix="obj"))) == "obj"
    assert routing_prefix(pending(routing_prefix="kw")) == "kw"
    assert routing_prefix(pending({"prompt": "x"})) is None
    assert routing_prefix(pending({"routing_prefix": 3})) is None
    assert routing_prefix(pending()) is None
    assert routing_prefix(None) is None


# ---- one real two-replica deployment -----------------------------------------------------------------------

APP_NAME = "conveyor-test-routing"


@pytest.fixture(scope="module")
def serve_instance() -> Iterator[None]:
    """Reuse the cluster tests/router/conftest.py started, if any; else start (and stop) our own."""
    import ray
    from ray import serve

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False, num_cpus=4, log_to_driver=False)
        # No HTTP proxy: this test talks through a handle, and port 8000 may belong to another test run.
        serve.start(proxy_location="Disabled")
    try:
        yield
    finally:
        serve.delete(APP_NAME)
        if started_ray:
            serve.shutdown()
            ray.shutdown()


def _build_app(board: Any) -> Any:
    import asyncio

    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(
        num_replicas=2,
        max_ongoing_requests=64,
        ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(
            request_router_class="conveyor.router.routing:LoadAwarePrefixRouter",
            request_routing_stats_period_s=0.2,
        ),
    )
    class FakeEngine:
        """Stands in for the engine replica: its queue depth comes from the test's board actor."""

        def __init__(self, board: Any) -> None:
            self._board = board
            self._id = serve.get_replica_context().replica_id.unique_id

        async def record_routing_stats(self) -> dict[str, Any]:
            waiting = await self._board.get.remote(self._id)
            return {"num_waiting": waiting, "num_running": 0, "kv_cache_usage": 0.0, "max_num_seqs": 16,
                    "max_waiting_requests": 1000}

        async def generate(self, request_dict: dict[str, Any]) -> Any:
            await asyncio.sleep(0.05)  # long enough for concurrent requests to overlap
            yield self._id

    return FakeEngine.bind(board)


def _send(handle: Any, prefixes: list[str]) -> list[str]:
    """Send all requests at once (like concurrent HTTP clients); return the serving replica of each."""
    generate = handle.options(stream=True).generate
    streams = [generate.remote({"routing_prefix": p, "prompt": p}) for p in prefixes]
    return [list(stream)[0] for stream in streams]


@pytest.mark.timeout(240)
def test_two_replicas_affinity_spread_and_queue_depth(serve_instance: None) -> None:
    import ray
    from ray import cloudpickle, serve

    # The deployment class is defined in this test module, which Ray workers cannot import: ship it by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    @ray.remote(num_cpus=0)
    class Board:
        def __init__(self) -> None:
            self.waiting: dict[str, int] = {}

        def get(self, replica: str) -> int:
            return self.waiting.get(replica, 0)

        def set(self, replica: str, waiting: int) -> None:
            self.waiting[replica] = waiting

    board = Board.remote()
    handle = serve.run(_build_app(board), name=APP_NAME, route_prefix=None)

    # Distinct prefixes, equal load: both replicas serve. Not evenly: on a loaded host the whole burst can be
    # ranked before the first sends are counted, and one full-suite run split it 16/4.
    spread = Counter(_send(handle, [text(100 + i) for i in range(20)]))
    assert len(spread) == 2 and min(spread.values()) >= 3, spread
    replicas = sorted(spread)

    # Shared long prefixes: every group sticks to one replica (sequential, like turns of a conversation).
    owners = []
    for group in range(4):
        served = {_send(handle, [text(200 + group) + f" turn {turn}"])[0] for turn in range(5)}
        assert len(served) == 1, (group, served)
        owners.append(served.pop())

    # The owner of group 0 reports a deep queue: new requests, even group 0's, avoid it.
    deep = owners[0]
    idle = next(r for r in replicas if r != deep)
    ray.get(board.set.remote(deep, 40))  # 40 waiting on 16 seqs: score 2.5
    time.sleep(2.0)  # stats period 0.2 s + controller loop + long-poll broadcast to this handle
    served = Counter(_send(handle, [text(300 + i) for i in range(16)] + [text(200) + " turn 9"]))
    assert served[deep] <= 2 and served[idle] >= 15, served
    assert _send(handle, [text(200) + " turn 10"]) == [idle]
