"""xgrammar vs llguidance for structured outputs, on the SmolLM2 tokenizer (vocab 49152), CPU only.

For each case of tests/structured_cases.py and each library it measures:
- compile: schema -> ready matcher, cold (xgrammar: a fresh GrammarCompiler without cache per compile;
  llguidance: grammar_from_json_schema + LLMatcher construction). "first" is the first mask after it
  (llguidance builds its lexer lazily, so part of its compile shows there);
- mask: per-token bitmask fill while walking a valid instance's tokens (first token excluded), checking at
  each token that the mask allows it and the matcher accepts it, and at the end that it is complete and allows EOS;
- enforcement: whether the case's invalid instances are refused;
- batch: 32 matchers (cases round-robin) filling one [32, 1536] int32 bitmask per step, in a Python loop and with
  the parallel API (xgrammar BatchGrammarMatcher, llguidance LLExecutor + fill_next_token_bitmask_par);
- ingress: tokenizer-free validation (xgrammar Grammar.from_json_schema / from_regex / from_ebnf / from_lark,
  llguidance LLMatcher.validate_grammar), what bad inputs produce, which JSON Schema keywords are refused;
- GIL: the longest stall of a Python loop while another thread compiles (does compiling block the engine step?).

The two libraries sit behind one interface in grammar_adapters.py; the refusal and leak probes are in
grammar_probes.py.

    .venv/bin/pip install xgrammar==0.2.9              # not a dependency of Conveyor: only this comparison needs it
    .venv/bin/python -m benchmarks.grammar_libs        # table on stdout, JSON to benchmarks/out/grammar_libs.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from benchmarks.grammar_adapters import (
    THREADS,
    VOCAB,
    WORDS,
    Lib,
    LLGuidance,
    XGrammar,
    err_text,
    ms,
    pct,
    timed_compile,
    walk,
)
from benchmarks.grammar_probes import bad_inputs, ingress_validation, other_formats, probes
from tests.structured_cases import SCHEMA_CASES, SchemaCase, check_valid_instances

MODEL = Path("~/.cache/conveyor/models/SmolLM2-135M-Instruct").expanduser()
# benchmarks/out/ is git-ignored; $CONVEYOR_ARTIFACTS, when set, takes the results instead
OUT = Path(os.environ.get("CONVEYOR_ARTIFACTS") or Path(__file__).resolve().parent / "out") / "grammar_libs.json"
REPS = 3
BATCH = 32
BATCH_STEPS = 40



def bench_case(lib: Lib, case: SchemaCase, tok: Any) -> tuple[dict[str, Any], Any, list[int]]:
    compile_s, handle = [], None
    try:
        for _ in range(REPS):
            handle, dt = timed_compile(lib, "json", case.schema)
            compile_s.append(dt)
    except Exception as e:
        return {"accepted": False, "error": err_text(e)}, None, []
    token_lists = [tok.encode(json.dumps(x), add_special_tokens=False) for x in case.valid]
    walks = [walk(lib, handle, tokens, tok.eos_token_id) for tokens in token_lists]
    leaks = [i for i, x in enumerate(case.invalid)
             if not walk(lib, handle, tok.encode(json.dumps(x), add_special_tokens=False), tok.eos_token_id)[1]]
    return {
        "accepted": True,
        "compile_ms": [ms(s) for s in compile_s],
        "first_mask_ms": ms(walks[0][0][0]),
        "mask_us": [round(t * 1e6, 2) for times, _ in walks for t in times[1:]],
        "mismatches": [f"valid[{i}] {why}" for i, (_, why) in enumerate(walks) if why],
        "invalid_accepted": leaks,
    }, handle, token_lists[0]


def bench_batch(lib: Lib, handles: list[Any], seqs: list[list[int]]) -> dict[str, Any]:
    mats = [lib.matcher(handles[i % len(handles)]) for i in range(BATCH)]
    seqs = [seqs[i % len(seqs)] for i in range(BATCH)]
    pos, mask = [i % 3 for i in range(BATCH)], torch.full((BATCH, WORDS), -1, dtype=torch.int32)
    for i, m in enumerate(mats):  # stagger the starts
        for t in seqs[i][: pos[i]]:
            lib.accept(m, t)
    loop_s, par_s = [], []
    for _ in range(BATCH_STEPS):
        t0 = time.perf_counter()
        for i, m in enumerate(mats):
            lib.fill(m, mask, i)
        t1 = time.perf_counter()
        lib.batch_fill(mats, mask)
        par_s.append(time.perf_counter() - t1)
        loop_s.append(t1 - t0)
        advance(lib, mats, seqs, pos)
    return {"loop_ms_p50": ms(statistics.median(loop_s)), "loop_ms_p99": ms(pct(loop_s, 0.99)),
            "par_ms_p50": ms(statistics.median(par_s)), "par_ms_p99": ms(pct(par_s, 0.99))}


def advance(lib: Lib, mats: list[Any], seqs: list[list[int]], pos: list[int]) -> None:
    for i, m in enumerate(mats):
        if pos[i] == len(seqs[i]):
            lib.reset(m)
            pos[i] = 0
        if not lib.accept(m, seqs[i][pos[i]]):
            raise RuntimeError(f"{lib.name}: batch matcher {i} rejected a token")
        pos[i] += 1


def max_stall(fn: Callable[[], Any], seconds: float = 0.8) -> dict[str, float]:
    """Longest gap between iterations of a Python loop while another thread runs fn repeatedly."""
    stop, runs = threading.Event(), [0]

    def worker() -> None:
        while not stop.is_set():
            fn()
            runs[0] += 1

    th = threading.Thread(target=worker)
    th.start()
    worst, last, end = 0.0, time.perf_counter(), time.perf_counter() + seconds
    while (now := time.perf_counter()) < end:
        worst, last = max(worst, now - last), now
    stop.set()
    th.join()
    return {"max_stall_ms": ms(worst), "compiles": runs[0]}


def gil_check(libs: list[Lib], case: SchemaCase) -> dict[str, Any]:
    def ll_ready(lib: LLGuidance) -> None:
        lib.fill(lib.compile("json", case.schema), torch.zeros((1, WORDS), dtype=torch.int32), 0)

    out: dict[str, Any] = {"case": case.name, "idle": max_stall(lambda: time.sleep(0.01))}
    for lib in libs:
        fn = (lambda lib=lib: lib.compile("json", case.schema, threads=1)) if isinstance(lib, XGrammar) \
            else (lambda lib=lib: ll_ready(lib))
        out[lib.name] = max_stall(fn)
    return out


def setup() -> tuple[Any, list[Lib], dict[str, float]]:
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    t1 = time.perf_counter()
    xg = XGrammar(tok)
    t2 = time.perf_counter()
    ll = LLGuidance(tok)
    t3 = time.perf_counter()
    return tok, [xg, ll], {"hf_tokenizer_s": t1 - t0, "xgrammar_tokenizer_info_s": t2 - t1,
                           "llguidance_tokenizer_s": t3 - t2}


def summarize(cases: dict[str, dict[str, Any]], lib: str) -> dict[str, Any]:
    ok = [c[lib] for c in cases.values() if c[lib]["accepted"]]
    comp = [t for c in ok for t in c["compile_ms"]]
    mask = [t for c in ok for t in c["mask_us"]]
    first = [c["first_mask_ms"] for c in ok]
    return {"cases_accepted": len(ok), "compile_ms_p50": statistics.median(comp), "compile_ms_p99": pct(comp, 0.99),
            "first_mask_ms_p50": statistics.median(first), "first_mask_ms_max": max(first),
            "mask_us_mean": round(statistics.mean(mask), 2), "mask_us_p99": pct(mask, 0.99),
            "walk_mismatches": sum(len(c["mismatches"]) for c in ok),
            "invalid_instances_accepted": sum(len(c["invalid_accepted"]) for c in ok)}


def run_cases(libs: list[Lib], tok: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    handles: dict[str, list[Any]] = {lib.name: [] for lib in libs}
    seqs: dict[str, list[list[int]]] = {lib.name: [] for lib in libs}
    for case in SCHEMA_CASES:
        cases[case.name] = {}
        for lib in libs:
            cases[case.name][lib.name], handle, tokens = bench_case(lib, case, tok)
            if handle is not None and not cases[case.name][lib.name]["mismatches"]:
                handles[lib.name].append(handle)
                seqs[lib.name].append(tokens)
    batch = {lib.name: bench_batch(lib, handles[lib.name], seqs[lib.name]) for lib in libs}
    return cases, batch


def fmt_case(name: str, row: dict[str, Any], libs: list[Lib]) -> str:
    cells = []
    for lib in libs:
        r = row[lib.name]
        if not r["accepted"]:
            cells.append(f"{'REFUSED':>32}")
            continue
        flag = ("M" if r["mismatches"] else "") + ("L" if r["invalid_accepted"] else "")
        mask = r["mask_us"] or [float("nan")]
        cells.append(f"{statistics.median(r['compile_ms']):8.1f} {r['first_mask_ms']:7.2f} "
                     f"{statistics.mean(mask):7.1f} {pct(mask, 0.99):7.1f} {flag:2}")
    return f"{name:18} " + " | ".join(cells)


def print_report(res: dict[str, Any], libs: list[Lib]) -> None:
    names = [lib.name for lib in libs]
    print("per case: compile p50 ms, first mask ms, mask us/token mean, p99; flags M=walk mismatch, L=invalid leaked")
    print(f"{'case':18} " + " | ".join(f"{n:^32}" for n in names))
    for name, row in res["cases"].items():
        print(fmt_case(name, row, libs))
    print("\nsummary:")
    for n in names:
        print(f"  {n:11} {res['summary'][n]}")
        print(f"  {'':11} batch-32 fill per step: {res['batch'][n]}")
        print(f"  {'':11} ingress (no tokenizer): {res['ingress'][n]}")
    print(f"\nGIL (main-thread max stall while another thread compiles {res['gil']['case']}): "
          + ", ".join(f"{k}={v}" for k, v in res["gil"].items() if k != "case"))
    print("\nbad inputs: tokenizer-free check; then how the with-tokenizer compile reports it")
    for row in res["bad_inputs"]:
        print(f"  {row['name']} [{row['kind']}]")
        for n in names:
            how = row[n + "_compile"].split(" ")[0] + (" state" if row[n + "_compile"].startswith("error") else "")
            print(f"    {n:11} {row[n + '_no_tokenizer'][:100]:100} | compile: {how}")
    print("\nregex / choice / EBNF / Lark:")
    for row in res["other_formats"]:
        print(f"  {row['name'][:36]:36} " + " | ".join(f"{n}: {row[n][:60]}" for n in names))
    print("\nJSON Schema keyword probes (tokenizer-free):")
    for k, v in res["probes"]["keywords"].items():
        print(f"  {k:28} " + " | ".join(f"{n}: {v[n][:60]}" for n in names))
    print("\nschema-VALID outputs: does the grammar allow them (it should)?")
    for k, v in res["probes"]["valid_refused"].items():
        print(f"  {k:42} " + " | ".join(f"{n}: {v[n][:50]}" for n in names))
    print("\nschema-INVALID outputs: does the grammar allow them (it should not)?")
    for k, v in res["probes"]["invalid_allowed"].items():
        print(f"  {k:42} " + " | ".join(f"{n}: {v[n][:50]}" for n in names))


def main() -> None:
    argparse.ArgumentParser(prog="python -m benchmarks.grammar_libs", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    problems = check_valid_instances()
    if problems:
        raise SystemExit(f"structured_cases: {problems}")
    tok, libs, setup_s = setup()
    cases, batch = run_cases(libs, tok)
    slowest = max(SCHEMA_CASES, key=lambda c: statistics.median(cases[c.name]["xgrammar"].get("compile_ms", [0])))
    res = {"versions": {n: version(n) for n in ("xgrammar", "llguidance", "torch", "transformers")},
           "threads": THREADS, "vocab": VOCAB, "setup_s": setup_s, "cases": cases,
           "summary": {lib.name: summarize(cases, lib.name) for lib in libs}, "batch": batch,
           "ingress": ingress_validation(libs), "gil": gil_check(libs, slowest), "bad_inputs": bad_inputs(libs),
           "other_formats": other_formats(libs, tok), "probes": probes(libs, tok)}
    print_report(res, libs)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1, default=str))
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
