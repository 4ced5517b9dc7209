"""Stop strings for SMG's protocol: the engine ends a sample as soon as its text contains one.

SMG sends token ids and stop strings; vLLM's servicer detokenizes in the engine to find them, so the
sample stops at the step that completes the match and no compute is spent after it. tandem's engine
needs no tokenizer otherwise, so this one is loaded only for this protocol, lazily (the first request
with stop strings), in a thread, from the tokenizer files the engine already serves (GetTokenizer's
archive: tokenizer.json). The detokenizer and the stop checker are the frontend's own, in
shared_runtime/ (detokenizer.py, stop.py): the text matched is exactly the text a tandem frontend
would match on.

`sample_stops(tokenizer, plan)` builds a call's checkers (blocking: the servicer runs it on a worker
thread). `SampleStops.feed(new_ids, allow_stop)` returns the stop string that matched, or None. It runs
on the servicer's event loop, per step and sample with stop strings (one incremental decode of the new ids).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import tokenizers

from engine_svc.api.smg.request import SmgPlan
from engine_svc.api.tokenizer_archive import TokenizerArchive
from shared_runtime import tokenizer_bundle
from shared_runtime.detokenizer import IncrementalDetokenizer
from shared_runtime.stop import StopAutomaton, StopChecker, compile_stops
from shared_runtime.token_texts import TokenTexts


class NoTokenizer(RuntimeError):
    """The engine has no tokenizer.json to detokenize with (a .gguf model, or none at all)."""


class StopTokenizer:
    """The tokenizer and its shared single-token text cache, for stop-string detection."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self.backend = backend
        self.texts = TokenTexts(backend)

    @classmethod
    def from_archive(cls, archive: TokenizerArchive | None) -> StopTokenizer:
        """Built from the served archive's tokenizer.json (blocking: call it in a thread)."""
        if archive is None:
            raise NoTokenizer("this engine serves no tokenizer files")
        files = tokenizer_bundle.unpack(archive.data, archive.sha256)
        if "tokenizer.json" not in files:
            raise NoTokenizer("this engine's model has no tokenizer.json (a .gguf file)")
        return cls(tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode()))


class LazyStopTokenizer:
    """Loads the `StopTokenizer` once, off the event loop, the first time it is needed."""

    def __init__(self, archive: asyncio.Future[TokenizerArchive | None] | None) -> None:
        self._archive = archive
        self._loaded: asyncio.Future[StopTokenizer] | None = None

    async def get(self) -> StopTokenizer:
        """The tokenizer; raises `NoTokenizer` when the model has none."""
        if self._loaded is None:
            self._loaded = asyncio.ensure_future(self._load())
        return await asyncio.shield(self._loaded)

    async def _load(self) -> StopTokenizer:
        archive = await self._archive if self._archive is not None else None
        return await asyncio.get_running_loop().run_in_executor(None, StopTokenizer.from_archive, archive)


def sample_stops(tokenizer: StopTokenizer, plan: SmgPlan) -> list[SampleStops]:
    """One checker per sample of `plan`, sharing one automaton and one primed detokenizer's state
    (blocking: pure Python linear in the stop strings and the prompt)."""
    automaton = compile_stops(plan.stop)
    first = SampleStops(tokenizer, plan.prompt_token_ids, plan.stop, plan.include_stop_str_in_output,
                        plan.skip_special_tokens)
    return [first] + [first.copy_for(plan.stop, plan.include_stop_str_in_output, automaton)
                      for _ in plan.children[1:]]


class SampleStops:
    """One sample's text, incrementally, and the stop strings matched on it."""

    __slots__ = ("_checker", "_detok")

    def __init__(self, tokenizer: StopTokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str],
                 include_stop_str_in_output: bool, skip_special_tokens: bool) -> None:
        self._detok = IncrementalDetokenizer(tokenizer.backend, prompt_token_ids, skip_special_tokens,
                                             tokenizer.texts)
        self._checker = StopChecker(stop, include_stop_str_in_output)

    def copy_for(self, stop: Sequence[str], include_stop_str_in_output: bool,
                 automaton: StopAutomaton | None = None) -> SampleStops:
        """A twin with the same primed detokenizer (the n samples of one prompt decode it once)."""
        twin = SampleStops.__new__(SampleStops)
        twin._detok = self._detok.copy()
        twin._checker = StopChecker(stop, include_stop_str_in_output, automaton)
        return twin

    def feed(self, new_token_ids: Sequence[int], allow_stop: bool = True) -> str | None:
        """The stop string the text now contains (first to end), or None."""
        delta = self._detok.add(new_token_ids)
        if not delta:
            return None
        return self._checker.feed(delta, allow_stop)[1]
