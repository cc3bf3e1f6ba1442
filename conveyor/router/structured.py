"""Structured-output request fields: OpenAI's `response_format` and vLLM's `structured_outputs` extension, checked
at the ingress (the grammar library validates without a tokenizer), so a bad schema is a 400 before anything
reaches a replica, and a request for a format we cannot produce is refused, never answered in free text."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from conveyor.router import json_limits
from conveyor.serving import grammar
from conveyor.serving.request import StructuredOutputsParams


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JsonSchemaFormat(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # enforced either way: every constrained output follows its schema


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    _params: StructuredOutputsParams | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        self._params = self._to_params()  # validated here, so the 400 names this field
        return self

    @property
    def params(self) -> StructuredOutputsParams | None:
        return self._params

    def _to_params(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema.schema_ is None:
            return checked(StructuredOutputsParams("json_object"))
        return checked(StructuredOutputsParams("json", canonical_json(self.json_schema.schema_)))


class StructuredOutputsRequest(_Lenient):
    """vLLM's `structured_outputs` (exactly one of its constraints), so clients written for vLLM keep working."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    _params: StructuredOutputsParams | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check(self) -> StructuredOutputsRequest:
        given = [name for name in ("json_", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                             f"got {len(given)}")
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object must be true when given")
        self._params = self._to_params()
        return self

    @property
    def params(self) -> StructuredOutputsParams:
        return self._params

    def _to_params(self) -> StructuredOutputsParams:
        if self.json_ is not None:
            schema = self.json_
            if isinstance(schema, str):  # its nesting is bounded as the body's is
                schema = json_limits.loads(schema, what="structured_outputs.json")
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object")
            return checked(StructuredOutputsParams("json", canonical_json(schema)))
        if self.regex is not None:
            return checked(StructuredOutputsParams("regex", self.regex))
        if self.choice is not None:
            return checked(StructuredOutputsParams("choice", json.dumps(self.choice)))
        if self.grammar is not None:
            return checked(StructuredOutputsParams("grammar", self.grammar))
        return checked(StructuredOutputsParams("json_object"))


def canonical_json(schema: dict[str, Any]) -> str:
    # Key order is kept (it is the order properties are generated in); only the layout is normalized, so the
    # same schema sent twice is one compiled grammar.
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def checked(params: StructuredOutputsParams) -> StructuredOutputsParams:
    """The constraint, validated (ValueError: a 400 naming the field) and marked so: the engine only compiles it."""
    grammar.validate(params)
    return dataclasses.replace(params, validated=True)
