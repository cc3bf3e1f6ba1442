"""Incremental detokenization with streaming-safe stop strings.

Decoding a token alone is wrong for two reasons: a multi-byte UTF-8 character may be split over several
(byte-fallback or byte-level) tokens, and decoders treat the first token of a sequence specially
(SentencePiece drops the "▁" space of the first piece). So, like vLLM, we decode a small window
tokens[prefix_offset:] and emit only what it adds over tokens[prefix_offset:read_offset], and only once
it no longer ends in an incomplete character ("\ufffd"). Both windows are a handful of tokens, so the
work per token does not grow with the length of the output.

Stop strings: text that could still turn out to be the start of a stop string is held back, so a
streaming client never receives text that is later cut, and the deltas always concatenate to `text`.

The prompt side (tokenize, apply_chat_template) is here too: LLMEngine and ProcessEngine's parent both use it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context for the first output token (vLLM uses the same).
_INITIAL_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes and every real token carries at least one, so more pending tokens
# than this that still decode to a trailing "\ufffd" mean invalid bytes, not an incomplete character.
_MAX_PENDING_TOKENS = 4


def ids_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """decode(ids) for this tokenizer. A fast tokenizer without clean-up decodes in the Rust tokenizer directly:
    transformers' decode() wraps that same call in ~15 us of Python, twice per generated token per request, which
    was most of a batch-256 step's output processing (benchmarks/step_overhead.py)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        self._decode_ids = ids_decoder(tokenizer, skip_special_tokens)
        self._stop = tuple(stop)
        # Stop strings are looked for only in text of tokens past the first min_tokens (as vLLM does).
        self._min_tokens = min_tokens
        self._include_stop = include_stop_str_in_output
        # Only the prompt tail is needed as decode context; keep the rest of the prompt out of our list.
        context = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._skip_partial_context_char()
        self._held = ""  # decoded, not yet emitted: could be the start of a stop string
        # All text emitted so far. The engine reads it every step, so it is kept whole rather than
        # joined on demand; an append is a memcpy, cheap next to the decode calls.
        self.text = ""
        self.output_token_ids: list[int] = []
        self.stopped = False

    def update(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the text delta that is safe to emit now ("" once stopped)."""
        self.output_token_ids.extend(new_token_ids)
        if self.stopped:
            return ""
        if len(new_token_ids) == 1:  # the common case: one token a step
            self._ids.append(new_token_ids[0])
            return self._emit(self._decode_step(force=False), final=False)
        decoded: list[str] = []
        for token_id in new_token_ids:
            self._ids.append(token_id)
            decoded.append(self._decode_step(force=False))
        return self._emit("".join(decoded), final=False)

    def flush(self) -> str:
        """At finish: emit what was held back (an incomplete character, a stop-string prefix)."""
        if self.stopped:
            return ""
        return self._emit(self._decode_step(force=True), final=True)

    # -- decoding ---------------------------------------------------------------------------------

    def _skip_partial_context_char(self) -> None:
        # The prompt tail may begin mid-character. Byte-fallback decoders then turn the whole byte run,
        # including the first output bytes, into "\ufffd"s, so start the window at a character boundary.
        while (self._prefix_offset < self._read_offset
               and self._decode(self._prefix_offset, self._read_offset).startswith(_REPLACEMENT)):
            self._prefix_offset += 1

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decode_ids(self._ids[start:end])

    def _decode_step(self, force: bool) -> str:
        """The text tokens[read_offset:] add to the window, or "" while it ends mid-character."""
        ids, prefix_offset, read_offset = self._ids, self._prefix_offset, self._read_offset
        if read_offset == len(ids):
            return ""
        prefix_text = self._decode_ids(ids[prefix_offset:read_offset])
        new_text = self._decode_ids(ids[prefix_offset:])
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token: keep it pending, it adds no text
        if not new_text.endswith(_REPLACEMENT) or force:
            return self._advance(len(self._ids), prefix_text, new_text)
        if len(self._ids) - self._read_offset > _MAX_PENDING_TOKENS:
            return self._advance_past_invalid_bytes(prefix_text, new_text)
        return ""

    def _advance(self, read_end: int, prefix_text: str, text: str) -> str:
        # The new window starts at the old read point so the next token still has left context.
        self._prefix_offset, self._read_offset = self._read_offset, read_end
        self._trim_ids()
        return text[len(prefix_text):]

    def _advance_past_invalid_bytes(self, prefix_text: str, new_text: str) -> str:
        """Emit up to the last token boundary whose text is final, so garbage bytes cannot grow the window.

        The text of tokens[prefix_offset:end] is final when the full window's text starts with it and
        goes on past it: a trailing "\ufffd" there is then an invalid byte, not a character cut short.
        """
        for end in range(len(self._ids) - 1, self._read_offset, -1):
            text = self._decode(self._prefix_offset, end)
            if len(text) > len(prefix_text) and len(new_text) > len(text) and new_text.startswith(text):
                return self._advance(end, prefix_text, text)
        return ""

    def _trim_ids(self) -> None:
        # Tokens before prefix_offset are never decoded again; drop them so memory stays O(window).
        if self._prefix_offset > 64:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    # -- stop strings -----------------------------------------------------------------------------

    def _emit(self, delta: str, final: bool) -> str:
        """Run new text through the stop-string check; return what may be sent to the client."""
        if not self._stop:
            self.text += delta
            return delta
        buf = self._held + delta
        if len(self.output_token_ids) <= self._min_tokens:
            self._held = ""
            return self._send(buf)
        # Held text is exactly what could start a stop string, so a match can only begin inside `buf`.
        match = _earliest_stop(buf, self._stop)
        if match is not None:
            start, stop_str = match
            self.stopped = True
            self._held = ""
            return self._send(buf[:start + len(stop_str)] if self._include_stop else buf[:start])
        keep = 0 if final else _longest_stop_prefix_suffix(buf, self._stop)
        self._held = buf[len(buf) - keep:] if keep else ""
        return self._send(buf[:len(buf) - keep])

    def _send(self, delta: str) -> str:
        self.text += delta
        return delta


def _earliest_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop string) of the leftmost stop-string occurrence in `text`; the longest wins a tie."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        if best is None or start < best[0] or (start == best[0] and len(stop) > len(best[1])):
            best = (start, stop)
    return best


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def tokenize(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """A prompt as token ids: text is encoded without special tokens (templates add their own), ids pass through."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
    return list(prompt)


class PromptSide:
    """tokenize and apply_chat_template (below) with the object's `tokenizer`: LLMEngine, AsyncEngine, ProcessEngine."""

    tokenizer: Any

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize(self.tokenizer, prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return apply_chat_template(self.tokenizer, messages)


# Marks the system message the router renders a request's tools into (router/tool_schema.py): a template without
# a system role takes that section at the start of the first user turn instead, as Gemma 3's template folds a
# system prompt into it. A system message the client wrote is left to the template (Gemma 2's refuses it).
TOOLS_SECTION_KEY = "conveyor_tools_section"
_SYSTEM_PROBE = "conveyor-system-probe"
_takes_system: dict[str, bool] = {}  # template text -> whether it renders a system message


def template_takes_system_role(tokenizer: Any) -> bool:
    """Whether the chat template renders a system message's text (Gemma 2's raises on one); probed once per
    template text."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return True
    if template not in _takes_system:
        probe = [{"role": "system", "content": _SYSTEM_PROBE}, {"role": "user", "content": "hi"}]
        try:
            text = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
            _takes_system[template] = _SYSTEM_PROBE in text
        except Exception:  # noqa: BLE001 - whatever the template raises, it does not take the role
            _takes_system[template] = False
    return _takes_system[template]


def place_tools_section(tokenizer: Any, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """messages with the tools section as a plain system message, or, where the template takes no system role,
    opening the first user message."""
    if not messages or TOOLS_SECTION_KEY not in messages[0]:
        return messages
    section, rest = messages[0]["content"], list(messages[1:])
    first_user = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
    if first_user is None or template_takes_system_role(tokenizer):
        return [{"role": "system", "content": section}, *rest]
    rest[first_user] = {**rest[first_user], "content": f"{section}\n\n{rest[first_user]['content']}"}
    return rest


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """Chat messages as the prompt text the model was tuned on, ending where the assistant's turn begins. A
    template that refuses the messages (raise_exception on a role order, as Llama 2's and Mistral's do) raises
    ValueError: the client's input, not a server fault."""
    from jinja2.exceptions import TemplateError

    messages = place_tools_section(tokenizer, messages)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:
        raise ValueError(f"the model's chat template refused these messages: {exc}") from None
