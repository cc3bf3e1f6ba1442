"""Drive an AsyncEngine in this process (no HTTP, no Ray): for experiments about the scheduler itself,
where the serving stack's overhead would only blur the step timings being compared."""
from __future__ import annotations

import asyncio
import contextlib
import time

from conveyor.bench.metrics import HTTP_TOO_MANY_REQUESTS, RequestResult
from conveyor.bench.workload import BenchRequest
from conveyor.serving.admission import QueueFullError
from conveyor.serving.async_engine import AsyncEngine
from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.serving.request import SamplingParams


def make_engine(model: str = "smollm2", max_num_batched_tokens: int = 256, max_num_seqs: int = 32,
                itl_slo_ms: float | None = None, min_prefill_tokens: int = 8, dtype: str = "auto",
                kv_cache_dtype: str = "auto") -> AsyncEngine:
    cfg = EngineConfig(model=ModelConfig(model=model, dtype=dtype), cache=CacheConfig(kv_cache_dtype=kv_cache_dtype),
                       scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                                 max_num_seqs=max_num_seqs, itl_slo_ms=itl_slo_ms,
                                                 min_prefill_tokens=min_prefill_tokens))
    return AsyncEngine.from_config(cfg)


async def stream_one(engine: AsyncEngine, req: BenchRequest, t0: float, timeout_s: float = 600.0
                     ) -> RequestResult:
    """One request; each engine output is one step's delta, so a gap between outputs is one ITL sample
    (a step that emits several tokens for a request would count as one gap, as a client sees it)."""
    send = time.perf_counter()
    res = RequestResult(send_time=send - t0, prompt_len=len(req.prompt_token_ids), max_tokens=req.max_tokens)
    params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
    n = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for out in engine.generate(list(req.prompt_token_ids), params):
                if not out.delta_token_ids:
                    continue
                res.record_chunk(time.perf_counter(), send, t0)
                n = len(out.token_ids)
        res.e2e = time.perf_counter() - send
        res.output_tokens, res.ok = n, n > 0
    except QueueFullError as exc:  # what `conveyor serve` answers with 429: count it as the client would
        res.status, res.e2e = HTTP_TOO_MANY_REQUESTS, time.perf_counter() - send
        res.error = f"refused: {exc}"[:300]
    except (TimeoutError, RuntimeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    return res


async def run_inproc(engine: AsyncEngine, reqs: list[BenchRequest], offsets: list[float],
                     max_concurrency: int | None = None) -> tuple[list[RequestResult], float]:
    """Submit reqs[i] at offsets[i] s, or with max_concurrency as soon as one of that many slots frees (a closed
    loop, as conveyor.bench.client.run_load does over HTTP); return results and the wall time."""
    t0 = time.perf_counter()
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def scheduled(req: BenchRequest, offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
        async with slots:
            return await stream_one(engine, req, t0)

    results = await asyncio.gather(*(scheduled(r, o) for r, o in zip(reqs, offsets, strict=True)))
    return list(results), time.perf_counter() - t0
