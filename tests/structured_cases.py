"""Shared inputs for structured outputs (JSON schema, regex, choice, EBNF/Lark): no tests here.

Import from tests and benchmarks (``from tests.structured_cases import SCHEMA_CASES``):

- ``SCHEMA_CASES``: realistic JSON schemas, each with 1-2 ``valid`` instances (checked by ``check_valid_instances``
  with ``jsonschema`` and its format checker) and optionally ``invalid`` instances that a grammar enforcing the
  schema must refuse (used to see which keywords a grammar library really enforces).
- ``BAD_SCHEMAS``: inputs the ingress must refuse with a 400. ``kind`` says why: "invalid" (not a schema / cannot be
  resolved), "unsupported" (valid JSON Schema whose keywords a grammar cannot enforce), "unsatisfiable" (valid but
  no instance exists). A ``str`` schema is raw request text (it may not even be JSON); anything else is the parsed
  JSON value.
- ``REGEXES`` / ``BAD_REGEXES``, ``CHOICES``, ``GRAMMARS`` / ``BAD_GRAMMARS`` (``syntax`` is "gbnf" or "lark").

String formats: xgrammar 0.2.9 and llguidance 1.9.1 both accept and enforce ``date``, ``date-time``, ``time``,
``email`` and ``uuid`` (also ``uri``, ``ipv4``, ``hostname``, ``duration``). ``jsonschema`` here checks ``date``,
``email`` and ``uuid`` only: ``date-time`` needs the optional ``rfc3339-validator`` package, so it is not checked.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    valid: list[Any]
    invalid: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class BadInput:
    name: str
    value: Any
    kind: str  # "invalid" | "unsupported" | "unsatisfiable"


@dataclass(frozen=True)
class GrammarCase:
    name: str
    syntax: str  # "gbnf" | "lark"
    text: str
    valid: list[str] = field(default_factory=list)


_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"type": "string", "enum": ["US", "DE", "FR", "JP"]},
    },
    "required": ["street", "city", "country"],
    "additionalProperties": False,
}

SCHEMA_CASES: list[SchemaCase] = [
    SchemaCase(
        "primitives",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 40},
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "active": {"type": "boolean"},
                "deleted_at": {"type": "null"},
            },
            "required": ["title", "count", "ratio", "active", "deleted_at"],
            "additionalProperties": False,
        },
        [{"title": "Widget", "count": 3, "ratio": 0.25, "active": True, "deleted_at": None}],
        [{"title": "", "count": 3, "ratio": 0.25, "active": True, "deleted_at": None}],
    ),
    SchemaCase(
        "nested_objects",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string"},
                "customer": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "shipping": _ADDRESS,
                    },
                    "required": ["name", "shipping"],
                    "additionalProperties": False,
                },
                "total": {"type": "number", "minimum": 0},
            },
            "required": ["order_id", "customer", "total"],
            "additionalProperties": False,
        },
        [{"order_id": "A-17", "customer": {"name": "Ann Lee", "shipping": {
            "street": "1 Main St", "city": "Springfield", "postal_code": "12345", "country": "US"}}, "total": 19.99}],
    ),
    SchemaCase(
        "array_bounds",
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
                "scores": {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3},
            },
            "required": ["tags", "scores"],
            "additionalProperties": False,
        },
        [{"tags": ["red"], "scores": [1, 2, 3]}, {"tags": ["a", "b", "c", "d"], "scores": [0, -5, 10]}],
        [{"tags": [], "scores": [1, 2, 3]}, {"tags": ["a"], "scores": [1, 2]}],
    ),
    SchemaCase(
        "enums",
        {
            "type": "object",
            "properties": {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "priority": {"enum": [1, 2, 3, None]},
                "channel": {"type": "string", "enum": ["email", "sms", "push"]},
            },
            "required": ["sentiment", "priority", "channel"],
            "additionalProperties": False,
        },
        [{"sentiment": "neutral", "priority": None, "channel": "sms"}],
        [{"sentiment": "angry", "priority": 1, "channel": "sms"}],
    ),
    SchemaCase(
        "optional_fields",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "nickname": {"type": "string"},
                "age": {"type": "integer"},
                "notes": {"type": "string"},
            },
            "required": ["id"],
            "additionalProperties": False,
        },
        [{"id": 7}, {"id": 8, "age": 41, "notes": "prefers email"}],
        [{"nickname": "no id"}],
    ),
    SchemaCase(
        "refs_defs",
        {
            "$defs": {
                "money": {
                    "type": "object",
                    "properties": {
                        "amount": {"type": "number"},
                        "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    },
                    "required": ["amount", "currency"],
                    "additionalProperties": False,
                },
                "line": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "price": {"$ref": "#/$defs/money"}},
                    "required": ["sku", "price"],
                    "additionalProperties": False,
                },
            },
            "type": "object",
            "properties": {
                "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}},
                "total": {"$ref": "#/$defs/money"},
            },
            "required": ["lines", "total"],
            "additionalProperties": False,
        },
        [{"lines": [{"sku": "X1", "price": {"amount": 2.5, "currency": "EUR"}}],
          "total": {"amount": 2.5, "currency": "EUR"}}],
        [{"lines": [], "total": {"amount": 1, "currency": "euro"}}],
    ),
    SchemaCase(
        "recursive_tree",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "label": {"type": "string"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["label", "children"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        [{"label": "root", "children": [{"label": "a", "children": []}, {"label": "b", "children": [
            {"label": "b1", "children": []}]}]}],
    ),
    SchemaCase(
        "string_formats",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "email": {"type": "string", "format": "email"},
                "birthday": {"type": "string", "format": "date"},
                "created_at": {"type": "string", "format": "date-time"},
            },
            "required": ["id", "email", "birthday", "created_at"],
            "additionalProperties": False,
        },
        [{"id": "3f2b8c1e-6a4d-4e2b-9c1a-0d5e7f9a1b2c", "email": "ann.lee@example.com", "birthday": "1990-04-21",
          "created_at": "2024-05-01T12:30:00Z"}],
        [{"id": "not-a-uuid", "email": "ann@example.com", "birthday": "1990-04-21",
          "created_at": "2024-05-01T12:30:00Z"},
         {"id": "3f2b8c1e-6a4d-4e2b-9c1a-0d5e7f9a1b2c", "email": "ann.lee@example.com", "birthday": "1990-13-40",
          "created_at": "2024-05-01T12:30:00Z"}],
    ),
    SchemaCase(
        "numeric_bounds",
        {
            "type": "object",
            "properties": {
                "age": {"type": "integer", "minimum": 0, "maximum": 130},
                "temperature": {"type": "number", "minimum": -273.15, "maximum": 1000},
                "discount": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                "quantity": {"type": "integer", "minimum": 1},
            },
            "required": ["age", "temperature", "discount", "quantity"],
            "additionalProperties": False,
        },
        [{"age": 42, "temperature": -12.5, "discount": 0.15, "quantity": 3}],
        [{"age": 131, "temperature": 0, "discount": 0.5, "quantity": 1},
         {"age": 1, "temperature": 0, "discount": 0.5, "quantity": 0}],
    ),
    SchemaCase(
        "any_of",
        {
            "type": "object",
            "properties": {
                "value": {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "null"}]},
                "shape": {
                    "anyOf": [
                        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                         "required": ["kind", "r"], "additionalProperties": False},
                        {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "number"},
                                                          "h": {"type": "number"}},
                         "required": ["kind", "w", "h"], "additionalProperties": False},
                    ]
                },
            },
            "required": ["value", "shape"],
            "additionalProperties": False,
        },
        [{"value": None, "shape": {"kind": "circle", "r": 2}},
         {"value": "x", "shape": {"kind": "rect", "w": 1, "h": 3}}],
        [{"value": True, "shape": {"kind": "circle", "r": 2}}],
    ),
    SchemaCase(
        "patterns",
        {
            "type": "object",
            "properties": {
                "phone": {"type": "string", "pattern": "^\\+[1-9][0-9]{6,14}$"},
                "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
                "slug": {"type": "string", "pattern": "^[a-z0-9]+(-[a-z0-9]+)*$"},
            },
            "required": ["phone", "sku", "slug"],
            "additionalProperties": False,
        },
        [{"phone": "+14155550123", "sku": "AB-1234", "slug": "blue-widget-2"}],
        [{"phone": "555-0123", "sku": "AB-1234", "slug": "ok"}],
    ),
    SchemaCase(
        "extraction_person",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": ["integer", "null"], "minimum": 0},
                "occupation": {"type": "string"},
                "emails": {"type": "array", "items": {"type": "string", "format": "email"}},
                "addresses": {"type": "array", "items": _ADDRESS, "maxItems": 3},
                "is_customer": {"type": "boolean"},
            },
            "required": ["name", "age", "addresses", "is_customer"],
            "additionalProperties": False,
        },
        [{"name": "Marie Curie", "age": 66, "occupation": "physicist", "emails": ["marie@example.org"],
          "addresses": [{"street": "11 Rue Pierre", "city": "Paris", "postal_code": "75005", "country": "FR"},
                        {"street": "36 Freta", "city": "Warsaw", "country": "DE"}], "is_customer": False},
         {"name": "Bob", "age": None, "addresses": [], "is_customer": True}],
    ),
    SchemaCase(
        "tool_calls",
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"const": "get_weather"},
                            "arguments": {
                                "type": "object",
                                "properties": {
                                    "city": {"type": "string"},
                                    "unit": {"enum": ["celsius", "fahrenheit"]},
                                },
                                "required": ["city"],
                                "additionalProperties": False,
                            },
                        },
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {
                            "name": {"const": "search_docs"},
                            "arguments": {
                                "type": "object",
                                "properties": {
                                    "query": {"type": "string"},
                                    "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
                                },
                                "required": ["query", "top_k"],
                                "additionalProperties": False,
                            },
                        },
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    },
                ]
            },
        },
        [[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}],
         [{"name": "search_docs", "arguments": {"query": "kv cache", "top_k": 5}},
          {"name": "get_weather", "arguments": {"city": "Lima"}}]],
        [[{"name": "delete_all", "arguments": {}}], []],
    ),
]

BAD_SCHEMAS: list[BadInput] = [
    BadInput("unknown_type", {"type": "nonsense"}, "invalid"),
    BadInput("missing_ref", {"$ref": "#/$defs/missing"}, "invalid"),
    BadInput("not_an_object", [1, 2, 3], "invalid"),
    BadInput("not_json", '{"type": "object", ', "invalid"),
    BadInput("bad_pattern", {"type": "string", "pattern": "(abc"}, "invalid"),
    BadInput("unique_items", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "unsupported"),
    BadInput("not_keyword", {"type": "string", "not": {"const": "x"}}, "unsupported"),
    BadInput("min_gt_max", {"type": "integer", "minimum": 10, "maximum": 1}, "unsatisfiable"),
    BadInput("items_min_gt_max", {"type": "array", "minItems": 5, "maxItems": 2}, "unsatisfiable"),
]

REGEXES: list[tuple[str, list[str]]] = [
    ("[0-9]{3}-[0-9]{4}", ["555-0123"]),
    ("(yes|no|maybe)", ["maybe"]),
    ("[A-Z][a-z]+ [A-Z][a-z]+", ["Ada Lovelace"]),
]

BAD_REGEXES: list[str] = ["(abc", "[a-", "a{3,1}", "*a"]

CHOICES: list[list[str]] = [["positive", "negative", "neutral"], ["yes", "no"]]

GRAMMARS: list[GrammarCase] = [
    GrammarCase("yes_no", "gbnf", 'root ::= "yes" | "no"', ["yes", "no"]),
    GrammarCase(
        "arith_gbnf",
        "gbnf",
        """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
""",
        ["1+2*3", "(4-1)/12"],
    ),
    GrammarCase(
        "arith_lark",
        "lark",
        """start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
""",
        ["1+2*3", "(4-1)/12"],
    ),
]

BAD_GRAMMARS: list[GrammarCase] = [
    GrammarCase("gbnf_unterminated_string", "gbnf", 'root ::= "yes | "no"'),
    GrammarCase("gbnf_undefined_rule", "gbnf", "root ::= answer"),
    GrammarCase("lark_undefined_rule", "lark", "start: answer"),
]


def check_valid_instances() -> list[str]:
    """Return the problems found validating every case's ``valid`` (and ``invalid``) instances with jsonschema."""
    import jsonschema

    problems = []
    for case in SCHEMA_CASES:
        validator = jsonschema.Draft202012Validator(case.schema, format_checker=jsonschema.FormatChecker())
        problems += [f"{case.name}: valid[{i}] {e.message}" for i, x in enumerate(case.valid)
                     for e in validator.iter_errors(x)]
        problems += [f"{case.name}: invalid[{i}] passes" for i, x in enumerate(case.invalid) if validator.is_valid(x)]
    return problems
