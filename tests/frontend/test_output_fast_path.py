"""The output processor's shortcuts give what its general path gives.

- The fast path (`OutputProcessor._process_one` for a plain completion past its first delta) against the
  general path, forced by a stop string that never occurs: the same deltas for every kind of output that
  may arrive in the fast path's shape (a finish, an error with or without a finish reason, a stop token,
  cached tokens reported late, an empty step, a character split over tokens).
- The per-tokenizer set of character pieces (`TokenTexts.pieces`) against decoding each id, and the
  logprob rows built from it (a piece among the top-N alternatives gets its context text).
- The deferred decode of a served plain completion (the steps that come while its output is unread are
  decoded when the reader takes it): what the general path gives, and two tokenizer calls per read, not
  one per step.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from frontend_svc.delta_collector import DeltaCollector, SinkBatch
from frontend_svc.output_processor import SETTLE_AT, OutputProcessor, partial_token_text
from frontend_svc.processor import Processor
from shared_runtime import contract as p
from shared_runtime.contract import SamplingParams
from shared_runtime.to_pb import outputs_to_pb
from shared_runtime.token_texts import TokenTexts

EOS = 1  # <|eos|> in the tiny tokenizer
NEVER = "\x00never"  # a stop string no output contains: the general path, same text
ERROR = p.EngineError(code=p.ErrorCode.INTERNAL, message="worker died")


@pytest.fixture
def processor(tokenizer):
    return Processor(tokenizer, max_model_len=512, vocab_size=tokenizer.vocab_size, model_name="tiny")


def _deltas(tokenizer, processor, stop, steps):
    """Every delta of one request (n=1) fed `steps` (kwargs of an EngineCoreOutput each), as tuples."""
    op = OutputProcessor(tokenizer)
    state = op.add_request(processor.process("Mara walked", SamplingParams(max_tokens=400, stop=stop)))
    rid = state.prepared.engine_request_ids[0]
    deltas = []
    for kwargs in steps:
        message = outputs_to_pb(p.EngineCoreOutputs(outputs=[p.EngineCoreOutput(request_id=rid, **kwargs)]))
        deltas += op.process_outputs(message).deltas
    assert state.done
    return [(d.text, d.token_ids, d.finish_reason, d.stop_reason, d.usage, d.error) for d in deltas]


ENDINGS = {
    "length": {"finish_reason": p.FinishReason.LENGTH},
    "abort": {"finish_reason": p.FinishReason.ABORT},
    "eos": {"finish_reason": p.FinishReason.STOP, "stop_token_id": EOS},
    "error": {"finish_reason": p.FinishReason.ERROR, "error": ERROR},
    "error without a finish reason": {"error": ERROR},
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_the_fast_path_gives_what_the_general_path_gives(tokenizer, processor, encode, ending):
    ids = encode(" the boats rocked € against their ropes, naïve 🌊 café")
    rng = random.Random(ending)
    steps = [{"new_token_ids": ids[:1]}]
    position = 1
    while position < len(ids) - 1:
        size = rng.choice([0, 1, 1, 1, 2])  # an empty step now and then; sometimes two tokens
        step = {"new_token_ids": ids[position:position + size]}
        if position > 6 and rng.random() < 0.2:
            step["num_cached_tokens"] = 3  # reported late: still counted in the usage
        steps.append(step)
        position += len(step["new_token_ids"])
    last = dict(ENDINGS[ending])
    last["new_token_ids"] = ids[position:] + ([EOS] if ending == "eos" else [])
    steps.append(last)
    fast = _deltas(tokenizer, processor, [], steps)
    general = _deltas(tokenizer, processor, [NEVER], steps)
    assert fast == general
    assert "".join(d[0] for d in fast) == tokenizer.backend.decode(ids)  # EOS's text left out
    _, _, finish, _, usage, error = fast[-1]
    assert finish == ("stop" if ending == "eos" else ending.split()[0])
    assert (error is not None) == ending.startswith("error")
    assert usage.cached_prompt_tokens == (3 if any("num_cached_tokens" in s for s in steps) else 0)
    assert sum(len(d[1]) for d in fast) == usage.completion_tokens == sum(len(s["new_token_ids"]) for s in steps)


class CountingBackend:
    """A tokenizers backend that counts its `decode` calls."""

    def __init__(self, backend):
        self._backend, self.decodes = backend, 0

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self._backend.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backend, name)


async def _read_behind(tokenizer, processor, steps, seed, backend=None):
    """The request fed `steps` with a `DeltaCollector` read after a random number of steps (a reader
    that falls behind; every 4th step with `seed` None); returns what the reader got, as tuples, and the
    decodes of the steady steps."""
    if backend is not None:  # its single-token texts cached beforehand, as a serving frontend's are
        texts = TokenTexts(backend)
        for kwargs in steps:
            for token_id in kwargs["new_token_ids"]:
                texts.text(token_id, True)
        tokenizer = type("T", (), {"backend": backend, "token_texts": texts})()
    op = OutputProcessor(tokenizer)
    collector = DeltaCollector()
    state = op.add_request(processor.process("Mara walked", SamplingParams(max_tokens=400)), collector)
    rid = state.prepared.engine_request_ids[0]
    rng, got, decodes = random.Random(seed), [], 0
    for i, kwargs in enumerate(steps):
        before = backend.decodes if backend is not None else 0
        message = outputs_to_pb(p.EngineCoreOutputs(outputs=[p.EngineCoreOutput(request_id=rid, **kwargs)]))
        assert not op.process_outputs(message).deltas  # all of it went to the collector
        due = i % 4 == 3 if seed is None else rng.random() < 0.25
        if collector.num_pending and (i == len(steps) - 1 or due):
            got += await collector.get()
        if backend is not None and 0 < i < len(steps) - 1:
            decodes += backend.decodes - before
    assert state.done
    return [(d.text, d.token_ids, d.finish_reason, d.stop_reason, d.usage, d.error) for d in got], decodes


def _merged(deltas):
    text, ids = "".join(d[0] for d in deltas), [t for d in deltas for t in d[1]]
    return text, ids, deltas[-1][2:]


@pytest.mark.parametrize("ending", sorted(ENDINGS))
@pytest.mark.parametrize("seed", range(3))
def test_a_reader_that_is_behind_gets_what_the_general_path_gives(tokenizer, processor, encode, ending, seed):
    """Served at interval 1, a plain completion's text is decoded when its reader takes it: the same
    concatenation and finish as the general path, wherever the reads fall (a character split over
    tokens and its ids taken in between included)."""
    ids = encode(" the boats rocked € against their ropes, naïve 🌊 café")
    steps = [{"new_token_ids": ids[i:i + 1]} for i in range(len(ids) - 1)]
    last = dict(ENDINGS[ending])
    last["new_token_ids"] = ids[-1:] + ([EOS] if ending == "eos" else [])
    steps.append(last)
    got, _ = asyncio.run(_read_behind(tokenizer, processor, steps, seed))
    assert _merged(got) == _merged(_deltas(tokenizer, processor, [NEVER], steps))


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_sink_writes_a_batchs_steps_decoded_and_merged(tokenizer, processor, encode, ending):
    """A reader parked with a sink (the SSE writer): the steps of one engine batch (1-3 per message) join
    one delta whose ids are decoded before the sink writes it (`flush` settles), one write per batch; the
    sink's deltas and the reader's finish concatenate to the general path's text, ids and finish."""
    ids = encode(" the boats rocked € against their ropes, naïve 🌊 café")
    steps = [{"new_token_ids": ids[i:i + 1]} for i in range(len(ids) - 1)]
    last = dict(ENDINGS[ending])
    last["new_token_ids"] = ids[-1:] + ([EOS] if ending == "eos" else [])
    steps.append(last)

    async def run():
        op, collector, batch = OutputProcessor(tokenizer), DeltaCollector(), SinkBatch()
        collector.batch = batch
        written = []
        collector.sink = lambda d: d.finish_reason is None and (written.append(d) or True)
        state = op.add_request(processor.process("Mara walked", SamplingParams(max_tokens=400)), collector)
        rid = state.prepared.engine_request_ids[0]
        reader = asyncio.ensure_future(collector.get())
        await asyncio.sleep(0)  # parked
        rng, i, batches = random.Random(ending), 0, 0
        while i < len(steps):
            size = rng.choice([1, 2, 3])
            outputs = [p.EngineCoreOutput(request_id=rid, **kwargs) for kwargs in steps[i:i + size]]
            assert not op.process_outputs(outputs_to_pb(p.EngineCoreOutputs(outputs=outputs))).deltas
            batch.flush()
            i, batches = i + size, batches + 1
        got = await asyncio.wait_for(reader, 5)
        assert state.done and len(written) == batches - 1  # one write per batch; the last holds the finish
        assert len(written) < len(steps) - 1  # batches of several steps were written as one
        return [(d.text, d.token_ids, d.finish_reason, d.stop_reason, d.usage, d.error) for d in written + got]

    got = asyncio.run(run())
    assert _merged(got) == _merged(_deltas(tokenizer, processor, [NEVER], steps))


