"""Replica streams through the handle: start one (retry on a dead replica, hand-backs, typed errors), read its
records (its own stream and the ingress's subscription, router/mux.py), and start over a request that is not
streamed when its replica fails. Writing the records out as SSE is sse_stream.py's."""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ObjectLostError, RayActorError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from conveyor.router.demux import SUBSCRIPTION_ENDED, Demux
from conveyor.router.drain import DEPARTURES, HAND_BACK, ROUTE_KEY
from conveyor.router.errors import ApiError
from conveyor.router.mux import MUX_KEY, SEQ_KEY, SUBSCRIBER_KEY

logger = logging.getLogger("ray.serve")  # Serve routes this logger into its replica log files

# The replica died or vanished before it answered: safe to send the request elsewhere, nothing was streamed.
RETRYABLE = (RayActorError, ReplicaUnavailableError, ObjectLostError)
MAX_ATTEMPTS = 2
MAX_HAND_BACKS = 3  # a request is sent again when its replica drains before it starts: bounded, not forever


ENGINE_GONE_BACKOFF_S = 0.3  # see HandedBack
# A record that the own stream ended: after it, the muxed records still due get this long to arrive.
MUXED_TAIL_TIMEOUT_S = 10.0


@dataclass
class StartedStream:
    """A replica stream whose first record has arrived (so the request is admitted and has a token). When the
    first record says so, the rest comes on the ingress's subscription to that replica (conveyor/router/mux.py) and,
    if the subscription goes away, on this stream again: both feed `queue`, and `seq` restores the order."""

    first: dict[str, Any]
    gen: DeploymentResponseGenerator
    queue: asyncio.Queue | None = None
    release: Callable[[], None] | None = None

    async def records(self) -> AsyncIterator[dict[str, Any]]:
        yield self.first
        if self.first.get("finish_reason") is not None:
            return
        if self.queue is None:
            async for record in self.gen:
                yield record
            return
        own = asyncio.ensure_future(self._pump_own())
        try:
            async for record in self._muxed():
                yield record
        finally:
            own.cancel()
            self.release()

    async def _pump_own(self) -> None:
        try:
            async for record in self.gen:
                self.queue.put_nowait((record[SEQ_KEY], record))
            self.queue.put_nowait(_OWN_END)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self.queue.put_nowait(exc)

    async def _muxed(self) -> AsyncIterator[dict[str, Any]]:
        expected, held, own_ended, subscription_ended = 1, {}, False, False
        while True:
            timeout = MUXED_TAIL_TIMEOUT_S if own_ended else None
            try:
                item = await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                raise RuntimeError("records of a multiplexed stream never arrived") from None
            if item is _OWN_END or item is SUBSCRIPTION_ENDED:
                own_ended |= item is _OWN_END
                subscription_ended |= item is SUBSCRIPTION_ENDED
                if own_ended and subscription_ended:  # both ways it could come have ended: what is missing is lost
                    raise RuntimeError("records of a multiplexed stream were lost with its replica's subscription")
                continue
            if isinstance(item, BaseException):
                raise item
            seq, record = item
            held[seq] = record
            while expected in held:
                record = held.pop(expected)
                expected += 1
                yield record
                if record.get("finish_reason") is not None:
                    return

    def cancel(self) -> None:
        # Cancels the replica's generator; its `finally` closes the engine stream, which aborts the request.
        self.gen.cancel()
        if self.release is not None:
            self.release()


_OWN_END = object()


async def start_stream(handle: DeploymentHandle, request: dict[str, Any], wait_timeout_s: float,
                       on_hand_back: Callable[[], None] | None = None, demux: Demux | None = None) -> StartedStream:
    num_failed = num_handed_back = 0
    muxable = demux is not None and request.get("stream", True)
    while True:
        # A key per attempt: a late routing event of an earlier attempt must not wake this one.
        key = f"{request.get('request_id')}/{num_failed}/{num_handed_back}"
        queue = demux.register(key) if muxable else None
        extra = {ROUTE_KEY: key} | ({SUBSCRIBER_KEY: demux.subscriber} if muxable else {})
        started = False
        with DEPARTURES.watch(key) as replica_left:
            gen = handle.options(stream=True).generate.remote(request | extra)
            try:
                await _wait_assigned(gen, wait_timeout_s)
                first = await _first_record(gen, replica_left)
                started = True
            except HandedBack as exc:
                gen.cancel()  # the draining replica aborts it in its engine
                num_handed_back += 1
                if num_handed_back > MAX_HAND_BACKS:
                    raise ApiError.unavailable("replicas kept leaving before the request started") from None
                logger.info("request %s handed back (%s); sending it elsewhere", key, exc)
                if on_hand_back is not None:
                    on_hand_back()
                if exc.backoff_s:
                    await asyncio.sleep(exc.backoff_s * num_handed_back)
                continue
            except RETRYABLE as exc:
                gen.cancel()
                num_failed += 1
                if num_failed == MAX_ATTEMPTS:
                    raise ApiError.unavailable(f"no replica could serve the request: {exc}") from None
                logger.warning("replica failed before streaming (%r); retrying on another replica", exc)
                continue
            except BackPressureError as exc:
                gen.cancel()
                raise ApiError.too_many(f"server is at capacity: {exc.message}",
                                        exc.retry_after_s or 1.0) from None
            except BaseException:  # client gone (CancelledError) or an unexpected failure: free the replica
                gen.cancel()
                raise
            finally:
                if queue is not None and not started:
                    demux.unregister(key)  # a retry registers its own key
        if queue is None:
            return StartedStream(_raise_if_error(first), gen)
        demux.ensure_subscribed(first.get("replica"))  # for this replica's next streams, if none is open
        if not first.get(MUX_KEY):  # an error record has no MUX_KEY either
            demux.unregister(key)
            return StartedStream(_raise_if_error(first), gen)
        demux.bind(key, first["replica"])
        return StartedStream(first, gen, queue, functools.partial(demux.unregister, key))


