"""Soak: thousands of mixed requests with random client disconnects and aborts, then a full accounting.

Every request ends in exactly one outcome: completed (checked: full length, a finish reason, [DONE] for streams),
disconnected (we closed its stream mid-way), aborted (we cancelled it before the answer came), rejected with a
status (429 / 503), or error (anything else: a 5xx, a stream cut by the server, a transport failure). Afterwards
every replica must hold no KV blocks and no queued or running sequence, no replica may have restarted (same
replica ids and pids), and each replica's RSS must level off (see run_soak for what that means).

    .venv/bin/python -m benchmarks.soak [--requests 2000] [--phases 4] [--concurrency 16] [--replicas 2]

Results: benchmarks/out/soak.json ($CONVEYOR_ARTIFACTS/soak.json when set). Exit status 1 if any check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before ray is imported: token auth is on by default

import httpx

# benchmarks/out/ is git-ignored; $CONVEYOR_ARTIFACTS, when set, takes the results instead
RESULTS = Path(os.environ.get("CONVEYOR_ARTIFACTS") or Path(__file__).resolve().parent / "out") / "soak.json"
OK_OUTCOMES = ("completed", "disconnected", "aborted", "rejected_429", "rejected_503")
WORDS = "the quick brown fox jumps over lazy dog paged attention keeps blocks héllo 日本語 🙂".split()


@dataclass
class SoakConfig:
    requests: int = 2000
    concurrency: int = 16
    max_prompt_words: int = 60
    max_tokens: int = 48
    p_stream: float = 0.5
    p_chat: float = 0.3
    p_disconnect: float = 0.15  # streams only: close after a random number of chunks
    p_abort: float = 0.10  # cancel the request after a random delay (before or during generation)
    warmup: int = 40  # requests before the first snapshot
    phases: int = 4  # idle snapshots (blocks, pids, RSS) after each phase
    rss_growth_limit_bytes: int = 16 << 20  # last phase: below this is flat whatever the trend
    rss_settle_ratio: float = 0.5  # last phase's growth over the first phase's: below this is levelling off
    request_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    seed: int = 0


@dataclass
class Plan:
    stream: bool
    chat: bool
    prompt: str
    max_tokens: int
    action: str  # "finish" | "disconnect" | "abort"
    cut_after_chunks: int = 0
    abort_after_s: float = 0.0


def make_plan(cfg: SoakConfig, rng: random.Random) -> Plan:
    stream = rng.random() < cfg.p_stream
    roll = rng.random()
    action = "finish"
    if roll < cfg.p_abort:
        action = "abort"
    elif stream and roll < cfg.p_abort + cfg.p_disconnect:
        action = "disconnect"
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, cfg.max_prompt_words)))
    max_tokens = rng.randint(1, cfg.max_tokens)
    cut_after_chunks = rng.randint(1, 8)
    if action == "disconnect":
        # A stream's chunk count depends on timing: records that waited are coalesced, so a short answer can
        # finish in fewer chunks than planned and the cut never happens. The first token always comes alone,
        # so a cut after 1-3 chunks of an answer of at least half max_tokens (>= 8) lands mid-stream.
        max_tokens = max(max_tokens, cfg.max_tokens // 2, 8)
        cut_after_chunks = 1 + cut_after_chunks % 3
    return Plan(stream=stream, chat=rng.random() < cfg.p_chat, prompt=prompt, max_tokens=max_tokens,
                action=action, cut_after_chunks=cut_after_chunks, abort_after_s=rng.uniform(0.0, 0.5))


def request_body(plan: Plan) -> tuple[str, dict[str, Any]]:
    # ignore_eos: every completed request must have exactly max_tokens tokens, a checkable invariant.
    common = {"max_tokens": plan.max_tokens, "ignore_eos": True, "stream": plan.stream}
    if plan.stream:
        common["stream_options"] = {"include_usage": True}
    if plan.chat:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": plan.prompt}], **common}
    return "/v1/completions", {"prompt": plan.prompt, **common}


async def _read_stream(resp: httpx.Response, plan: Plan) -> str:
    chunks, done, finish, tokens = 0, False, None, None
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            return "error:stream_error_event"
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        if event.get("choices"):
            chunks += 1
            finish = event["choices"][0].get("finish_reason") or finish
        if plan.action == "disconnect" and chunks >= plan.cut_after_chunks:
            return "disconnected"  # leaving the `async with` closes the connection mid-stream
    if done and finish == "length" and tokens == plan.max_tokens:
        return "completed"
    return f"error:stream_incomplete(done={done},finish={finish},tokens={tokens})"


async def _send(client: httpx.AsyncClient, base_url: str, plan: Plan) -> str:
    path, body = request_body(plan)
    if plan.stream:
        async with client.stream("POST", base_url + path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return _rejected(resp.status_code)
            return await _read_stream(resp, plan)
    resp = await client.post(base_url + path, json=body)
    if resp.status_code != 200:
        return _rejected(resp.status_code)
    data = resp.json()
    ok = data["choices"][0]["finish_reason"] == "length" and data["usage"]["completion_tokens"] == plan.max_tokens
    return "completed" if ok else "error:bad_body"


def _rejected(status: int) -> str:
    return f"rejected_{status}" if status in (429, 503) else f"error:http_{status}"


async def run_one(client: httpx.AsyncClient, base_url: str, plan: Plan) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        if plan.action == "abort":
            # wait_for cancels the request task: httpx closes the connection, as a client that gives up does.
            outcome = await asyncio.wait_for(_send(client, base_url, plan), plan.abort_after_s)
        else:
            outcome = await _send(client, base_url, plan)
    except TimeoutError:
        outcome = "aborted"
    except httpx.HTTPError as exc:
        outcome = f"error:{type(exc).__name__}"
    return outcome, time.perf_counter() - start


async def run_requests(base_url: str, plans: list[Plan], concurrency: int,
                       timeout_s: float) -> list[tuple[str, float]]:
    """Send every plan with at most `concurrency` in flight; results in plan order."""
    results: list[tuple[str, float]] = [("error:not_run", 0.0)] * len(plans)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(plans)):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results[i] = await run_one(client, base_url, plans[i])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


# ---- the fleet, through Serve handles ---------------------------------------------------------------------
def replica_actor_names(app_name: str) -> list[str]:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(n for n in names if f"{app_name}#EngineReplica#" in n)


def fleet_stats(app_name: str, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """process_stats() of every live replica, by replica id.

    A handle call goes to one replica of the router's choosing; concurrent calls spread over the fleet (the
    router counts its own in-flight sends), so ask in rounds until every named replica has answered.
    """
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", app_name=app_name)
    wanted = {n.rsplit("#", 1)[-1] for n in replica_actor_names(app_name)}
    seen: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while not wanted <= seen.keys():
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas {sorted(wanted - seen.keys())} never answered process_stats")
        responses = [handle.process_stats.remote() for _ in range(4 * max(1, len(wanted)))]
        for r in responses:
            stats = r.result(timeout_s=timeout_s)
            seen[stats["replica_id"]] = stats
    return {rid: seen[rid] for rid in sorted(wanted)}


def is_idle(stats: dict[str, Any]) -> bool:
    return (stats["num_block_tables"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
            and stats["num_waiting"] == 0 and stats["num_running"] == 0)


def wait_fleet_idle(app_name: str, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Aborts are cleaned up asynchronously on the engine thread: poll until every replica is idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = fleet_stats(app_name)
        if all(is_idle(s) for s in stats.values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


# ---- the soak -----------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def run_soak(base_url: str, app_name: str, cfg: SoakConfig) -> dict[str, Any]:
    """Warm up, then run cfg.requests in `cfg.phases` phases, snapshotting the idle fleet after each.

    Memory is judged on the trend, not one before/after pair. A replica's RSS rises for the first few thousand
    requests even with no leak: oneDNN caches a primitive per new matmul shape (up to 1024 by default) and the
    allocator's heaps grow with new tensor sizes; both level off. A per-request leak grows linearly instead.
    So "flat" means: the last phase grew by at most `rss_settle_ratio` of the first phase's growth, or by less
    than `rss_growth_limit_bytes` in absolute terms.
    """
    rng = random.Random(cfg.seed)
    warm = [Plan(stream=i % 2 == 0, chat=i % 3 == 0, prompt="warm up " * (i % 20 + 1), max_tokens=16,
                 action="finish") for i in range(cfg.warmup)]
    asyncio.run(run_requests(base_url, warm, cfg.concurrency, cfg.request_timeout_s))
    snapshots = [wait_fleet_idle(app_name, cfg.idle_timeout_s)]
    plans = [make_plan(cfg, rng) for _ in range(cfg.requests)]
    results: list[tuple[str, float]] = []
    size = -(-len(plans) // cfg.phases)
    start = time.perf_counter()
    for k in range(0, len(plans), size):
        results += asyncio.run(run_requests(base_url, plans[k:k + size], cfg.concurrency, cfg.request_timeout_s))
        snapshots.append(wait_fleet_idle(app_name, cfg.idle_timeout_s))
    wall_s = time.perf_counter() - start
    return summarize(cfg, plans, results, snapshots, wall_s)


def summarize(cfg: SoakConfig, plans: list[Plan], results: list[tuple[str, float]],
              snapshots: list[dict[str, dict[str, Any]]], wall_s: float) -> dict[str, Any]:
    before, after = snapshots[0], snapshots[-1]
    outcomes = Counter(o for o, _ in results)
    by_action = {a: dict(Counter(o for (o, _), p in zip(results, plans, strict=True)
                                 if p.action == a))
                 for a in ("finish", "disconnect", "abort")}
    completed = [t for (o, t) in results if o == "completed"]
    same_fleet = all(s.keys() == before.keys() and all(s[r]["pid"] == before[r]["pid"] for r in before)
                     for s in snapshots)
    rss = {r: rss_trend([s[r]["rss_bytes"] for s in snapshots if r in s], cfg) for r in before if r in after}
    checks = {
        "all_accounted": sum(outcomes.values()) == len(plans),
        "no_errors": all(o in OK_OUTCOMES for o in outcomes),
        "all_blocks_free": all(is_idle(s) for s in after.values()),
        "no_replica_restarted": same_fleet,
        "memory_flat": all(v["flat"] for v in rss.values()),
    }
    return {"config": asdict(cfg), "wall_s": round(wall_s, 2), "requests_per_s": round(len(plans) / wall_s, 1),
            "outcomes": dict(outcomes), "outcomes_by_action": by_action,
            "completed_latency_s": {"p50": round(percentile(completed, 0.5), 3),
                                    "p99": round(percentile(completed, 0.99), 3)},
            "replicas_before": before, "replicas_after": after, "rss": rss, "checks": checks,
            "passed": all(checks.values())}


def rss_trend(series: list[int], cfg: SoakConfig) -> dict[str, Any]:
    """RSS after the warm-up and each phase; per-phase growth; whether it levels off (see run_soak)."""
    growth = [b - a for a, b in zip(series, series[1:], strict=False)]
    first, last = (growth[0], growth[-1]) if growth else (0, 0)
    flat = last < cfg.rss_growth_limit_bytes or last <= cfg.rss_settle_ratio * first
    return {"series_mib": [round(v / 2**20, 1) for v in series],
            "phase_growth_mib": [round(g / 2**20, 1) for g in growth], "flat": flat}


def print_table(summary: dict[str, Any]) -> None:
    print(f"\n{'outcome':<48}{'count':>8}")
    for outcome, count in sorted(summary["outcomes"].items()):
        print(f"{outcome:<48}{count:>8}")
    print(f"{'total':<48}{sum(summary['outcomes'].values()):>8}")
    print("\nby planned action:", json.dumps(summary["outcomes_by_action"]))
    for rid, v in summary["rss"].items():
        print(f"replica {rid}: rss MiB after warm-up and each phase {v['series_mib']}, "
              f"growth per phase {v['phase_growth_mib']}, flat: {v['flat']}")
    print("checks:", json.dumps(summary["checks"]), "wall", summary["wall_s"], "s")


# ---- standalone run: a local Ray cluster with the tiny test model -------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=SoakConfig.requests)
    parser.add_argument("--concurrency", type=int, default=SoakConfig.concurrency)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model", default=None, help="model path or name; default: a tiny random Llama")
    parser.add_argument("--phases", type=int, default=SoakConfig.phases)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import ray
    from ray import serve
    from ray.serve.api import _run

    from conveyor.router.app import build_app

    model = args.model
    if model is None:
        from tests.tiny_model import build_tiny_llama

        model = str(build_tiny_llama(Path(tempfile.mkdtemp(prefix="soak-tiny-"))))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app_args = {"model": model, "served_model_name": "soak", "num_replicas": args.replicas, "num_kv_blocks": 128,
                "max_num_seqs": 8, "max_waiting_requests": 16, "torch_num_threads": 1, "num_cpus": 1}
    try:
        _run(build_app(app_args), name="soak", route_prefix="/soak")  # blocks until running
        cfg = SoakConfig(requests=args.requests, concurrency=args.concurrency, phases=args.phases,
                         seed=args.seed)
        summary = run_soak(f"http://127.0.0.1:{port}/soak", "soak", cfg)
        summary["app_args"] = {k: v for k, v in app_args.items() if k != "model"}
    finally:
        serve.shutdown()
        ray.shutdown()
    print_table(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print("wrote", args.out)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
