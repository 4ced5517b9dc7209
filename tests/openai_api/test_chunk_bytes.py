"""Stream chunks are built as plain dicts (bodies.dump) for speed; their bytes must be exactly what the
pydantic response models give (`model_dump_json(exclude_unset=True)`, the chunks' reference: the code
the builders used before). Randomized deltas through both, compared chunk by chunk and for the whole
(non-streaming) response: n > 1, batched prompts, logprobs with top-k (non-finite values, token texts
missing or differing), stop strings and stop token ids, finish, usage, system_fingerprint, echo,
return_token_ids, return_tokens_as_token_ids, prompt_logprobs, tool calls."""

from __future__ import annotations

import itertools
import math
import random
from itertools import islice
from typing import Any

import pytest

from frontend_svc.openai import bodies, tools
from frontend_svc.openai import protocol as p
from frontend_svc.openai.tool_parsers import HermesParser, RequiredParser
from frontend_svc.outputs import CompletionDelta, TokenLogprob, Usage
from tests.openai_api.test_tool_calls import HERMES, REQUIRED

PIECES = ["a", " the", "é", "日本", "😀", '"q"', "\\", "\n", "\t", "\x00", "\x1f", "\u2028", "\x7f", "", " ",
          "<tool_call>", '{"name": "f", "arguments": {"x": 1}}', "</tool_call>", "[", "]", "ü\u0301"]
FLOATS = [0.0, -0.0, -1e-9, -1.5e-7, -0.1, -0.123456789, -1.0, -2.5, -13.37, -1e5, -9999.0, -1e16,
          -math.inf, math.inf, math.nan, -3.4028234663852886e38, -1 / 3]


def vllm_ranked(entry: TokenLogprob) -> dict[int, tuple[float, str | None]]:
    """The oracle's logprob dict of a position, as vLLM builds it: the token first, then the top-N by
    rank, each id once (a later duplicate of an id is dropped)."""
    texts = entry.top_texts if entry.top_texts is not None else [None] * len(entry.top)
    ranked = {entry.token_id: (entry.logprob, entry.text)}
    for (tid, lp), text in zip(entry.top, texts):
        ranked.setdefault(tid, (lp, text))
    return ranked


class Texts:
    """TokenTexts' interface: an id's text."""

    def text(self, token_id: int) -> str:
        return PIECES[token_id % len(PIECES)] + str(token_id % 3)


class PydanticCompletion(bodies.CompletionBuilder):
    """The reference: completions chunks as the response models built them."""

    def chunk(self, prompt_index: int, delta: CompletionDelta, with_usage: bool) -> str | None:
        shown = self.shown(prompt_index, delta)  # what to show is shared; how it is serialised is not
        if shown is None:
            return None
        first, text, logprobs = shown
        out = p.CompletionChoice(index=self.index(prompt_index, delta), text=text,
                                 logprobs=None if logprobs is None else p.CompletionLogprobs(**logprobs),
                                 finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
        if first and (self.extras.echo or self.extras.token_ids):
            out.prompt_token_ids = self.prompts[prompt_index].token_ids
        if self.extras.token_ids:
            out.token_ids = list(delta.token_ids)
        body = p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[out])
        if delta.finish_reason is not None and not with_usage and self.extras.fingerprint is not None:
            body.system_fingerprint = self.extras.fingerprint
        return self._dump(body, with_usage)


class PydanticChat(bodies.ChatBuilder):
    """The reference: chat chunks (and their logprobs) as the response models built them."""

    def chunk(self, prompt_index: int, delta: CompletionDelta, with_usage: bool) -> str | None:
        shown = self.shown(prompt_index, delta)  # what to show is shared; the logprobs (models, below) and JSON are not
        if shown is None:
            return None
        index, message, finish_reason, logprobs = shown
        if message is None:
            message = p.DeltaMessage(content=delta.text) if delta.text else p.DeltaMessage()
        out = p.ChatChunkChoice(index=index, delta=message, logprobs=logprobs, finish_reason=finish_reason)
        if delta.finish_reason is not None:
            out.stop_reason = delta.stop_reason
        if self.extras.token_ids:
            out.token_ids = list(delta.token_ids)
        body = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[out])
        if delta.finish_reason is not None and not with_usage and self.extras.fingerprint is not None:
            body.system_fingerprint = self.extras.fingerprint
        return self._dump(body, with_usage)

    def add(self, prompt_index: int, delta: CompletionDelta) -> None:
        choice = self._record(prompt_index, delta)
        choice.text.append(delta.text)
        choice.token_ids.extend(delta.token_ids)
        logprobs = self._logprobs(delta)
        if logprobs is not None and logprobs.content is not None:
            choice.chat_logprobs = [*(choice.chat_logprobs or []), *logprobs.content]  # type: ignore[list-item]

    def _logprobs(self, delta: CompletionDelta) -> p.ChatLogprobs | None:  # type: ignore[override]
        if self.top_n is None or delta.logprobs is None:
            return None
        content = []
        for entry in delta.logprobs:
            top = []
            for tid, (lp, text) in islice(vllm_ranked(entry).items(), self.top_n or 0):
                token = self._token(tid, text)
                top.append(p.TopLogprob(token=token, logprob=bodies.finite(lp), bytes=bodies.utf8(token)))
            content.append(p.ChatTokenLogprob(token=self._token(entry.token_id, entry.text),
                                              logprob=bodies.finite(entry.logprob),
                                              bytes=bodies.utf8(self._text(entry.token_id, entry.text)),
                                              top_logprobs=top))
        return p.ChatLogprobs(content=content)


