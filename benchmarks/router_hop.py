"""What the router hop costs: a 1-token completion through HTTP (proxy -> ingress -> engine replica) vs the
same request on an in-process AsyncEngine. Requests alternate between the two paths, one at a time, so that
load from anything else on the machine hits both alike.

    .venv/bin/python benchmarks/router_hop.py [--model smollm2] [--requests 50] [--threads 2]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

PROMPT = "What is the capital of France?"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def direct_once(engine, params) -> float:  # noqa: ANN001
    start = time.perf_counter()
    async for _ in engine.generate(PROMPT, params):
        pass
    return time.perf_counter() - start


async def http_once(client, url: str, model: str) -> float:  # noqa: ANN001
    start = time.perf_counter()
    resp = await client.post(url, json={"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    resp.raise_for_status()
    return time.perf_counter() - start


async def measure(engine, url: str, model: str, n: int) -> tuple[list[float], list[float]]:  # noqa: ANN001
    import httpx

    from conveyor.serving.request import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    direct, http = [], []
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(n + 5):  # the first 5 of each warm up caches and connections
            d = await direct_once(engine, params)
            h = await http_once(client, url, model)
            if i >= 5:
                direct.append(d)
                http.append(h)
    return direct, http


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=8019)
    args = parser.parse_args()

    import ray
    import torch
    from ray import serve

    from conveyor.router.app import build_app
    from conveyor.serving.async_engine import AsyncEngine
    from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig

    torch.set_num_threads(args.threads)
    engine = AsyncEngine.from_config(EngineConfig(model=ModelConfig(model=args.model),
                                                  cache=CacheConfig(num_blocks=256)))
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app({"model": args.model, "num_kv_blocks": 256, "torch_num_threads": args.threads}),
              name="router-hop", route_prefix="/")
    try:
        url = f"http://127.0.0.1:{args.port}/v1/completions"
        direct, http = asyncio.run(measure(engine, url, args.model, args.requests))
    finally:
        engine.shutdown()
        serve.shutdown()
        ray.shutdown()
    print(f"{args.requests} sequential 1-token completions, model={args.model}, {args.threads} torch threads")
    for name, values in (("AsyncEngine", direct), ("HTTP via Serve", http)):
        p50, p99, mean = (percentile(values, 0.5), percentile(values, 0.99), statistics.mean(values))
        print(f"  {name:15s} p50 {p50 * 1e3:7.1f} ms   p99 {p99 * 1e3:7.1f} ms   mean {mean * 1e3:7.1f} ms")
    hop = [h - d for h, d in zip(http, direct, strict=True)]
    print(f"  router hop (paired difference) p50 {percentile(hop, 0.5) * 1e3:.1f} ms, "
          f"p99 {percentile(hop, 0.99) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