def test_a_reader_that_is_behind_costs_two_decodes_per_read(tokenizer, processor, encode):
    """Of the steady steps between two reads, the first is decoded as it comes (a reader that keeps up
    takes it as is) and the rest cost no tokenizer call: the read decodes their ids at once."""
    ids = encode(" the boats rocked against their ropes while the harbour slept and the gulls")
    steps = [{"new_token_ids": ids[i:i + 1]} for i in range(len(ids) - 1)]
    steps.append({"new_token_ids": ids[-1:], "finish_reason": p.FinishReason.LENGTH})
    backend = CountingBackend(tokenizer.backend)
    got, decodes = asyncio.run(_read_behind(tokenizer, processor, steps, None, backend))
    reads = len(got)
    assert len(steps) // 4 <= reads < len(steps) // 2  # the reader was behind
    assert decodes <= 2 * reads  # the first step's and the read's, not one per step
    assert "".join(d[0] for d in got) == tokenizer.backend.decode(ids)


def test_a_reader_that_stays_away_has_its_output_decoded_in_bounded_pieces(tokenizer, processor, encode):
    """However long a reader stays away, no more than SETTLE_AT ids wait to be decoded at once (one
    decode on the event loop stays small), and what it finally reads is the whole text."""
    ids = encode(" the boats rocked against their ropes while the harbour slept and the gulls") * 4
    op = OutputProcessor(tokenizer)
    collector = DeltaCollector()
    state = op.add_request(processor.process("Mara walked", SamplingParams(max_tokens=400)), collector)
    (completion,) = state.unfinished.values()
    rid = state.prepared.engine_request_ids[0]
    waiting = []
    for i, token in enumerate(ids):
        finish = p.FinishReason.LENGTH if i == len(ids) - 1 else 0
        op.process_outputs(outputs_to_pb(p.EngineCoreOutputs(outputs=[
            p.EngineCoreOutput(request_id=rid, new_token_ids=[token], finish_reason=finish)])))
        waiting.append(len(completion.undecoded))
    assert len(ids) > 2 * SETTLE_AT and max(waiting) == SETTLE_AT - 1
    (delta,) = asyncio.run(collector.get())
    assert delta.text == tokenizer.backend.decode(ids) and delta.token_ids == ids and delta.finish_reason == "length"