class HandedBack(Exception):
    """The replica holding the request left the routing set (it drains), or its engine process died, before the
    request started. backoff_s: wait this long (times the attempt) before sending it again: a replica whose engine
    died stays in the routing set until Serve's next stats poll shows it saturated, so an immediate retry could
    meet it again."""

    def __init__(self, reason: str, backoff_s: float = 0.0) -> None:
        super().__init__(reason)
        self.backoff_s = backoff_s


async def _first_record(gen: DeploymentResponseGenerator, replica_left: asyncio.Event) -> dict[str, Any]:
    """The stream's first record, or HandedBack if its replica leaves first or answers with a hand-back record
    (its engine died). A record that arrives together with the departure wins: the request has started and the
    drain lets it finish."""
    first = asyncio.ensure_future(gen.__anext__())
    left = asyncio.ensure_future(replica_left.wait())
    try:
        await asyncio.wait((first, left), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not first.done():
            first.cancel()
    if first.done() and not first.cancelled():
        record = first.result()
        if record.get("error") != HAND_BACK:
            return record
        raise HandedBack(record.get("message", "engine gone"), backoff_s=ENGINE_GONE_BACKOFF_S)
    raise HandedBack("replica left the routing set")


async def read_whole(stream: StartedStream, restart: Callable[[], Awaitable[StartedStream]],
                     on_hand_back: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Every record of a request that is not streamed. Its client has been sent nothing, so when its replica's engine
    process dies (a hand-back record) or the replica itself does before the last record, the request starts over on
    another replica (`restart`: start_stream again), at most MAX_HAND_BACKS times."""
    num_restarts = 0
    while True:
        records: list[dict[str, Any]] = []
        try:
            async for record in stream.records():
                if record.get("error") == HAND_BACK:
                    raise HandedBack(record.get("message", "engine gone"), backoff_s=ENGINE_GONE_BACKOFF_S)
                records.append(record)
            return records
        except (HandedBack, *RETRYABLE) as exc:
            stream.cancel()
            num_restarts += 1
            if num_restarts > MAX_HAND_BACKS:
                raise ApiError.unavailable("replicas kept failing while generating the request") from None
            logger.warning("request failed mid-generation before any output reached its client (%r); starting it "
                           "again on another replica", exc)
            if on_hand_back is not None:
                on_hand_back()
            await asyncio.sleep(ENGINE_GONE_BACKOFF_S * num_restarts)  # see HandedBack
            stream = await restart()


def _raise_if_error(record: dict[str, Any]) -> dict[str, Any]:
    kind = record.get("error")
    if kind is None:
        return record
    if kind == "queue_full":  # the replica counted these (conveyor_requests_rejected_total)
        raise ApiError.too_many(f"server is at capacity: {record['message']}",
                                record.get("retry_after_s", 1.0)).already_counted()
    if kind == "invalid_request":
        raise ApiError.invalid(record["message"], param="prompt", code="invalid_prompt").already_counted()
    raise ApiError.server(record.get("message", "replica error"))


async def _wait_assigned(gen: DeploymentResponseGenerator, timeout_s: float) -> None:
    """503 when no replica takes the request in time (none running yet, or all gone).

    Uses the handle's assignment future (a private hook, hence the guard): the first record alone cannot
    tell "no replica" from "queued behind a long prefill".
    """
    fetch = getattr(gen, "_fetch_future_result_async", None)
    if fetch is None:
        return
    try:
        await asyncio.wait_for(fetch(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError.unavailable(f"no replica became ready within {timeout_s:.0f}s") from None