def _entry(rng: random.Random, top_n: int) -> TokenLogprob:
    top = [(rng.randrange(200), rng.choice(FLOATS)) for _ in range(rng.randint(0, top_n + 1))]
    texts = [rng.choice(PIECES) for _ in top] if rng.random() < 0.5 else None
    return TokenLogprob(token_id=rng.randrange(200), logprob=rng.choice([*FLOATS, -rng.random() * 20]),
                        rank=rng.randint(1, 50), top=top, text=rng.choice([None, *PIECES]), top_texts=texts)


def _deltas(rng: random.Random, n: int, top_n: int | None, prompt_len: int) -> list[CompletionDelta]:
    """One completion's deltas (several tokens each at times), the last finished with usage."""
    out = []
    steps = rng.randint(1, 6)
    for step in range(steps):
        size = rng.choice([0, 1, 1, 2, 4])
        ids = [rng.randrange(200) for _ in range(size)]
        last = step == steps - 1
        delta = CompletionDelta(request_id="r", index=rng.randrange(n), text="".join(rng.choice(PIECES) for _ in ids),
                                token_ids=ids,
                                logprobs=[_entry(rng, top_n) for _ in ids] if top_n is not None else None)
        if step == 0:
            delta.prompt_logprobs = [_entry(rng, 2) for _ in range(prompt_len - 1)]
        if last:
            delta.finish_reason = rng.choice(["stop", "length", "abort"])
            delta.stop_reason = rng.choice([None, 7, "END", 'st"op\n'])
            delta.usage = Usage(prompt_len, rng.randint(0, 9), rng.randint(0, prompt_len))
        out.append(delta)
    return out


class _Ids:
    """uuid4 stand-in: tool-call ids the same in both builders."""

    def __init__(self) -> None:
        self.count = itertools.count()

    def uuid4(self) -> Any:
        return type("U", (), {"hex": f"{next(self.count):032x}"})()


def _case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    chat = seed % 2 == 0
    tool = rng.choice([None, None, HermesParser, RequiredParser]) if chat else None
    n, prompts = 1 if tool else rng.randint(1, 3), 1 if chat else rng.randint(1, 2)
    top_n = rng.choice([None, 0, 1, 2, 5])
    extras = bodies.Extras(echo=not chat and rng.random() < 0.3, token_ids=rng.random() < 0.3,
                            as_token_ids=rng.random() < 0.3, prompt_logprobs=rng.random() < 0.3,
                            fingerprint=rng.choice([None, "fp_1"]))
    if extras.echo and rng.random() < 0.3:
        extras = bodies.Extras(echo=True, echo_only=True, token_ids=extras.token_ids,
                                as_token_ids=extras.as_token_ids, prompt_logprobs=True, fingerprint=extras.fingerprint)
    infos = [bodies.PromptInfo(text="".join(rng.choice(PIECES) for _ in range(3)),
                                token_ids=[rng.randrange(200) for _ in range(rng.randint(1, 4))]) for _ in range(prompts)]
    batches = [(i, d) for i, info in enumerate(infos) for d in _deltas(rng, n, top_n, len(info.token_ids))]
    rng.shuffle(batches)  # prompts interleave; a choice's own deltas stay in order below
    batches.sort(key=lambda item: item[0])
    if tool is not None:  # the text of a real call, cut at random places over the deltas
        script = HERMES if tool is HermesParser else REQUIRED
        cuts = sorted(rng.randint(0, len(script)) for _ in range(len(batches) - 1))
        for (_, delta), a, b in zip(batches, [0, *cuts], [*cuts, len(script)], strict=True):
            delta.text = script[a:b]
    return {"chat": chat, "n": n, "prompts": prompts, "top_n": top_n, "extras": extras, "infos": infos,
            "batches": batches, "with_usage": rng.random() < 0.5, "echo": rng.choice(["", "Hi é"]), "tool": tool}


def _run(case: dict[str, Any], cls: type, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], str]:
    """Every stream chunk (the role, per-delta and usage chunks), then the whole response of a twin."""
    outputs = []
    for streaming in (True, False):
        monkeypatch.setattr(tools, "uuid", _Ids())
        args = ("id-1", "model", case["n"], case["prompts"], Texts(), case["top_n"])
        if case["chat"]:
            builder = cls(*args, echo=case["echo"], extras=case["extras"])
            tool = case["tool"]
            builder.with_tool_calls((lambda t=tool: tools.ToolCalls(t(), finish_as_tool_calls=True)) if tool else None)
        else:
            builder = cls(*args, extras=case["extras"])
        builder.created = 1700000000
        builder.prompts = case["infos"]
        chunks = builder.role_chunks(case["with_usage"]) if case["chat"] and streaming else []
        for prompt_index, delta in case["batches"]:
            if streaming:
                chunks.append(builder.chunk(prompt_index, delta, case["with_usage"]))
            else:
                builder.add(prompt_index, delta)
        outputs.append([*chunks, builder.usage_chunk()] if streaming else builder.response())
    return outputs[0], outputs[1]


@pytest.mark.parametrize("seed", range(400))
def test_chunks_and_responses_are_the_models_bytes(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    case = _case(seed)
    new, reference = (bodies.ChatBuilder, PydanticChat) if case["chat"] else \
        (bodies.CompletionBuilder, PydanticCompletion)
    chunks, response = _run(case, new, monkeypatch)
    want_chunks, want_response = _run(case, reference, monkeypatch)
    assert [c for c in chunks if c is not None], "every case streams something"
    assert chunks == want_chunks
    assert response == want_response