def test_pieces_are_the_ids_whose_own_decode_is_a_piece(tokenizer):
    backend = tokenizer.backend
    pieces = TokenTexts(backend).pieces()
    size = backend.get_vocab_size(with_added_tokens=True)
    assert pieces == {t for t in range(size) if backend.decode([t], skip_special_tokens=False).endswith("\ufffd")}
    assert pieces, "the tiny tokenizer splits multi-byte characters"
    assert tokenizer.token_texts.pieces() is tokenizer.token_texts.pieces()  # decoded once per tokenizer


def test_a_piece_among_the_alternatives_gets_its_context_text(tokenizer, processor, encode):
    """vLLM's text of a top-N alternative that is a piece of a character depends on the ids before it;
    the others are their own decode."""
    decode = lambda ids: tokenizer.backend.decode(ids, skip_special_tokens=False)  # noqa: E731
    ids = encode(" a€ b€")
    euro = encode("€")
    whole = encode(" the")[0]
    op = OutputProcessor(tokenizer)
    state = op.add_request(processor.process("Mara walked", SamplingParams(logprobs=3)))
    rid = state.prepared.engine_request_ids[0]
    context: list[int] = []
    for i, token in enumerate(ids):
        top = [token, euro[0], euro[-1], whole]
        entry = p.TokenLogprobs(token_id=token, logprob=-0.5, rank=1, top_token_ids=top,
                                top_logprobs=[-0.5, -1.0, -2.0, -3.0])
        finish = p.FinishReason.LENGTH if i == len(ids) - 1 else 0
        message = outputs_to_pb(p.EngineCoreOutputs(outputs=[
            p.EngineCoreOutput(request_id=rid, new_token_ids=[token], new_logprobs=[entry], finish_reason=finish)]))
        (delta,) = op.process_outputs(message).deltas
        (lp,) = delta.logprobs
        expected = [partial_token_text(decode, t, context) if decode([t]).endswith("\ufffd") else decode([t])
                    for t in top]
        assert lp.top_texts == expected
        assert lp.text == expected[0]
        context = [*context, token][-4:]
    assert len(euro) > 1
