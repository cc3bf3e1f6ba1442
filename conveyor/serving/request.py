"""The request record and its sampling parameters."""
from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Any

MIN_SAMPLING_TEMPERATURE = 1e-5
# The ranges float32 sampling carries without overflow (docs/limits.md): logits of magnitude ~1e3 (bias included)
# divided by a temperature or a repetition penalty stay far from float32's 3.4e38, and a penalty never rounds
# to 0 or inf. Outside them a request is refused (ValueError; HTTP 400 at the router).
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
SEED_RANGE = (-(1 << 63), 1 << 64)  # what a torch.Generator's manual_seed takes
# Amplification caps (docs/limits.md): each entry costs work on every step of the request (a stop token id is
# looked up for every sampled token, a stop string searched in every delta, a bias added to every row), so a
# small body must not buy an unbounded amount of it. OpenAI allows 4 stop strings.
MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The sampling settings a model's generation_config.json may recommend, applied to requests that leave them
# unset (the ones vLLM takes from a generation config).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output (serving/grammar.py compiles it). `spec` is the JSON schema as JSON text
    (kind "json"), the regex, the JSON list of choices (kind "choice"), the EBNF/Lark grammar, or "" (json_object).
    Text, not dicts: the record stays hashable, and the text is the compiled-grammar cache's key."""

    kind: str
    spec: str = ""
    # True once grammar.validate has passed on this spec (the HTTP ingress checks every constraint before it
    # leaves, router/structured.py): the engine then only compiles it. Not part of equality or the hash, so a
    # validated and an unvalidated copy of one spec are one compiled grammar.
    validated: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token; 0 = only the sampled token's
    include_stop_str_in_output: bool = False
    structured: StructuredOutputsParams | None = None
    # Penalties as OpenAI (presence, frequency: over the output) and vLLM (repetition: over prompt and output)
    # define them; conveyor/serving/logits_processors.py applies them, greedy rows included.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: added to the token's logit before sampling. A dict is accepted and kept as sorted
    # (token id, bias) pairs, so the record stays hashable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: EOS and stop_token_ids cannot be sampled, and stop strings are not looked for, before this many
    # output tokens.
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails too
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens} "
                             f"(max_tokens {self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        check_caps(len(self.stop), max(map(len, self.stop), default=0), len(self.stop_token_ids),
                   len(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:  # NaN fails too
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if any(t < 0 for t in self.stop_token_ids):  # a negative id would index another row's logits
            raise ValueError(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        for token_id, value in self.logit_bias:
            if token_id < 0 or not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias maps token ids >= 0 to values in [-100, 100], got {token_id}: {value}")

    # Cached (the params are frozen): the sampler reads these for every row of every step.
    @functools.cached_property
    def has_logits_edits(self) -> bool:
        """Whether a penalty, a bias or min_tokens may change this request's logits before sampling."""
        return self.reads_output or bool(self.logit_bias)

    @functools.cached_property
    def reads_output(self) -> bool:
        """Whether sampling this request's next token reads the tokens it has output (penalties, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens)

    @functools.cached_property
    def greedy(self) -> bool:
        # Below this, dividing float32 logits by the temperature overflows to inf/NaN; it is argmax anyway.
        return self.temperature < MIN_SAMPLING_TEMPERATURE


def check_caps(num_stop: int, max_stop_chars: int, num_stop_token_ids: int, num_logit_bias: int) -> None:
    """The amplification caps above; ValueError naming the first one exceeded."""
    for name, value, cap in (("stop strings", num_stop, MAX_STOP_STRINGS),
                             ("characters in a stop string", max_stop_chars, MAX_STOP_STRING_CHARS),
                             ("stop_token_ids", num_stop_token_ids, MAX_STOP_TOKEN_IDS),
                             ("logit_bias entries", num_logit_bias, MAX_LOGIT_BIAS_ENTRIES)):
        if value > cap:
            raise ValueError(f"at most {cap} {name} are allowed, got {value}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the request could not be served after admission (its grammar failed to compile)

    @property
    def finished(self) -> bool:
        # By value: an Enum member's own hash is a Python-level call, and this runs per request per step.
        return self._value_ in _FINISHED_VALUES

    @property
    def finish_reason(self) -> str | None:
        return self._value_ if self._value_ in _FINISHED_VALUES else None


_FINISHED_VALUES = frozenset({"stop", "length", "abort", "error"})


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    # Set by the engine at admission: max_tokens resolved against the context length.
    max_tokens: int = 16
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # The one progress counter: how many of prompt + output tokens have their KV in the cache.
    num_computed_tokens: int = 0
    # Async scheduling: tokens of steps in flight, scheduled (num_computed_tokens counts them) but not yet sampled.
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Structured outputs: a serving.grammar.RequestGrammar (compiled off the step, then one matcher per request).
    grammar: Any = None
    # Its next token is its logits' argmax and nothing more: greedy, no edits, no grammar, no logprobs. Set once
    # (the params are frozen), so a step of such requests samples with one argmax and no per-row checks.
    argmax_only: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.sampling_params
        self.argmax_only = (params.greedy and params.logprobs is None and not params.has_logits_edits
                            and params.structured is None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_schedule(self) -> int:
        """Tokens not yet scheduled: a running decode has 1 (under async scheduling its input may be in flight)."""
        return self.num_tokens + self.num_output_placeholders - self.num_computed_tokens

    @property
    def reads_output(self) -> bool:
        """Whether sampling its next token reads the tokens it has output: a grammar, penalties, min_tokens."""
        return self.grammar is not None or self.sampling_params.reads_output

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt+output without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
