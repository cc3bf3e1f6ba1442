"""OpenAI-compatible request/response models and their mapping onto the engine's SamplingParams.

Validation lives here so that everything a client sends is checked before it reaches a replica: a request
that passes these models can still be refused by the engine (prompt beyond the context, bad token ids), but
never with anything but a ValueError.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from conveyor.router import tool_schema
from conveyor.router.structured import ResponseFormat, StructuredOutputsRequest, canonical_json, checked
from conveyor.router.tool_schema import AssistantToolCall, Lenient, NamedToolChoice, Tool, ToolChoice
from conveyor.serving.request import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
    SAMPLING_DEFAULT_KEYS,
    SamplingParams,
    StructuredOutputsParams,
)

MAX_TOKENS_LIMIT = 1 << 17  # far beyond any context we serve; the engine checks the real context length
MAX_N = 8
MAX_CHOICES = 64  # prompts x n of one request: bounds the fan-out a single request can cause
# Amplification caps of the request as a whole (docs/limits.md); the sampling ones are serving/request.py's. OpenAI
# accepts at most 128 tools; the messages cap bounds the chat template's work, which the 1 MiB body alone does not
# (100,000 tiny messages fit in it).
MAX_TOOLS = 128
MAX_MESSAGES = 1024

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def _check_text(text: str) -> str:
    # JSON may carry lone surrogates ("\ud800") that are valid Python str but not UTF-8: the tokenizer would
    # fail on them deep in a replica, so refuse them here with a clear message.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return text


class StreamOptions(Lenient):
    include_usage: bool = False


class _SamplingRequest(Lenient):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM's extension; vLLM takes any value > 0, but one near 0 or huge overflows float32 logits (request.py).
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)  # vLLM's extension
    # OpenAI's: token id (JSON keys are strings, "50256") -> bias added to its logit.
    logit_bias: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's extension
    _structured: StructuredOutputsParams | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_min_tokens(self) -> _SamplingRequest:
        limit = self._max_tokens()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({limit})")
        return self

    def _max_tokens(self) -> int | None:
        return None

    @model_validator(mode="after")
    def _check_structured(self) -> _SamplingRequest:
        if self.response_format is not None and self.structured_outputs is not None:
            if self.response_format.params is not None:
                raise ValueError("give either response_format or structured_outputs, not both")
        given = self.structured_outputs or self.response_format
        self._structured = given.params if given is not None else None
        return self

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_STRING_CHARS} characters")
        return [_check_text(s) for s in stops]

    def unset_sampling_fields(self) -> list[str]:
        """Sampling settings the client left out: the replica fills them from the model's generation config."""
        return [f for f in SAMPLING_DEFAULT_KEYS if f not in self.model_fields_set]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, index: int) -> SamplingParams:
        # n > 1 with a seed: each choice gets seed + i so the choices differ yet stay reproducible.
        seed = None if self.seed is None else self.seed + index
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=seed, stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output, structured=self._structured,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=tuple((self.logit_bias or {}).items()),
            min_tokens=self.min_tokens)


class CompletionRequest(_SamplingRequest):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False  # echoing the prompt is not implemented: refuse rather than ignore it

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        for text in [v] if isinstance(v, str) else v:
            if isinstance(text, str):
                _check_text(text)
        return v

    @model_validator(mode="after")
    def _check_fan_out(self) -> CompletionRequest:
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"prompts x n must be at most {MAX_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a token-id list."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, index: int = 0) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs, index)


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content")
    @classmethod
    def _check_content(cls, v: str | list[TextPart] | None) -> str | list[TextPart] | None:
        for text in [v] if isinstance(v, str) else [p.text for p in v or []]:
            _check_text(text)
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)  # deprecated by OpenAI, still sent
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    parallel_tool_calls: bool = True
    tool_choice: ToolChoice | None = None  # after tools and parallel_tool_calls: its check reads them

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @field_validator("tools")
    @classmethod
    def _check_tool_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        tool_schema.check_tools(tools, None)
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        """Field-level (so the 400 names tool_choice): its tools exist, and a forced call's grammar compiles."""
        tools = info.data.get("tools")
        tool_schema.check_tools(tools, choice)
        schema = tool_schema.forced_call_schema(tools, choice, info.data.get("parallel_tool_calls", True))
        if schema is not None:
            if info.data.get("response_format") is not None or info.data.get("structured_outputs") is not None:
                raise ValueError("tool_choice 'required' or a named function cannot be combined with "
                                 "response_format or structured_outputs")
            try:
                checked(StructuredOutputsParams("json", canonical_json(schema)))
            except ValueError as exc:
                raise ValueError(f"a tool's parameters schema is not usable: {exc}") from None
        return choice

    @model_validator(mode="after")
    def _constrain_tool_calls(self) -> ChatCompletionRequest:
        schema = tool_schema.forced_call_schema(self.tools, self.tool_choice, self.parallel_tool_calls)
        if schema is not None:  # validated by _check_tool_choice
            self._structured = StructuredOutputsParams("json", canonical_json(schema), validated=True)
        return self

    @property
    def tool_mode(self) -> str:
        """"none" (plain text), "auto" (text, or calls the parser finds), "required" or "named" (constrained)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def conversation(self) -> list[dict[str, str]]:
        if self.tools or any(m.tool_calls or m.role == "tool" for m in self.messages):
            dumped = [m.model_dump(exclude_none=True) for m in self.messages]
            return tool_schema.render_messages(dumped, self.tools, self.tool_choice)
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens  # None: up to the context length

    def to_sampling_params(self, index: int = 0) -> SamplingParams:
        max_tokens = self._max_tokens()
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, index)


# ---- responses ---------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def add(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.total_tokens = self.prompt_tokens + self.completion_tokens


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "conveyor"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
