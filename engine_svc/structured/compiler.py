"""Compiling output constraints off the busy loop, once per distinct constraint.

`GrammarCompilers.submit(constraint)` returns a `Ticket` at once; the compile runs elsewhere. The
scheduler polls `Ticket.done` each step and takes the result with `result`, which raises `GrammarError`
(the reason, without xgrammar's source-location prefix) for a constraint that does not compile (or not
within `timeout_s`). The busy loop is woken (`on_done`) when a compile finishes, so a loop with nothing
else to do sleeps instead of polling. Where compiles run:

- `processes=True` (a serving engine): in processes of their own (compile_farm.py), each killed at its
  deadline or past its memory bound, long ones paused while fresh ones run, so one client's slow
  constraint never holds the compiles of everyone else (constraints that are known to cost too much are
  refused before this, by shared_runtime/grammar_bounds.py).
- otherwise (the offline API, one client): on a small thread pool (xgrammar releases the GIL while it
  compiles, so a slow compile costs the busy loop one core at most, never its turn).

Cache: an LRU of compiled grammars keyed by the constraint (its kind and its exact text: property order
in a JSON schema is the order of the output), bounded to `cache_size` entries and `cache_bytes` of
compiled grammars; identical constraints in flight share one compile. Failed compiles are not kept. A
ticket whose last waiter is released before its compile ended is cancelled and forgotten (an aborted
request leaves nothing behind; in processes, a compile running for nobody is killed).

The vocabulary (xgrammar's `TokenizerInfo`) is read from the model's tokenizer files once, in the engine,
on the pool's thread (`prewarm`, or the first compile); compile processes get it serialized. Its size is
the model's logits width (config.json's vocab_size, which may exceed the tokenizer's: the extra ids are
never allowed).
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_svc.structured.compile_farm import CompileFarm
from engine_svc.structured.constraint import Key, compile_key, reason
from shared_runtime.contract import StructuredOutputs


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
                 cache_bytes: int = 1 << 30, timeout_s: float = 30.0, on_done: Callable[[], None] | None = None,
                 processes: bool = False) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.timeout_s = timeout_s
        self.on_done = on_done  # set by the busy loop: wakes it when a compile finishes
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._farm = CompileFarm(self._tokenizer_info_json, self._load, workers=max_workers) if processes else None
        self._lock = threading.RLock()  # _cache/_waiters (pool threads drop failed compiles; a compile
        # that is done before add_done_callback runs its callback inside submit)
        self._cache: OrderedDict[Key, Future[Any]] = OrderedDict()
        self._sizes: dict[Key, int] = {}  # bytes of each compiled grammar in the cache
        self._waiters: dict[Key, int] = {}
        self._compiler: Any = None
        self._info: Any = None
        self._info_json: str | None = None
        self._compiler_lock = threading.Lock()

    # ---- the busy loop's side -------------------------------------------------------------------------
    def submit(self, constraint: StructuredOutputs) -> Ticket:
        """Start (or join) the compile of `constraint`; never blocks."""
        key = constraint_key(constraint)
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                if self._farm is not None:
                    future = self._farm.submit(key, deadline)
                else:
                    future = self._pool.submit(self._compile, key)
                self._cache[key] = future
                future.add_done_callback(lambda f, key=key: self._finished(key, f))
            if key in self._cache:  # (a compile that failed at once was dropped by its callback, inline)
                self._cache.move_to_end(key)
            self._waiters[key] = self._waiters.get(key, 0) + 1
            self._evict()
        return Ticket(key, future, deadline)

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
            if ticket.future.cancel():  # not started (threads), or not finished (processes: then killed)
                self._cache.pop(ticket.key, None)

    @staticmethod
    def result(ticket: Ticket) -> Any:
        """The compiled grammar of a done ticket; `GrammarError` if it did not compile."""
        try:
            return ticket.future.result(timeout=0)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
            raise GrammarError(reason(exc)) from exc

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
            warm = self._tokenizer_info_json if self._farm is not None else self._get_compiler
            self._pool.submit(warm).add_done_callback(lambda f: f.exception())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._farm is not None:
            self._farm.shutdown()

    # ---- the pool's side ------------------------------------------------------------------------------
    def _finished(self, key: Key, future: Future[Any]) -> None:
        if future.cancelled():
            return
        with self._lock:
            if future.exception() is not None:
                if self._cache.get(key) is future:
                    del self._cache[key]
            elif self._cache.get(key) is future:
                self._sizes[key] = int(getattr(future.result(), "memory_size_bytes", 0))
                self._evict()
        on_done = self.on_done
        if on_done is not None:
            on_done()

    def _evict(self) -> None:
        """Drop least recently used finished grammars beyond cache_size entries or cache_bytes in all
        (compiles in flight stay)."""
        excess = len(self._cache) - self.cache_size
        total = sum(self._sizes.get(k, 0) for k in self._cache)
        for key in [k for k, f in self._cache.items() if f.done()]:
            if excess <= 0 and total <= self.cache_bytes:
                break
            del self._cache[key]
            total -= self._sizes.pop(key, 0)
            excess -= 1

    def _compile(self, key: Key) -> Any:
        return compile_key(self._get_compiler(), key)

    def _get_info(self) -> Any:
        with self._compiler_lock:
            if self._info is None:
                self._info = load_tokenizer_info(self.model, self.vocab_size)
            return self._info

    def _tokenizer_info_json(self) -> str:
        """The vocabulary serialized, for compile processes (built once)."""
        info = self._get_info()
        with self._compiler_lock:
            if self._info_json is None:
                self._info_json = info.serialize_json()
            return self._info_json

    def _load(self, text: str) -> Any:
        """A compile process's serialized grammar, rebuilt against this engine's vocabulary."""
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(text, self._get_info())

    def _get_compiler(self) -> Any:
        info = self._get_info()
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                # cache_enabled=False: the LRU above is the cache (xgrammar 0.2.x's own per-rule cache
                # fails a check on string patterns with a bounded repetition, e.g. "^[a-z]{1,300}$")
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


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
