"""The load generator: sends a workload to /v1/completions with streaming and times every chunk."""
from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlparse

import httpx
from tqdm.asyncio import tqdm

from benchmarks.serving.metrics import RequestResult
from benchmarks.serving.workload import BenchRequest

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def check_loopback(base_url: str) -> None:
    """A load generator aimed at someone else's server is an attack: refuse anything but this host."""
    host = urlparse(base_url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"refusing non-loopback target {base_url!r}")


async def send_one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, t0: float,
                   timeout_s: float) -> RequestResult:
    send = time.perf_counter()
    result = RequestResult(send_time=send - t0, prompt_len=len(req.prompt_token_ids), max_tokens=req.max_tokens)
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    chunks = 0
    usage_tokens = None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    return result
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    msg = json.loads(data)
                    if msg.get("usage"):
                        usage_tokens = msg["usage"].get("completion_tokens")
                    choices = msg.get("choices") or []
                    if not choices or not choices[0].get("text"):
                        continue  # usage-only or empty chunks carry no token to time
                    result.record_chunk(time.perf_counter(), send, t0)
                    chunks += 1
        result.e2e = time.perf_counter() - send
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.ok = chunks > 0
        if not result.ok:
            result.error = "no tokens streamed"
    except (httpx.HTTPError, TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


async def run_load(base_url: str, model: str, requests: list[BenchRequest], offsets: list[float],
                   max_concurrency: int | None = None, timeout_s: float = 600.0,
                   progress: bool = True, desc: str = "") -> tuple[list[RequestResult], float]:
    """Send requests[i] at offsets[i] s (or as soon as a concurrency slot frees); return results and the
    wall time from the first send to the last finish."""
    check_loopback(base_url)
    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max(len(requests), 1), max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()
        bar = tqdm(total=len(requests), desc=desc or base_url, disable=not progress, leave=False)

        async def scheduled(req: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            if sem is None:
                res = await send_one(client, url, model, req, t0, timeout_s)
            else:
                async with sem:
                    res = await send_one(client, url, model, req, t0, timeout_s)
            bar.update(1)
            return res

        results = await asyncio.gather(*(scheduled(r, o) for r, o in zip(requests, offsets, strict=True)))
        bar.close()
        return list(results), time.perf_counter() - t0


async def warmup(base_url: str, model: str, requests: list[BenchRequest], timeout_s: float = 120.0) -> None:
    """A few requests first: the first steps pay one-off costs (allocator, kernels) no user should see."""
    if requests:
        await run_load(base_url, model, requests, [0.0] * len(requests), timeout_s=timeout_s, progress=False)
