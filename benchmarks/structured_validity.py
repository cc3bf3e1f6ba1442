"""Structured outputs that read like the model: the share of outputs that are valid JSON within max_tokens.

A correctness rate, not a timing. Sends a fixed set of chat requests to an OpenAI-compatible server: json_object
prompts ("List two fruits in JSON.", ...) and one json_schema request per schema of tests/structured_cases.py
(the schema also in the prompt, as a user would write it), each greedy and sampled with a fixed seed. Reports the
share of outputs that parse as JSON, the share valid for their constraint (a JSON object for json_object; the
schema, with jsonschema's format checker, for json_schema), mean output tokens, finish reasons, and the longest
whitespace run seen (a grammar that lets whitespace run unbounded shows it here). A forced layout that pushes a
small model off its distribution shows as outputs cut at max_tokens ("length") that never close their JSON.

    .venv/bin/python -m benchmarks.structured_validity --start conveyor   # starts `conveyor serve`, stops it after
    .venv/bin/python -m benchmarks.structured_validity --start vllm       # `vllm serve` (.vllm-venv, xgrammar)
    .venv/bin/python -m benchmarks.structured_validity --url http://127.0.0.1:8000   # a server already running

A 429 (admission control) is sent again after its Retry-After. Results (every request's text too) go to --out,
by default benchmarks/out/structured_validity_<target>.json.
~3-6 min per server on 2 cores with SmolLM2 (34 requests, max_tokens 256, 4 at a time).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "benchmarks" / "out"

JSON_OBJECT_PROMPTS = [
    "List two fruits in JSON.",
    "Describe a cat with its name, age and color as a JSON object.",
    "Give the capitals of France, Germany and Italy in JSON.",
    "Return the days of the week in JSON.",
]
SAMPLED = {"temperature": 0.7, "top_p": 0.9}
WHITESPACE_RUN = re.compile(r"\s+")
MAX_RETRIES = 60


def build_requests(max_tokens: int, seed: int) -> list[dict[str, Any]]:
    """(name, body, schema) per request: json_object prompts and the test schemas, each greedy and sampled."""
    from tests.structured_cases import SCHEMA_CASES

    cases: list[tuple[str, str, dict[str, Any], dict[str, Any] | None]] = []
    for i, prompt in enumerate(JSON_OBJECT_PROMPTS):
        cases.append((f"json_object_{i}", prompt, {"type": "json_object"}, None))
    for case in SCHEMA_CASES:
        prompt = (f"Write an example of {case.name.replace('_', ' ')} as JSON that follows this schema: "
                  f"{json.dumps(case.schema)}")
        fmt = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema}}
        cases.append((case.name, prompt, fmt, case.schema))
    requests = []
    for k, (name, prompt, fmt, schema) in enumerate(cases):
        for mode, sampling in (("greedy", {"temperature": 0.0}), ("sampled", SAMPLED | {"seed": seed + k})):
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "response_format": fmt} | sampling
            requests.append({"name": name, "mode": mode, "body": body, "schema": schema})
    return requests


def judge(text: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    """parses: json.loads succeeds; valid: it is an object (json_object) or follows the schema (json_schema)."""
    import jsonschema

    runs = [len(m) for m in WHITESPACE_RUN.findall(text)]
    verdict = {"parses": False, "valid": False, "max_whitespace_run": max(runs, default=0),
               "whitespace_share": round(sum(runs) / len(text), 3) if text else 0.0}
    try:
        value = json.loads(text)
    except ValueError:
        return verdict
    verdict["parses"] = True
    if schema is None:
        verdict["valid"] = isinstance(value, dict)
        return verdict
    try:
        jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        verdict["valid"] = True
    except jsonschema.ValidationError as exc:
        verdict["error"] = exc.message[:200]
    return verdict


def send(client: httpx.Client, url: str, model: str, request: dict[str, Any]) -> dict[str, Any]:
    """One request; a 429 (a server's admission control) is sent again after its Retry-After, as a client would."""
    row = {"name": request["name"], "mode": request["mode"], "num_retries": 0}
    start = time.monotonic()
    while True:
        resp = client.post(url + "/v1/chat/completions", json=request["body"] | {"model": model})
        if resp.status_code != 429 or row["num_retries"] >= MAX_RETRIES:
            break
        row["num_retries"] += 1
        time.sleep(float(resp.headers.get("retry-after") or 1.0))
    row["latency_s"] = round(time.monotonic() - start, 2)
    if resp.status_code != 200:
        return row | {"status": resp.status_code, "error": resp.text[:300], "parses": False, "valid": False}
    data = resp.json()
    choice = data["choices"][0]
    text = choice["message"].get("content") or ""
    return row | {"status": 200, "finish_reason": choice["finish_reason"],
                  "completion_tokens": data["usage"]["completion_tokens"], "text": text} | judge(text,
                                                                                               request["schema"])


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def share(key: str, subset: list[dict[str, Any]]) -> float:
        return round(sum(bool(r.get(key)) for r in subset) / len(subset), 3) if subset else 0.0

    summary: dict[str, Any] = {"requests": len(rows), "errors": sum(r.get("status") != 200 for r in rows),
                               "retries_after_429": sum(r["num_retries"] for r in rows)}
    groups = {"all": rows, "json_object": [r for r in rows if r["name"].startswith("json_object")],
              "json_schema": [r for r in rows if not r["name"].startswith("json_object")],
              "greedy": [r for r in rows if r["mode"] == "greedy"],
              "sampled": [r for r in rows if r["mode"] == "sampled"]}
    for group, subset in groups.items():
        summary[group] = {"parses": share("parses", subset), "valid": share("valid", subset)}
    ok = [r for r in rows if r.get("status") == 200]
    summary["mean_output_tokens"] = round(statistics.mean(r["completion_tokens"] for r in ok), 1) if ok else 0.0
    summary["finish_reasons"] = dict(Counter(r.get("finish_reason") for r in ok))
    summary["max_whitespace_run"] = max((r["max_whitespace_run"] for r in ok), default=0)
    summary["mean_whitespace_share"] = round(statistics.mean(r["whitespace_share"] for r in ok), 3) if ok else 0.0
    return summary


def run(url: str, max_tokens: int, seed: int, concurrency: int, timeout_s: float) -> dict[str, Any]:
    requests = build_requests(max_tokens, seed)
    with httpx.Client(timeout=timeout_s) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        with ThreadPoolExecutor(concurrency) as pool:
            rows = list(pool.map(lambda r: send(client, url, model, r), requests))
    return {"url": url, "model": model, "max_tokens": max_tokens, "seed": seed, "sampled": SAMPLED,
            "summary": summarize(rows), "rows": rows}


def start(target: str, args: argparse.Namespace) -> tuple[Any, set[int], str]:
    """Start `conveyor serve` or `vllm serve` as benchmarks/peer_serve.py does (vLLM with its recommended CPU
    set-up); returns (process, pids before, url)."""
    from benchmarks.compare import DEFAULT_VLLM_PYTHON, free_port
    from benchmarks.peer_serve import start_conveyor, start_vllm, wait_ready
    from benchmarks.proc_cpu import snapshot

    ns = argparse.Namespace(model="smollm2", dtype="float32", kv_cache_dtype="auto", conveyor_env=[],
                            conveyor_arg=[], vllm_arg=[], vllm_python=args.vllm_python or str(DEFAULT_VLLM_PYTHON))
    before = snapshot()
    port = free_port()
    proc = (start_conveyor if target == "conveyor" else start_vllm)(ns, port)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, "smollm2", proc, args.start_timeout_s)
    return proc, before, url


