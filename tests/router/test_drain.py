"""The hand-back registry (conveyor/router/drain.py) on its own, with the router's events sent from another thread as
Serve's router loop does; and the request router still serializable the way Serve ships it (by value)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from conveyor.router.drain import ReplicaDeparture


def from_thread(fn, *args) -> None:  # noqa: ANN001 - Serve's router runs on a loop of its own thread
    t = threading.Thread(target=fn, args=args)
    t.start()
    t.join()


async def settled(event: asyncio.Event) -> bool:
    try:
        await asyncio.wait_for(event.wait(), 0.5)
    except asyncio.TimeoutError:
        return False
    return True


def test_a_request_is_woken_when_its_replica_leaves_and_others_are_not() -> None:
    async def main() -> None:
        departures = ReplicaDeparture()
        with departures.watch("a/0") as a_left, departures.watch("b/0") as b_left:
            from_thread(departures.on_routed, "a/0", "replica-1")
            from_thread(departures.on_routed, "b/0", "replica-2")
            from_thread(departures.on_left, {"replica-1"})
            assert await settled(a_left)
            assert not await settled(b_left)

    asyncio.run(main())


def test_routed_after_its_replica_left_is_woken_at_once() -> None:
    async def main() -> None:
        departures = ReplicaDeparture()
        from_thread(departures.on_left, {"replica-1"})
        with departures.watch("a/0") as left:
            from_thread(departures.on_routed, "a/0", "replica-1")
            assert await settled(left)

    asyncio.run(main())


def test_a_replica_back_in_the_set_is_not_gone_and_unwatched_requests_are_ignored() -> None:
    async def main() -> None:
        departures = ReplicaDeparture()
        departures.on_left({"replica-1"})
        departures.on_joined({"replica-1"})
        departures.on_routed("nobody-watches/0", "replica-1")  # e.g. a health probe: nothing happens
        with departures.watch("a/0") as left:
            departures.on_routed("a/0", "replica-1")
            assert not await settled(left)
        departures.on_left({"replica-1"})  # after the watch ended: nothing is left registered to wake
        assert departures._watched == {}  # noqa: SLF001

    asyncio.run(main())


def test_the_request_router_serializes_as_serve_ships_it() -> None:
    # Serve cloudpickles the router's module by value: a module-level lock referenced from a method failed it.
    pytest.importorskip("ray")
    from ray.serve.config import RequestRouterConfig

    config = RequestRouterConfig(request_router_class="conveyor.router.routing:LoadAwarePrefixRouter")
    assert config.get_serialized_request_router_cls()
