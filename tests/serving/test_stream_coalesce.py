"""Coalesced streams: outputs that queued up while a consumer was busy come as one, and lose nothing."""
from __future__ import annotations

import asyncio
import threading

import pytest

from conveyor.serving.async_engine import AsyncEngine
from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.serving.engine_client import RequestStream, post_all
from conveyor.serving.outputs import RequestOutput, SampledToken, merge_outputs
from conveyor.serving.request import SamplingParams


def _out(i: int, finished: bool = False, logprob: bool = False) -> RequestOutput:
    return RequestOutput("r", f"t{i} ", [i], "", [], 3, finished=finished, finish_reason="length" if finished else None,
                         delta_logprobs=[SampledToken(i, -float(i))] if logprob else None, first_token_time=float(i))


def test_merge_joins_deltas_and_keeps_the_last_end() -> None:
    merged = merge_outputs([_out(1, logprob=True), _out(2), _out(3, finished=True, logprob=True)])
    assert merged.delta_text == "t1 t2 t3 " and merged.delta_token_ids == [1, 2, 3]
    assert merged.finished and merged.finish_reason == "length"
    assert [s.token_id for s in merged.delta_logprobs] == [1, 3]
    assert merged.first_token_time == 1.0


def _consume(stream: RequestStream, coalesce: bool) -> tuple[list[RequestOutput], BaseException | None]:
    async def run() -> tuple[list[RequestOutput], BaseException | None]:
        got = []
        try:
            async for out in stream.outputs(coalesce):
                got.append(out)
        except RuntimeError as exc:
            return got, exc
        return got, None

    return stream.loop.run_until_complete(run())


@pytest.mark.parametrize("coalesce", [False, True])
def test_stream_merges_only_what_is_waiting(coalesce: bool) -> None:
    loop = asyncio.new_event_loop()
    try:
        stream = RequestStream(loop, asyncio.Queue())
        for i in range(3):
            stream.queue.put_nowait(_out(i))
        stream.queue.put_nowait(_out(3, finished=True))
        stream.queue.put_nowait(_out(99))  # after the end: never read
        got, error = _consume(stream, coalesce)
    finally:
        loop.close()
    assert error is None
    assert len(got) == (1 if coalesce else 4)
    assert "".join(o.delta_text for o in got) == "t0 t1 t2 t3 "
    assert got[-1].finished


def test_an_error_after_waiting_outputs_comes_after_them() -> None:
    loop = asyncio.new_event_loop()
    try:
        stream = RequestStream(loop, asyncio.Queue())
        stream.queue.put_nowait(_out(0))
        stream.queue.put_nowait(_out(1))
        stream.queue.put_nowait(RuntimeError("engine died"))
        got, error = _consume(stream, coalesce=True)
    finally:
        loop.close()
    assert [o.delta_token_ids for o in got] == [[0, 1]]
    assert isinstance(error, RuntimeError) and "engine died" in str(error)


def test_post_all_keeps_order_across_threads() -> None:
    loop = asyncio.new_event_loop()
    try:
        streams = [RequestStream(loop, asyncio.Queue()) for _ in range(2)]
        batches = [[(s, _out(i, finished=i == 4)) for s in streams] for i in range(5)]
        sender = threading.Thread(target=lambda: [post_all(b) for b in batches])
        sender.start()
        sender.join()
        results = [_consume(s, coalesce=False)[0] for s in streams]
    finally:
        loop.close()
    for got in results:
        assert [o.delta_token_ids[0] for o in got] == [0, 1, 2, 3, 4]


def test_a_slow_consumer_gets_fewer_records_and_the_same_tokens(tiny_model_dir) -> None:
    config = EngineConfig(model=ModelConfig(model=str(tiny_model_dir)), cache=CacheConfig(num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=4))
    engine = AsyncEngine.from_config(config, 1)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def run(coalesce: bool, delay_s: float) -> list[RequestOutput]:
        got = []
        async for out in engine.generate([5, 6, 7, 8], params, coalesce=coalesce):
            got.append(out)
            await asyncio.sleep(delay_s)  # busy elsewhere: the engine keeps stepping meanwhile
        return got

    try:
        plain = asyncio.run(run(False, 0.0))
        slow = asyncio.run(run(True, 0.05))
    finally:
        engine.shutdown()
    assert len(slow) < len(plain)
    assert [t for o in slow for t in o.delta_token_ids] == [t for o in plain for t in o.delta_token_ids]
    assert "".join(o.delta_text for o in slow) == "".join(o.delta_text for o in plain) == slow[-1].text
    assert slow[-1].finished and slow[-1].finish_reason == plain[-1].finish_reason == "length"
    assert len(slow[-1].token_ids) == 24


@pytest.mark.parametrize("interval", [1, 2, 3, 5])
def test_stream_interval_posts_the_first_token_then_every_interval_tokens_and_the_end(interval: int) -> None:
    """vLLM's stream_interval (EngineConfig.stream_interval): the first output and the finished one leave at once,
    the others once `interval` tokens have gathered, merged; what leaves joins to exactly what came."""
    stream = RequestStream(asyncio.new_event_loop(), asyncio.Queue())
    outputs = [_out(i, logprob=i % 2 == 0) for i in range(1, 11)] + [_out(11, finished=True)]
    posted = [item for out in outputs if (item := stream.through_interval(out, interval)) is not None]
    stream.loop.close()
    assert merge_outputs(posted).delta_token_ids == list(range(1, 12))
    assert "".join(p.delta_text for p in posted) == "".join(o.delta_text for o in outputs)
    assert [s.token_id for p in posted for s in (p.delta_logprobs or [])] == [2, 4, 6, 8, 10]
    assert posted[0].delta_token_ids == [1] and posted[-1].finished
    assert all(len(p.delta_token_ids) == interval for p in posted[1:-1])
    assert len(posted[-1].delta_token_ids) <= interval
    assert len(posted) == 1 + -(-10 // interval)  # the first, then ceil(10 / interval) more
