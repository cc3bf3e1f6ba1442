"""What each structured-output library refuses or lets through, for benchmarks/grammar_libs.py: bad schemas,
regexes and grammars (with and without a tokenizer), the other grammar formats, tokenizer-free validation of the
good cases, JSON Schema keywords, and outputs that are valid (or invalid) under JSON Schema.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any

from benchmarks.grammar_adapters import Lib, LLGuidance, err_text, ms, timed_compile, walk
from tests.structured_cases import (
    BAD_GRAMMARS,
    BAD_REGEXES,
    BAD_SCHEMAS,
    CHOICES,
    GRAMMARS,
    REGEXES,
    SCHEMA_CASES,
)

_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
KEYWORD_PROBES: dict[str, dict[str, Any]] = {
    "unknown key 'frobnicate'": {"type": "object", "frobnicate": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "not": {"type": "string", "not": {"const": "x"}},
    "if/then/else": {"type": "object", "properties": _AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    "contains": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}},
    "minProperties": {"type": "object", "properties": _AB, "minProperties": 1},
    "dependentRequired": {"type": "object", "properties": _AB, "dependentRequired": {"a": ["b"]}},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "format: ipv4": {"type": "string", "format": "ipv4"},
    "format: unknown-fmt": {"type": "string", "format": "unknown-fmt"},
}

# instances valid under JSON Schema; a library that refuses one restricts output beyond the schema
SEMANTIC_PROBES: list[tuple[str, dict[str, Any], str]] = [
    ("extra property (no additionalProperties)", {"type": "object", "properties": {"a": {"type": "integer"}}},
     '{"a": 1, "b": 2}'),
    ("properties out of declared order", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                          "b": {"type": "integer"}}},
     '{"b": 1, "a": 2}'),
    ("pretty-printed (indent=2)", SCHEMA_CASES[0].schema, json.dumps(SCHEMA_CASES[0].valid[0], indent=2)),
    ("unanchored pattern (spec: search)", {"type": "string", "pattern": "[0-9]+"}, '"ab12"'),
    ("bare {'type': 'object'} with a key", {"type": "object"}, '{"k": 1}'),
    ("items-less {'type': 'array'} with items", {"type": "array"}, "[1, 2]"),
    ("patternProperties key", KEYWORD_PROBES["patternProperties"], '{"x_a": 1}'),
]


# instances invalid under JSON Schema; a library that allows one does not enforce the keyword
LEAK_PROBES: list[tuple[str, dict[str, Any], str]] = [
    ("uniqueItems", KEYWORD_PROBES["uniqueItems"], "[1, 1]"),
    ("not", KEYWORD_PROBES["not"], '"x"'),
    ("dependentRequired", KEYWORD_PROBES["dependentRequired"], '{"a": 1}'),
    ("minProperties", KEYWORD_PROBES["minProperties"], "{}"),
    ("contains", KEYWORD_PROBES["contains"], "[2]"),
    ("if/then", KEYWORD_PROBES["if/then/else"], '{"a": 1}'),
    ("multipleOf", KEYWORD_PROBES["multipleOf"], "7"),
    ("allOf required", KEYWORD_PROBES["allOf"], "{}"),
    ("patternProperties", KEYWORD_PROBES["patternProperties"], '{"x_a": "s"}'),
    ("format: ipv4", KEYWORD_PROBES["format: ipv4"], '"999.1.1.1"'),
]


def as_src(value: Any) -> Any:
    return value if isinstance(value, str | dict) else json.dumps(value)


def bad_input(libs: list[Lib], kind: str, name: str, src: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name}
    for lib in libs:
        row[lib.name + "_no_tokenizer"] = lib.validate(kind, src) or "ACCEPTED"
        try:
            lib.compile(kind, src)
            row[lib.name + "_compile"] = "ACCEPTED"
        except Exception as e:
            how = "error state" if isinstance(lib, LLGuidance) and isinstance(e, RuntimeError) else "raises"
            row[lib.name + "_compile"] = f"{how} {err_text(e)}"
    return row


def bad_inputs(libs: list[Lib]) -> list[dict[str, Any]]:
    rows = [dict(bad_input(libs, "json", b.name, as_src(b.value)), kind=b.kind) for b in BAD_SCHEMAS]
    rows += [dict(bad_input(libs, "regex", f"regex {r!r}", r), kind="invalid") for r in BAD_REGEXES]
    rows += [dict(bad_input(libs, g.syntax, g.name, g.text), kind="invalid") for g in BAD_GRAMMARS]
    return rows


def other_formats(libs: list[Lib], tok: Any) -> list[dict[str, Any]]:
    items = [("regex", f"regex {r!r}", r, v) for r, v in REGEXES]
    items += [("choice", f"choice {c}", c, c[:1]) for c in CHOICES]
    items += [(g.syntax, g.name, g.text, g.valid) for g in GRAMMARS]
    rows = []
    for kind, name, src, valid in items:
        row: dict[str, Any] = {"name": name}
        for lib in libs:
            try:
                handle, dt = timed_compile(lib, kind, src)
            except Exception as e:
                row[lib.name] = "REFUSED " + err_text(e)
                continue
            bad = [why for v in valid if (why := walk(lib, handle, tok.encode(v, add_special_tokens=False),
                                                      tok.eos_token_id)[1])]
            row[lib.name] = f"ok {ms(dt)} ms" + (f" MISMATCH {bad}" if bad else "")
        rows.append(row)
    return rows


def ingress_validation(libs: list[Lib]) -> dict[str, Any]:
    """Tokenizer-free validation of every good case: time and false refusals."""
    out: dict[str, Any] = {}
    for lib in libs:
        times, refused = [], []
        for case in SCHEMA_CASES:
            t0 = time.perf_counter()
            err = lib.validate("json", case.schema)
            times.append(time.perf_counter() - t0)
            if err:
                refused.append(f"{case.name}: {err}")
        out[lib.name] = {"ms_p50": ms(statistics.median(times)), "ms_max": ms(max(times)), "refused_good": refused}
    return out


def probes(libs: list[Lib], tok: Any) -> dict[str, Any]:
    keywords = {k: {lib.name: lib.validate("json", s) or "accepted" for lib in libs} for k, s in KEYWORD_PROBES.items()}
    def run(probe_list: list[tuple[str, dict[str, Any], str]]) -> dict[str, dict[str, str]]:
        return {name: {lib.name: probe_walk(lib, schema, tok.encode(text, add_special_tokens=False), tok.eos_token_id)
                       for lib in libs} for name, schema, text in probe_list}

    return {"keywords": keywords, "valid_refused": run(SEMANTIC_PROBES), "invalid_allowed": run(LEAK_PROBES)}


def probe_walk(lib: Lib, schema: dict[str, Any], tokens: list[int], eos: int) -> str:
    try:
        return walk(lib, lib.compile("json", schema), tokens, eos)[1] or "allowed"
    except Exception as e:
        return "REFUSED " + err_text(e)
