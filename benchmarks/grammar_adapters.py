"""The two structured-output libraries behind one interface, for benchmarks/grammar_libs.py: compile a grammar
(JSON Schema, regex, choice, GBNF/EBNF, Lark), check one without a tokenizer, fill token bitmasks (one row, or a
batch in parallel), accept tokens; and a walk of a token sequence through a matcher, timing each mask.
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance import LLExecutor, LLMatcher

try:  # not a dependency of Conveyor: only the comparison needs it, so the rest of this module works without it
    import xgrammar as xgr
except ModuleNotFoundError:
    xgr = None

VOCAB = 49152  # SmolLM2's
WORDS = VOCAB // 32  # int32 words of one bitmask row
THREADS = os.cpu_count() or 2


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def err_text(e: BaseException | str) -> str:
    """One line: the message without xgrammar's '[time] file.cc:line: ' prefix and llguidance's source excerpts."""
    lines = [t.strip() for t in str(e).splitlines() if t.strip() and not set(t.strip()) <= {"^"}]
    text = re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", " / ".join(lines))
    return ((type(e).__name__ + ": ") if isinstance(e, BaseException) else "") + text[:150]


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Any) -> None:
        if xgr is None:
            raise SystemExit("xgrammar is not installed: .venv/bin/pip install xgrammar==0.2.9")
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
        self.batcher = xgr.BatchGrammarMatcher(max_threads=THREADS)

    def compile(self, kind: str, src: Any, threads: int = THREADS) -> Any:
        c = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(src)
        if kind == "regex":
            return c.compile_regex(src)
        if kind == "lark":
            return c.compile_lark(src)
        return c.compile_grammar(xgr.Grammar.from_ebnf(choice_ebnf(src) if kind == "choice" else src))

    @staticmethod
    def validate(kind: str, src: Any) -> str:
        """Tokenizer-free check: '' when accepted, else the error."""
        make = {"json": xgr.Grammar.from_json_schema, "regex": xgr.Grammar.from_regex, "gbnf": xgr.Grammar.from_ebnf,
                "lark": xgr.Grammar.from_lark}[kind]
        try:
            make(src)
            return ""
        except Exception as e:
            return "raises " + err_text(e)

    def matcher(self, handle: Any) -> Any:
        return xgr.GrammarMatcher(handle)

    def fill(self, m: Any, mask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(mask, row)

    def batch_fill(self, ms_: list[Any], mask: torch.Tensor) -> None:
        self.batcher.batch_fill_next_token_bitmask(ms_, mask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.is_completed()

    def reset(self, m: Any) -> None:
        m.reset()


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Any) -> None:
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
        self.executor = LLExecutor(num_threads=THREADS)

    @staticmethod
    def grammar(kind: str, src: Any) -> str:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(src)
        return llguidance.grammar_from(kind, json.dumps(src) if kind == "choice" else src)

    def compile(self, kind: str, src: Any, threads: int = THREADS) -> Any:
        m = LLMatcher(self.tok, self.grammar(kind, src))
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    @classmethod
    def validate(cls, kind: str, src: Any) -> str:
        try:
            grammar = cls.grammar(kind, src)
        except Exception as e:
            return "raises " + err_text(e)
        is_error, msgs = LLMatcher.validate_grammar_with_warnings(grammar)
        return ("returns " + err_text(msgs[0])) if is_error else ""

    def matcher(self, handle: Any) -> Any:
        return handle.deep_copy()

    def fill(self, m: Any, mask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(m, mask, row)

    def batch_fill(self, ms_: list[Any], mask: torch.Tensor) -> None:
        llguidance.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms_)], mask)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m: Any) -> bool:
        return m.is_accepting()

    def reset(self, m: Any) -> None:
        m.reset()


Lib = XGrammar | LLGuidance


def allowed(mask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(mask[row, token >> 5]) >> (token & 31)) & 1)


def walk(lib: Lib, handle: Any, tokens: list[int], eos: int) -> tuple[list[float], str]:
    """Fill + accept each token; returns the fill times and '' or the first mismatch."""
    m, mask, times = lib.matcher(handle), torch.zeros((1, WORDS), dtype=torch.int32), []
    for i, token in enumerate(tokens):
        t0 = time.perf_counter()
        lib.fill(m, mask, 0)
        times.append(time.perf_counter() - t0)
        if not allowed(mask, 0, token):
            return times, f"token {i}/{len(tokens)} masked out"
        if not lib.accept(m, token):
            return times, f"token {i}/{len(tokens)} rejected"
    lib.fill(m, mask, 0)
    return times, "" if lib.done(m) and allowed(mask, 0, eos) else "incomplete at end / EOS masked"


def timed_compile(lib: Lib, kind: str, src: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    handle = lib.compile(kind, src)
    return handle, time.perf_counter() - t0
