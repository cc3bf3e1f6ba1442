"""The load generator: sends a workload to /v1/completions with streaming and times every chunk.

aiohttp, not httpx: on a 2-core machine the client shares the CPU with the server it measures, and per streamed
chunk aiohttp costs less than half of httpx's CPU (benchmarks/RESULTS.md, "Goodput"); vLLM's benchmark client uses
it too."""
from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlparse

import aiohttp
from tqdm.asyncio import tqdm

from conveyor.bench.metrics import RequestResult
from conveyor.bench.workload import BenchRequest


def validate_base_url(base_url: str) -> str:
    """The server's root URL (http or https, with a host), without a trailing slash; ValueError otherwise.

    Any host is accepted: the benchmark is for servers its user runs or may load (a load generator aimed at
    someone else's server is an attack)."""
    try:
        parts = urlparse(base_url)
        host, _ = parts.hostname, parts.port  # .port raises ValueError on a malformed port
    except ValueError as exc:
        raise ValueError(f"bad base URL {base_url!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"bad base URL {base_url!r}: the scheme must be http or https")
    if not host:
        raise ValueError(f"bad base URL {base_url!r}: no host")
    if parts.query or parts.fragment:
        raise ValueError(f"bad base URL {base_url!r}: no query or fragment (the path /v1/completions is added)")
    return base_url.rstrip("/")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """`Authorization: Bearer KEY` when a key is given (OpenAI's scheme, and `conveyor serve --api-key`'s)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def send_one(client: aiohttp.ClientSession, url: str, model: str, req: BenchRequest, t0: float,
                   timeout_s: float) -> RequestResult:
    """One streamed completion, every token-bearing chunk timed; errors end up in the result, not raised."""
    send = time.perf_counter()
    result = RequestResult(send_time=send - t0, prompt_len=len(req.prompt_token_ids), max_tokens=req.max_tokens)
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    chunks = 0
    usage_tokens = None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.post(url, json=body) as resp:
                result.status = resp.status
                if resp.status != 200:
                    result.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                    result.e2e = time.perf_counter() - send  # for a 429: how fast the refusal came
                    return result
                async for raw in resp.content:
                    if not raw.startswith(b"data:"):
                        continue
                    data = raw[5:].strip()
                    if data == b"[DONE]":
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
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # JSONDecodeError is a ValueError
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        result.e2e = time.perf_counter() - send  # a failed request still ends the run's measured window
    return result


async def run_load(base_url: str, model: str, requests: list[BenchRequest], offsets: list[float],
                   max_concurrency: int | None = None, timeout_s: float = 600.0,
                   progress: bool = True, desc: str = "", api_key: str | None = None
                   ) -> tuple[list[RequestResult], float]:
    """Send requests[i] at offsets[i] s (or as soon as a concurrency slot frees); return results and the
    wall time from the first send to the last finish. With api_key, every request carries it as a bearer token."""
    url = validate_base_url(base_url) + "/v1/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max(len(requests), 1))
    async with aiohttp.ClientSession(connector=connector, headers=auth_headers(api_key),
                                     timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0)) as client:
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


async def warmup(base_url: str, model: str, requests: list[BenchRequest], timeout_s: float = 120.0,
                 api_key: str | None = None) -> None:
    """A few requests first: the first steps pay one-off costs (allocator, kernels) no user should see."""
    if requests:
        await run_load(base_url, model, requests, [0.0] * len(requests), timeout_s=timeout_s, progress=False,
                       api_key=api_key)
