"""The logprob rows' cached token forms (bodies.TokenPieces) are what the uncached form gives: vLLM's
ranked dict of a position (test_chunk_bytes' `vllm_ranked`), each token as the response shows it (`_token`: its own
text, the text the entry carries, or "token_id:N") with the UTF-8 of that. One cache serves every
request of an app, so it is checked across requests with and without return_tokens_as_token_ids and
with texts that differ by context (a piece of a multi-byte character), and it stays bounded; so are the
chat rows' JSON fragments cached beside them (`TokenPieces.json`, the stream chunks' logprobs).
(tests/openai_api/test_chunk_bytes.py checks the chat chunks' bytes; its completions side shares
`_logprobs` with the builders, so the completions rows are checked here.)"""

from __future__ import annotations

import random
from itertools import islice
from typing import Any

import pytest

from frontend_svc.openai import bodies
from frontend_svc.outputs import CompletionDelta, TokenLogprob
from tests.openai_api.test_chunk_bytes import FLOATS, PIECES, Texts, vllm_ranked


class _App:
    """TokenTexts' shape: texts and the one `pieces` cache every builder of the app shares."""

    def __init__(self) -> None:
        self.texts = Texts()
        self.pieces = bodies.TokenPieces(self.texts)

    def text(self, token_id: int) -> str:
        return self.texts.text(token_id)


def _entry(rng: random.Random) -> TokenLogprob:
    top = [(rng.randrange(30), rng.choice(FLOATS)) for _ in range(rng.randint(0, 7))]  # ids repeat
    texts = [rng.choice(PIECES) for _ in range(rng.randint(len(top) - 1, len(top)))] if rng.random() < 0.5 else None
    return TokenLogprob(token_id=rng.randrange(30), logprob=rng.choice(FLOATS), rank=1, top=top,
                        text=rng.choice([None, *PIECES]), top_texts=texts)


def _expected(builder: bodies._Builder, entry: TokenLogprob, count: int) -> list[tuple[tuple[str, list[int]], float]]:
    rows = []
    for tid, (lp, text) in islice(vllm_ranked(entry).items(), count):
        token = builder._token(tid, text)
        rows.append(((token, bodies.utf8(token)), bodies.finite(lp)))
    return rows


def test_cached_rows_are_the_uncached_rows_across_requests_and_options() -> None:
    rng = random.Random(19)
    app = _App()
    for _ in range(300):
        as_ids = rng.random() < 0.5
        builder = bodies.ChatBuilder("id", "m", 1, 1, app, 5, extras=bodies.Extras(as_token_ids=as_ids))  # type: ignore[arg-type]
        assert builder.pieces is app.pieces
        for _ in range(5):
            entry, count = _entry(rng), rng.randint(0, 7)
            got = app.pieces.ranked(entry, count, as_ids)
            assert repr(got) == repr(_expected(builder, entry, count))  # repr: NaN == NaN, -0.0 != 0.0
            chat = builder._chat_token(entry)
            assert chat["token"] == builder._token(entry.token_id, entry.text)
            assert chat["bytes"] == bodies.utf8(builder._text(entry.token_id, entry.text))
        # the stream chunks' logprobs JSON, from the rows' JSON cached across requests, is the dicts' dump
        delta = CompletionDelta(request_id="r", index=0, text="", token_ids=[], logprobs=[_entry(rng) for _ in range(3)])
        assert builder._logprobs_json(delta) == bodies.dump(builder._logprobs(delta))


def test_the_tables_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bodies, "_TOKEN_CACHE_LIMIT", 8)
    pieces = bodies.TokenPieces(Texts())
    tables: Any = (*pieces._by_id, pieces._by_text, pieces._json, *pieces._json_by_id)
    for token_id in range(100):
        assert pieces.of(token_id, None, token_id % 2 == 0) == pieces.of(token_id, None, token_id % 2 == 0)
        pieces.of(token_id, f"t{token_id}", False)
        entry = TokenLogprob(token_id=token_id, logprob=-1.0, rank=1, top=[(token_id + 1, -2.0), (token_id + 2, -3.0)])
        pieces.rows_json(entry, pieces.json(f"own{token_id}"), 3, token_id % 3 == 0, [], [])
        assert all(len(table) <= 8 for table in tables)
