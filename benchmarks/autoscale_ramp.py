"""Load ramp against a Conveyor deployment: autoscaling versus a fixed single replica.

    python -m benchmarks.autoscale_ramp --model <dir or smollm2> [--served-name m] [--out benchmarks/out]

Starts a local Ray + Serve, deploys the model twice in turn (fixed: 1 replica; autoscaling: 1..N replicas
with conveyor's queue + latency policy), and runs the same ramp against each: light load, a step to heavy
load, then nothing. Streams every request and records, per second, p99 TTFT and ITL as the client sees them
and the number of running engine replicas. Reports the seconds from the load step to the first request
served by an added replica, and writes JSON + PNG. The load and timeline helpers are also used by
tests/metrics/test_autoscaling_e2e.py.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class Sample:
    start: float  # monotonic, relative to the timeline origin
    ttft_s: float | None
    itls: list[float]
    replica: str | None
    ok: bool


@dataclass
class Timeline:
    t0: float = field(default_factory=time.monotonic)
    samples: list[Sample] = field(default_factory=list)
    replicas: list[tuple[float, int, int]] = field(default_factory=list)  # (t, running, target-ish)
    events: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def mark(self, name: str) -> None:
        self.events[name] = self.now()

    def per_second(self) -> list[dict[str, Any]]:
        """p99 TTFT/ITL of requests started in each second, next to the replica count."""
        with self.lock:
            samples = list(self.samples)
        end = int(max([s.start for s in samples] + [r[0] for r in self.replicas] + [0])) + 1
        rows = []
        for sec in range(end):
            ttfts = sorted(s.ttft_s for s in samples if sec <= s.start < sec + 1 and s.ttft_s is not None)
            itls = sorted(x for s in samples if sec <= s.start < sec + 1 for x in s.itls)
            counts = [r[1] for r in self.replicas if sec <= r[0] < sec + 1]
            rows.append({"t": sec, "requests": len(ttfts), "ttft_p99_s": _p99(ttfts), "itl_p99_s": _p99(itls),
                         "replicas": max(counts) if counts else None})
        return rows

    def first_new_replica_served(self, after: float, initial: set[str]) -> float | None:
        with self.lock:
            times = [s.start + (s.ttft_s or 0) for s in self.samples
                     if s.ok and s.replica and s.replica not in initial and s.start >= after]
        return min(times) if times else None

    def to_json(self) -> dict[str, Any]:
        return {"events": self.events, "per_second": self.per_second(),
                "replicas": self.replicas, "samples": [asdict(s) for s in self.samples]}


def _p99(values: list[float]) -> float | None:
    return values[min(len(values) - 1, int(0.99 * len(values)))] if values else None


def stream_one(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int,
               timeline: Timeline) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    start = timeline.now()
    ttft, itls, replica, last, ok = None, [], None, None, False
    try:
        with client.stream("POST", url, json=body, timeout=120) as resp:
            ok = resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = timeline.now()
                if ttft is None:
                    ttft = now - start
                    replica = json.loads(line[6:]).get("system_fingerprint")
                else:
                    itls.append(now - last)
                last = now
    except httpx.HTTPError:
        ok = False
    with timeline.lock:
        timeline.samples.append(Sample(start, ttft, itls, replica, ok))


class Load:
    """`concurrency` closed-loop clients; change it at any time (the ramp), stop() ends all."""

    def __init__(self, base_url: str, model: str, timeline: Timeline, max_tokens: int = 64,
                 max_clients: int = 64) -> None:
        self.url = f"{base_url}/v1/completions"
        self.model, self.timeline, self.max_tokens = model, timeline, max_tokens
        self.concurrency = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True)
                         for i in range(max_clients)]
        for t in self._threads:
            t.start()

    def _worker(self, i: int) -> None:
        with httpx.Client() as client:
            n = 0
            while not self._stop.is_set():
                if i >= self.concurrency:
                    time.sleep(0.05)
                    continue
                stream_one(client, self.url, self.model, f"client {i} request {n}: tell me a story",
                           self.max_tokens, self.timeline)
                n += 1

    def stop(self, timeout_s: float = 60.0) -> None:
        self.concurrency = 0
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))


class ReplicaWatcher:
    """Records the number of RUNNING engine replicas of an app every `every_s` (serve.status())."""

    def __init__(self, app: str, timeline: Timeline, every_s: float = 0.5) -> None:
        self.app, self.timeline, self.every_s = app, timeline, every_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def running(self) -> int:
        return self.timeline.replicas[-1][1] if self.timeline.replicas else 0

    def total(self) -> int:
        """Replicas in any state: the policy's target as Serve acts on it, starting ones included."""
        return self.timeline.replicas[-1][2] if self.timeline.replicas else 0

    def _run(self) -> None:
        from ray import serve

        while not self._stop.is_set():
            try:
                app = serve.status().applications.get(self.app)
                dep = app.deployments.get("EngineReplica") if app else None
                states = dep.replica_states if dep else {}
                running = int(states.get("RUNNING", 0))
                total = int(sum(states.values()))
                self.timeline.replicas.append((self.timeline.now(), running, total))
            except Exception:  # noqa: BLE001 - a missed sample is fine
                pass
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)