def report(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [f"{result['target']} ({result['model']}, {s['requests']} requests, max_tokens {result['max_tokens']})",
             "group        parses  valid"]
    lines += [f"{g:<12} {s[g]['parses']:>6.1%} {s[g]['valid']:>6.1%}"
              for g in ("all", "json_object", "json_schema", "greedy", "sampled")]
    lines.append(f"mean output tokens {s['mean_output_tokens']}, finish reasons {s['finish_reasons']}, "
                 f"longest whitespace run {s['max_whitespace_run']}, errors {s['errors']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="an OpenAI-compatible server already running (its first /v1/models entry)")
    where.add_argument("--start", choices=["conveyor", "vllm"], help="start this server (default model), stop it after")
    p.add_argument("--target", help="the name in the results (default: --start's, else 'server')")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the first sampled request (then +1 each)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per request")
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--vllm-python", help="vLLM's interpreter (default .vllm-venv/bin/python)")
    p.add_argument("--out", type=Path, help="result JSON (default benchmarks/out/structured_validity_<target>.json)")
    args = p.parse_args()
    target = args.target or args.start or "server"
    proc = None
    if args.start:
        proc, before, url = start(args.start, args)
    else:
        url = args.url.rstrip("/")
    try:
        result = {"target": target} | run(url, args.max_tokens, args.seed, args.concurrency, args.timeout_s)
    finally:
        if proc is not None:
            from benchmarks.peer_serve import stop_all

            stop_all(proc, before)
    out = args.out or OUT_DIR / f"structured_validity_{target}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
