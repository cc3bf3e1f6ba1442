"""JSON a client sends, parsed so that hostile input is a ValueError (HTTP 400), never a server error.

Python's json module turns such input into other exceptions, or into values the rest of the server cannot carry:
- 100,000 '[' raise RecursionError (the decoder recurses once per level);
- an integer of more than 4,300 digits raises ValueError from int() (Python's digit limit), not JSONDecodeError;
- NaN, Infinity and -Infinity are accepted although they are not JSON;
- "\\ud800" decodes to a lone surrogate, a str that cannot be encoded as UTF-8 (the tokenizer fails on it).
A depth limit also bounds every recursive walk downstream (pydantic, canonical_json, the grammar compiler).
"""
from __future__ import annotations

import json
import re
from typing import Any

# Nesting a request body may have (objects and arrays). A chat request with tools and a JSON schema rarely passes
# 20; vLLM sets no limit, and deep schemas compile slowly and recursively.
MAX_JSON_DEPTH = 64
# Only an escaped surrogate can produce a lone one (raw UTF-8 cannot encode it): scan for the escape first.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JsonLimitError(ValueError):
    """Valid JSON past a limit (depth) or with a lone surrogate: refused even where malformed JSON is tolerated.
    `code` is the OpenAI error code the ingress answers with."""

    def __init__(self, message: str, code: str = "invalid_json") -> None:
        super().__init__(message)
        self.code = code


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH, what: str = "request body") -> Any:
    """json.loads with every failure a ValueError that names `what`; the value has at most max_depth levels of
    nesting and no lone surrogate in any string (keys included)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{what} is not valid UTF-8") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise JsonLimitError(f"{what} is nested more than {max_depth} levels deep") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    except ValueError as exc:  # int()'s digit limit, or a NaN/Infinity constant
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    # Counting brackets costs two C scans; only a text that could be too deep is walked.
    deep = text.count("[") + text.count("{") > max_depth
    check_value(value, max_depth=max_depth if deep else None,
                surrogates=_SURROGATE_ESCAPE.search(text) is not None, what=what)
    return value


def check_value(value: Any, *, max_depth: int | None = MAX_JSON_DEPTH, surrogates: bool = True,
                what: str = "value") -> None:
    """Raise ValueError if `value` (parsed JSON: dicts, lists, scalars) nests deeper than max_depth (None: no
    limit) or, when `surrogates`, holds a string that is not valid Unicode. Iterative: linear in the containers
    and strings, with no recursion of its own."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = list(node.values())
            if surrogates:
                children += list(node.keys())
        elif isinstance(node, list):
            children = node
        else:
            if surrogates and isinstance(node, str):
                _check_unicode(node, what)
            continue
        depth += 1
        if max_depth is not None and depth > max_depth:
            raise JsonLimitError(f"{what} is nested more than {max_depth} levels deep")
        stack.extend((child, depth) for child in children if surrogates or isinstance(child, (dict, list)))


def _check_unicode(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise JsonLimitError(f"{what} holds a string that is not valid Unicode (a lone surrogate)",
                             code="invalid_value") from None
