"""Structured outputs: a request's constraint (StructuredOutputsParams) -> llguidance grammar -> one matcher per
request, built off the engine step in a thread pool.

Why llguidance (benchmarks/grammar_libs.py has the side-by-side with xgrammar): a grammar needs no ahead-of-time
mask compilation (masks are computed lazily, with per-step work bounded by the parser's fuel limits), so a large
schema never blocks the step; grammars validate without a tokenizer, so the HTTP ingress refuses a bad schema
with a 400 before anything reaches a replica; and it has no dependency on torch or transformers versions.

No torch here: the scheduler calls into RequestGrammar (ready? accept a token, terminated?); the bitmask that
the sampler applies lives in conveyor/serving/grammar_bitmask.py.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

import llguidance

from conveyor import envs
from conveyor.serving.request import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_SPEC_CHARS = 256 * 1024  # a schema or grammar larger than this is refused at validation
DEFAULT_COMPILE_TIMEOUT_S = 30.0
# Compiles run side by side on this many threads (one slow schema does not hold the others back), and at most this
# many more replace compiles written off at their time-out (CompilePool).
DEFAULT_COMPILE_THREADS = 2
MAX_ABANDONED_COMPILES = 4
MAX_CACHED_GRAMMARS = 256
MAX_COMPILE_TIMES = 4096
COMPILE_THREAD_NICE = int(envs.get(envs.GRAMMAR_NICE))
# JSON whitespace as the model writes it (a space after a separator, a line break and indentation), bounded per gap
# between two JSON tokens: at most one line break and MAX_JSON_INDENT (+1) spaces or tabs. Unbounded whitespace
# (xgrammar's any_whitespace, llguidance's default) lets a small model spend its whole max_tokens on newlines; one
# forced compact layout pushes it off its own distribution (SmolLM2 on "List two fruits in JSON." wrote
# `{"grapefruit": "🍰🍰🍰...` until max_tokens). Between two runs the model must write a JSON token, so whitespace
# can never fill max_tokens. Applied as overrides: a schema's own "x-guidance" cannot lift the bound.
MAX_JSON_INDENT = 32
JSON_WHITESPACE = rf"[ \t]?(\r?\n)?[ \t]{{0,{MAX_JSON_INDENT}}}"
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint; ValueError for a spec that is not even well-formed."""
    if len(params.spec) > MAX_SPEC_CHARS:
        raise ValueError(f"the {params.kind} constraint is {len(params.spec)} characters; at most {MAX_SPEC_CHARS}")
    kind, spec = params.kind, params.spec
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ascii_digits(spec))
        if kind == "choice":
            choices = json.loads(spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choice must be a non-empty list of strings")
            return llguidance.grammar_from("choice", spec)
        return llguidance.grammar_from("grammar", spec)  # EBNF (GBNF) converted to Lark, or Lark as is
    except ValueError as exc:
        raise ValueError(f"invalid {kind} constraint: {exc}") from None


def ascii_digits(regex: str) -> str:
    """`\\d` as [0-9], as Python's re.ASCII, JSON schema patterns (ECMA) and other servers' regexes read it: the
    library's regex dialect (Rust) matches every Unicode digit, and a small model then fills a phone-number
    pattern with segmented-display digits. `\\D` outside a class becomes [^0-9]."""
    out, in_class, i = [], False, 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif nxt == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(regex[i:i + 2])
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
        elif ch == "]" and in_class:
            in_class = False
        out.append(ch)
        i += 1
    return "".join(out)


def validate(params: StructuredOutputsParams) -> str:
    """Check a constraint without a tokenizer (the ingress has none); returns its grammar text, raises
    ValueError with the library's message for an invalid schema, an unsupported keyword, a bad regex..."""
    grammar = grammar_text(params)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {params.kind} constraint: {error}")
    return grammar


class RequestGrammar:
    """A request's matcher: pending while it compiles, then ready (or failed). The scheduler admits the request
    only once ready; a compile past the time-out fails the request rather than hanging it."""

    def __init__(self, future: Future, timeout_s: float, on_timeout: Callable[[Future], None] | None = None) -> None:
        self._future = future
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._on_timeout = on_timeout  # the pool writes the compile off (CompilePool.abandon)
        self.matcher: Any = None  # llguidance.LLMatcher once ready
        self.error: str | None = None

    def poll(self) -> bool:
        """True once the matcher is ready; False while pending or after a failure (then `error` is set)."""
        if self.matcher is not None:
            return True
        if self.error is not None:
            return False
        if self._future.done():
            try:
                self.matcher = self._future.result()
            except Exception as exc:  # noqa: BLE001 - any failure of the library is this request's error
                self.error = str(exc) or type(exc).__name__
            return self.matcher is not None
        if time.monotonic() > self._deadline:
            self.error = f"the grammar did not compile within {self._timeout_s:g} s"
            if not self._future.cancel() and self._on_timeout is not None:  # queued: cancelled; running: written off
                self._on_timeout(self._future)
        return False

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def compiling(self) -> bool:
        """Not yet polled ready or failed (a cheap attribute check: poll() is what moves it on)."""
        return self.matcher is None and self.error is None

    def wait(self, timeout_s: float) -> None:
        if not self._future.done():
            try:
                self._future.exception(timeout=timeout_s)
            except (TimeoutError, CancelledError):  # still compiling, or the pool is shutting down: poll() says
                pass

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar refuses it (cannot happen under its mask)."""
        if self.matcher.consume_token(token_id):
            return True
        self.error = self.matcher.get_error() or f"token {token_id} is not allowed by the grammar"
        return False

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Builds matchers in a thread pool (the library drops the GIL while it parses a grammar) and caches one
    template matcher per grammar text, so the next request with the same schema gets a copy in microseconds."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, num_threads: int = DEFAULT_COMPILE_THREADS,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._pool = CompilePool(num_threads, MAX_ABANDONED_COMPILES, initializer=_yield_to_the_step)
        # The tokenizer's byte-level view (~1 s to build): once, in the pool, ahead of the first grammar.
        self._lltokenizer = self._pool.submit(_lltokenizer, tokenizer, vocab_size)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.compile_times_s: deque[float] = deque(maxlen=MAX_COMPILE_TIMES)  # recent cold compiles

    def submit(self, params: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(self._pool.submit(self._matcher, params), self.timeout_s, self._pool.abandon)

    def _matcher(self, params: StructuredOutputsParams) -> Any:
        grammar = grammar_text(params)
        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
        if template is None:
            start = time.perf_counter()
            template = llguidance.LLMatcher(self._lltokenizer.result(), grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"invalid {params.kind} constraint: {template.get_error()}")
            self.compile_times_s.append(time.perf_counter() - start)
            self.num_compiled += 1
            with self._lock:
                self._cache[grammar] = template
                while len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        return template.deep_copy()


class CompilePool:
    """Threads for compiles. The library cannot interrupt a compile, so one past its time-out is written off
    (`abandon`): a replacement thread starts at once, so the compiles queued behind it do not wait for it, and the
    thread that ran it exits when it ends (its fuel limits bound it). At most `max_abandoned` replacements exist
    at a time; past that, queued compiles wait and time out in turn."""

    def __init__(self, num_threads: int, max_abandoned: int, initializer: Callable[[], None]) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._initializer = initializer
        self._lock = threading.Lock()
        self._base = num_threads
        self._max_threads = num_threads + max_abandoned
        self._abandoned: set[Future] = set()
        self._threads = 0
        for _ in range(num_threads):
            self._spawn()

    @property
    def num_threads(self) -> int:
        return self._threads

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def abandon(self, future: Future) -> None:
        """A running compile past its time-out: let another thread take the queue while it finishes."""
        with self._lock:
            if future.done() or future in self._abandoned or self._threads >= self._max_threads:
                return
            self._abandoned.add(future)
            self._spawn()
        future.add_done_callback(self._forget)

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._abandoned.discard(future)

    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name=f"grammar-{self._threads}", daemon=True).start()

    def _work(self) -> None:
        self._initializer()
        while True:
            future, fn, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the request, which fails with it
                    future.set_exception(exc)
            with self._lock:  # one thread too many once an abandoned compile has ended: this one leaves
                if self._threads > self._base + len(self._abandoned):
                    self._threads -= 1
                    return


def _yield_to_the_step(niceness: int = COMPILE_THREAD_NICE) -> None:
    """Run compiles at the lowest CPU priority (Linux niceness is per thread; raising it needs no privilege).
    The step's OpenMP team has a thread per core: a compile taking one of those cores at equal priority stalls
    every parallel region at its barrier (decode steps went from 40 to 370 ms while large schemas compiled, 2
    cores). At nice 19 a compile runs in the cores' idle gaps and at full speed when the engine is idle."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError, PermissionError):  # not Linux, or not allowed: compile at equal priority
        logger.debug("grammar compile thread keeps the process's priority")


def _lltokenizer(tokenizer: Any, vocab_size: int) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
