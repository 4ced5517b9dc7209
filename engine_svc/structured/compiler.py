"""Compiling output constraints off the busy loop, once per distinct constraint.

`GrammarCompilers.submit(constraint)` returns a `Ticket` at once; the compile runs on a small thread
pool (xgrammar releases the GIL while it compiles, so a slow compile costs the busy loop one core at
most, never its turn). The scheduler polls `Ticket.done` each step and takes the result with `result`,
which raises `GrammarError` (the reason, without xgrammar's source-location prefix) for a constraint
that does not compile. The busy loop is woken (`on_done`) when a compile finishes, so a loop with
nothing else to do sleeps instead of polling.

Cache: an LRU of compiled grammars keyed by the constraint (its kind and its exact text: property order
in a JSON schema is the order of the output), bounded to `cache_size` entries; identical constraints in
flight share one compile. Failed compiles are not kept. A ticket whose last waiter is released before
its compile started is cancelled and forgotten (an aborted request leaves nothing behind).

The vocabulary (xgrammar's `TokenizerInfo`) is read from the model's tokenizer files by the first
compile, on the pool's thread; its size is the model's logits width (config.json's vocab_size, which
may exceed the tokenizer's: the extra ids are never allowed).
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared_runtime.contract import StructuredOutputs

Key = tuple[str, str]
# JSON may be written compact or pretty-printed (any whitespace between tokens, as vLLM allows), but at
# most this many whitespace characters in a row: enough for indented output 7 levels deep, and a small
# model cannot spend its max_tokens on an endless run of spaces and newlines inside the object.
MAX_JSON_WHITESPACE = 16


class GrammarError(ValueError):
    """A constraint that does not compile; the message is the reason."""


@dataclass(eq=False)
class Ticket:
    """One request's claim on a compile."""

    key: Key
    future: Future[Any]
    deadline: float  # time.monotonic() after which the request stops waiting
    released: bool = field(default=False)

    @property
    def done(self) -> bool:
        return self.future.done()

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.deadline


def constraint_key(constraint: StructuredOutputs) -> Key:
    """(kind, text): what makes two constraints compile to the same grammar."""
    kind = constraint.kinds()[0]
    value = getattr(constraint, kind)
    if kind == "choice":
        return kind, json.dumps(value, ensure_ascii=False)
    return kind, "" if value is True else str(value)


class GrammarCompilers:
    def __init__(self, model: str, vocab_size: int, *, max_workers: int = 2, cache_size: int = 256,
                 timeout_s: float = 30.0, on_done: Callable[[], None] | None = None) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self.on_done = on_done  # set by the busy loop: wakes it when a compile finishes
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.RLock()  # _cache/_waiters (pool threads drop failed compiles; a compile
        # that is done before add_done_callback runs its callback inside submit)
        self._cache: OrderedDict[Key, Future[Any]] = OrderedDict()
        self._waiters: dict[Key, int] = {}
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()

    # ---- the busy loop's side -------------------------------------------------------------------------
    def submit(self, constraint: StructuredOutputs) -> Ticket:
        """Start (or join) the compile of `constraint`; never blocks."""
        key = constraint_key(constraint)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile, key)
                self._cache[key] = future
                future.add_done_callback(lambda f, key=key: self._finished(key, f))
            self._cache.move_to_end(key)
            self._waiters[key] = self._waiters.get(key, 0) + 1
            self._evict()
        return Ticket(key, future, time.monotonic() + self.timeout_s)

    def release(self, ticket: Ticket) -> None:
        """The request no longer waits (it got its grammar, failed, or was aborted). A compile nobody
        waits for any more is cancelled if it has not started."""
        if ticket.released:
            return
        ticket.released = True
        with self._lock:
            left = self._waiters.get(ticket.key, 1) - 1
            if left > 0:
                self._waiters[ticket.key] = left
                return
            self._waiters.pop(ticket.key, None)
            if ticket.future.cancel():
                self._cache.pop(ticket.key, None)

    @staticmethod
    def result(ticket: Ticket) -> Any:
        """The compiled grammar of a done ticket; `GrammarError` if it did not compile."""
        try:
            return ticket.future.result(timeout=0)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
            raise GrammarError(_reason(exc)) from exc

    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def num_waiting(self) -> int:
        with self._lock:
            return sum(self._waiters.values())

    def prewarm(self) -> None:
        """A serving engine builds the vocabulary view now, on a pool thread, instead of inside the first
        constrained request: the tokenizer load holds the GIL for about a second, which streams in flight
        would feel. A failure is left for that first request to hit again and report."""
        if importlib.util.find_spec("xgrammar") is not None:
            self._pool.submit(self._get_compiler).add_done_callback(lambda f: f.exception())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the pool's side ------------------------------------------------------------------------------
    def _finished(self, key: Key, future: Future[Any]) -> None:
        if future.cancelled():
            return
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]
        on_done = self.on_done
        if on_done is not None:
            on_done()

    def _evict(self) -> None:
        """Drop least recently used finished grammars beyond cache_size (compiles in flight stay)."""
        excess = len(self._cache) - self.cache_size
        for key in [k for k, f in self._cache.items() if f.done()][:max(0, excess)]:
            del self._cache[key]

    def _compile(self, key: Key) -> Any:
        compiler = self._get_compiler()
        kind, text = key
        if kind == "json":
            return compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(text)))
        if kind == "grammar":
            return compiler.compile_grammar(text)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(text)
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = load_tokenizer_info(self.model, self.vocab_size)
                # cache_enabled=False: the LRU above is the cache (xgrammar 0.2.x's own per-rule cache
                # fails a check on string patterns with a bounded repetition, e.g. "^[a-z]{1,300}$")
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose root is exactly one of `choices` (JSON string literals are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def load_tokenizer_info(model: str, vocab_size: int) -> Any:
    """xgrammar's view of the vocabulary, from the model directory's tokenizer files (or a .gguf file's
    metadata), `vocab_size` wide."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
MAX_REASON_CHARS = 500


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its timestamp and C++ source location, on one bounded line."""
    text = " ".join(_XGRAMMAR_PREFIX.sub("", str(exc).strip()).split())
    text = text or type(exc).__name__
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."