def plot(timelines: dict[str, Timeline], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for name, tl in timelines.items():
        rows = tl.per_second()
        t = [r["t"] for r in rows]
        axes[0].plot(t, [r["ttft_p99_s"] for r in rows], label=name)
        axes[1].plot(t, [r["itl_p99_s"] for r in rows], label=name)
        axes[2].step([r[0] for r in tl.replicas], [r[1] for r in tl.replicas], where="post", label=name)
        for event, at in tl.events.items():
            for ax in axes:
                ax.axvline(at, color="grey", linestyle=":", linewidth=0.8)
            axes[2].annotate(event, (at, 0.1), rotation=90, fontsize=7)
    axes[0].set_ylabel("p99 TTFT (s)")
    axes[1].set_ylabel("p99 ITL (s)")
    axes[2].set_ylabel("running replicas")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ramp(base_url: str, app: str, model: str, low: int, high: int, low_s: float, high_s: float,
         tail_s: float, max_tokens: int) -> Timeline:
    tl = Timeline()
    watcher = ReplicaWatcher(app, tl)
    load = Load(base_url, model, tl, max_tokens=max_tokens, max_clients=high)
    try:
        tl.mark("low load")
        load.concurrency = low
        time.sleep(low_s)
        tl.mark("step")
        load.concurrency = high
        time.sleep(high_s)
        tl.mark("load stops")
        load.concurrency = 0
        time.sleep(tail_s)
    finally:
        load.stop()
        watcher.stop()
    return tl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-name", default="ramp")
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--low", type=int, default=2)
    parser.add_argument("--high", type=int, default=16)
    parser.add_argument("--low-s", type=float, default=10)
    parser.add_argument("--high-s", type=float, default=40)
    parser.add_argument("--tail-s", type=float, default=25)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("CONVEYOR_ARTIFACTS") or "benchmarks/out")
    args = parser.parse_args(argv)

    import socket

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve
    from ray.serve.api import _run

    from conveyor.router.app import build_app

    ray.init(num_cpus=args.max_replicas + 1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = {"model": args.model, "served_model_name": args.served_name, "max_num_seqs": args.max_num_seqs,
            "num_kv_blocks": 256, "torch_num_threads": 1, "num_cpus": 1}
    autoscaling = {"min_replicas": 1, "max_replicas": args.max_replicas, "target_queue_per_replica": 2,
                   "ttft_p99_slo_s": 2.0, "itl_p99_slo_s": 0.5, "upscale_delay_s": 0.5,
                   "downscale_delay_s": 5, "scale_in_sustain_s": 5, "metrics_interval_s": 0.5,
                   "look_back_period_s": 1}
    timelines: dict[str, Timeline] = {}
    summary: dict[str, Any] = {}
    for name, extra in (("fixed-1", {"num_replicas": 1}), ("autoscaling", {"autoscaling": autoscaling})):
        _run(build_app({**base, **extra}), name=name, route_prefix=f"/{name}", _blocking=True)
        tl = ramp(f"http://127.0.0.1:{port}/{name}", name, args.served_name, args.low, args.high, args.low_s,
                  args.high_s, args.tail_s, args.max_tokens)
        serve.delete(name)
        timelines[name] = tl
        initial = {s.replica for s in tl.samples if s.start < tl.events["step"] and s.replica}
        served = tl.first_new_replica_served(tl.events["step"], initial)
        scaled = next((t for t, running, _ in tl.replicas if t > tl.events["step"] and running > 1), None)
        summary[name] = {"added_replica_running_s": None if scaled is None else scaled - tl.events["step"],
                         "added_replica_serving_s": None if served is None else served - tl.events["step"],
                         "max_replicas": max((r[1] for r in tl.replicas), default=0),
                         "requests": len(tl.samples), "failed": sum(1 for s in tl.samples if not s.ok)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "autoscale_ramp.json").write_text(json.dumps(
        {"args": vars(args), "summary": summary, **{k: v.to_json() for k, v in timelines.items()}}, indent=1))
    plot(timelines, out / "autoscale_ramp.png", "Conveyor load ramp: autoscaling vs fixed single replica")
    print(json.dumps(summary, indent=2))
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
