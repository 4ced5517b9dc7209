"""OutputProcessor + RequestOutputAccumulator over `tandem.engine.v1.EngineCoreOutputs`.

Steps are written as contract structs and converted with shared_runtime/to_pb.py, as the engine sends them.
"""

from __future__ import annotations

import pytest

from frontend_svc.output_processor import OutputProcessor
from frontend_svc.outputs import RequestOutputAccumulator
from frontend_svc.processor import Processor
from shared_runtime import contract as p
from shared_runtime.contract import SamplingParams
from shared_runtime.to_pb import outputs_to_pb

EOS = 1  # <|eos|>, a special token in the tiny tokenizer
GEN = " the boats rocked against their ropes"


@pytest.fixture
def processor(tokenizer):
    return Processor(tokenizer, max_model_len=256, vocab_size=tokenizer.vocab_size, model_name="tiny")


@pytest.fixture
def op(tokenizer):
    return OutputProcessor(tokenizer)


def out(rid, ids=(), finish=p.FinishReason.UNSPECIFIED, **kwargs):
    return p.EngineCoreOutput(request_id=rid, new_token_ids=list(ids), finish_reason=finish, **kwargs)


def step(op, *outputs):
    return op.process_outputs(outputs_to_pb(p.EngineCoreOutputs(outputs=list(outputs))))


def add_state(op, processor, params, prompt="Mara walked", request_id=None):
    """Add a request; returns its RequestState (the record of its unfinished completions)."""
    return op.add_request(processor.process(prompt, params, request_id=request_id))


def add(op, processor, params, prompt="Mara walked", request_id=None):
    return add_state(op, processor, params, prompt, request_id).prepared


def stream_tokens(op, rid, ids, last_finish=p.FinishReason.LENGTH, **last_kwargs):
    """One token per step, the last output finishing; returns (all deltas, all reqs_to_abort)."""
    deltas, aborts = [], []
    for i, token in enumerate(ids):
        final = i == len(ids) - 1
        result = step(op, out(rid, [token], last_finish if final else 0, **(last_kwargs if final else {})))
        deltas += result.deltas
        aborts += result.reqs_to_abort
    return deltas, aborts


def test_streaming_text_finish_and_usage_on_the_last_delta(op, processor, encode):
    state = add_state(op, processor, SamplingParams(max_tokens=50))
    prepared = state.prepared
    rid = prepared.engine_request_ids[0]
    ids = encode(GEN)
    step(op, out(rid, [], num_cached_tokens=0))  # nothing new: no delta
    deltas, aborts = stream_tokens(op, rid, ids, num_cached_tokens=16)
    assert aborts == [] and len(deltas) == len(ids)
    assert "".join(d.text for d in deltas) == GEN
    assert [t for d in deltas for t in d.token_ids] == ids
    assert [d.finish_reason for d in deltas] == [None] * (len(ids) - 1) + ["length"]
    assert all(d.usage is None for d in deltas[:-1])
    usage = deltas[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (
        len(prepared.prompt_token_ids), len(ids), 16)
    assert {d.request_id for d in deltas} == {prepared.request_id}
    assert state.done and state.num_unfinished == 0
    assert step(op, out(rid, [5])).deltas == []  # finished ids are forgotten


def test_n_completions_fan_in(op, processor, encode):
    state = add_state(op, processor, SamplingParams(n=2, max_tokens=50), request_id="client")
    prepared = state.prepared
    acc = RequestOutputAccumulator()
    acc.add_request(prepared)
    first, second = prepared.engine_request_ids
    a, b = encode(" the boats"), encode(" a radio played")
    assert len(a) < len(b)
    done = []
    for i in range(max(len(a), len(b))):
        outputs = []
        if i < len(a):
            outputs.append(out(first, [a[i]], p.FinishReason.LENGTH if i == len(a) - 1 else 0))
        if i < len(b):
            outputs.append(out(second, [b[i]], p.FinishReason.STOP if i == len(b) - 1 else 0))
        result = step(op, *outputs)
        for delta in result.deltas:
            done.append(acc.add_delta(delta))
        if i == len(a) - 1:  # index 0 finished, index 1 still running
            assert list(state.unfinished) == [second] and result.finished == []
    assert done.count(True) == 1 and done[-1] is True
    result = acc.get("client")
    assert result.finished and result.prompt == "Mara walked"
    assert result.prompt_token_ids == prepared.prompt_token_ids
    assert [(o.index, o.text, o.finish_reason) for o in result.outputs] == [
        (0, " the boats", "length"), (1, " a radio played", "stop")]
    assert result.outputs[1].token_ids == b
    assert state.done


@pytest.mark.parametrize(("include", "expected"), [(False, " the "), (True, " the boats")])
def test_stop_string_finishes_here_and_asks_the_engine_to_abort(op, processor, encode, include, expected):
    state = add_state(op, processor, SamplingParams(max_tokens=50, stop=["boats"],
                                                    include_stop_str_in_output=include))
    prepared = state.prepared
    rid = prepared.engine_request_ids[0]
    ids = encode(GEN)
    deltas, aborts = [], []
    for token in ids:
        result = step(op, out(rid, [token]))
        deltas += result.deltas
        aborts += result.reqs_to_abort
    assert aborts == [rid]
    assert "".join(d.text for d in deltas) == expected
    last = deltas[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", "boats")
    assert sum(d.finished for d in deltas) == 1
    assert last.usage.completion_tokens == len(encode(" the boats"))  # later tokens were ignored
    assert step(op, out(rid, [], p.FinishReason.ABORT)).deltas == []  # the abort's acknowledgement
    assert state.done


def test_stop_string_in_the_first_token_and_with_an_engine_finish(op, processor, encode):
    prepared = add(op, processor, SamplingParams(stop=["the"]))
    rid = prepared.engine_request_ids[0]
    result = step(op, out(rid, encode(" the boats"), p.FinishReason.LENGTH))
    assert result.reqs_to_abort == []  # the engine already finished it
    (delta,) = result.deltas
    assert (delta.text, delta.finish_reason, delta.stop_reason) == (" ", "stop", "the")


def test_other_finish_flushes_held_back_text(op, processor, encode):
    prepared = add(op, processor, SamplingParams(max_tokens=50, stop=["boats!!"]))
    deltas, _ = stream_tokens(op, prepared.engine_request_ids[0], encode(" the boats"))
    assert "".join(d.text for d in deltas) == " the boats"
    assert "boat" not in "".join(d.text for d in deltas[:-1])  # held: it could become "boats!!"
    assert deltas[-1].finish_reason == "length" and deltas[-1].stop_reason is None


@pytest.mark.parametrize("skip_special", [True, False])
def test_eos_text_is_left_out_and_its_stop_reason_is_none(op, processor, encode, skip_special):
    """vLLM: an EOS stop has stop_reason None; the same id asked for in stop_token_ids is reported."""
    prepared = add(op, processor, SamplingParams(max_tokens=50, skip_special_tokens=skip_special))
    ids = [*encode(" the boats"), EOS]
    deltas, _ = stream_tokens(op, prepared.engine_request_ids[0], ids, p.FinishReason.STOP, stop_token_id=EOS)
    assert "".join(d.text for d in deltas) == " the boats"
    assert [t for d in deltas for t in d.token_ids] == ids
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", None)
    asked = add(op, processor, SamplingParams(max_tokens=50, stop_token_ids=[EOS]))
    deltas, _ = stream_tokens(op, asked.engine_request_ids[0], ids, p.FinishReason.STOP, stop_token_id=EOS)
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", EOS)


def test_a_length_cut_inside_a_character_leaves_it_out(op, processor, encode):
    """No trailing U+FFFD: the unfinished character is not part of the text (vLLM '👌🎉🎉🎉🎉🎉')."""
    ids = encode(" a€")
    euro = encode("€")
    assert len(euro) > 1 and ids[-len(euro):] == euro, "the tiny tokenizer should split this character"
    prepared = add(op, processor, SamplingParams(max_tokens=len(ids) - 1))
    deltas, _ = stream_tokens(op, prepared.engine_request_ids[0], ids[:-1])
    assert "".join(d.text for d in deltas) == " a" and deltas[-1].finish_reason == "length"


def test_logprob_tokens_inside_a_character_follow_vllm(op, processor, encode, tokenizer):
    """A piece of a character is "" (text and alternatives), the token that completes it is the whole
    character, as vLLM's logprobs processor writes them."""
    ids = encode(" a€€")
    euro = encode("€")
    prepared = add(op, processor, SamplingParams(logprobs=1))
    rid = prepared.engine_request_ids[0]
    texts = []
    for i, token in enumerate(ids):
        entry = p.TokenLogprobs(token_id=token, logprob=-0.5, rank=1, top_token_ids=[token], top_logprobs=[-0.5])
        (delta,) = step(op, out(rid, [token], p.FinishReason.LENGTH if i == len(ids) - 1 else 0,
                                new_logprobs=[entry])).deltas
        (lp,) = delta.logprobs
        texts.append(lp.text)
        assert lp.top_texts in (None, [lp.text])
    pieces = ["" for _ in euro[:-1]] + ["€"]
    assert texts == [tokenizer.decode([t]) for t in ids[:-2 * len(euro)]] + pieces + pieces


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_text_follows_include_stop_str(op, processor, tokenizer, encode, include):
    ids = encode(" the boats")
    stop = ids[-1]  # an ordinary (not special) token
    prepared = add(op, processor, SamplingParams(stop_token_ids=[stop], include_stop_str_in_output=include))
    deltas, _ = stream_tokens(op, prepared.engine_request_ids[0], ids, p.FinishReason.STOP,
                              stop_token_id=stop)
    expected = " the boats" if include else tokenizer.decode(ids[:-1])
    assert expected != " the boats" or include
    assert "".join(d.text for d in deltas) == expected
    assert deltas[-1].stop_reason == stop


def test_engine_errors_and_aborts_finish_the_completion(op, processor, encode):
    state = add_state(op, processor, SamplingParams(n=2))
    first, second = state.prepared.engine_request_ids
    error = p.EngineError(code=p.ErrorCode.INTERNAL, message="worker died")
    result = step(op, out(first, [], p.FinishReason.ERROR, error=error), out(second, encode(" the"),
                                                                              p.FinishReason.ABORT))
    by_index = {d.index: d for d in result.deltas}
    assert by_index[0].finish_reason == "error"
    assert (by_index[0].error.code, by_index[0].error.message) == (13, "worker died")
    assert by_index[0].usage.completion_tokens == 0
    assert (by_index[1].finish_reason, by_index[1].text, by_index[1].error) == ("abort", " the", None)
    assert state.done and result.finished == [state]


def test_abort_request_finishes_exactly_that_request(op, processor, encode):
    one = add_state(op, processor, SamplingParams(n=2), request_id="dup")
    two = add_state(op, processor, SamplingParams(), request_id="dup")  # clients may reuse an id
    step(op, out(one.prepared.engine_request_ids[0], encode(" the"), p.FinishReason.LENGTH))
    assert op.abort_request(two) == two.prepared.engine_request_ids and two.done
    assert list(one.unfinished) == [one.prepared.engine_request_ids[1]]  # `two` left `one` alone
    assert op.abort_request(one) == [one.prepared.engine_request_ids[1]]  # index 0 had already finished
    assert op.abort_request(one) == [] and one.done
    one = one.prepared
    late = step(op, *(out(rid, [5], p.FinishReason.ABORT) for rid in one.engine_request_ids))
    assert late.deltas == []


def test_min_tokens_delays_stop_strings(op, processor, encode):
    prepared = add(op, processor, SamplingParams(max_tokens=50, min_tokens=2, stop=["the"]))
    ids = encode(" the boats the ropes")
    deltas = []
    for token in ids:
        deltas += step(op, out(prepared.engine_request_ids[0], [token])).deltas
    assert "".join(d.text for d in deltas) == " the boats "
    assert deltas[-1].stop_reason == "the"


def test_logprobs_and_prompt_logprobs(op, processor, encode, tokenizer):
    prepared = add(op, processor, SamplingParams(logprobs=2, prompt_logprobs=1))
    acc = RequestOutputAccumulator()
    acc.add_request(prepared)
    rid = prepared.engine_request_ids[0]
    ids = encode(" the boats")
    prompt_lp = [p.TokenLogprobs(token_id=t, logprob=-1.0, rank=3, top_token_ids=[7], top_logprobs=[-0.5])
                 for t in prepared.prompt_token_ids[1:]]
    for i, token in enumerate(ids):
        entry = p.TokenLogprobs(token_id=token, logprob=-0.25 * (i + 1), rank=1,
                                top_token_ids=[token, 9], top_logprobs=[-0.25 * (i + 1), -3.0])
        output = out(rid, [token], p.FinishReason.LENGTH if i == len(ids) - 1 else 0, new_logprobs=[entry],
                     prompt_logprobs=prompt_lp if i == 0 else [])
        (delta,) = step(op, output).deltas
        assert (delta.prompt_logprobs is not None) == (i == 0)
        (lp,) = delta.logprobs
        assert (lp.token_id, lp.rank, lp.top) == (token, 1, [(token, -0.25 * (i + 1)), (9, -3.0)])
        assert lp.text == tokenizer.decode([token])
        acc.add_delta(delta)
    result = acc.get(prepared.request_id)
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prepared.prompt_token_ids)
    assert result.outputs[0].cumulative_logprob == pytest.approx(sum(-0.25 * (i + 1) for i in range(len(ids))))
    assert len(result.outputs[0].logprobs) == len(ids)


def test_without_logprobs_deltas_carry_none(op, processor, encode):
    prepared = add(op, processor, SamplingParams())
    (delta,) = step(op, out(prepared.engine_request_ids[0], encode(" the"), p.FinishReason.LENGTH)).deltas
    assert delta.logprobs is None and delta.prompt_logprobs is None


def test_outputs_parsed_from_the_wire(op, processor, encode):
    from tandem.engine.v1 import engine_core_pb2 as pb

    prepared = add(op, processor, SamplingParams(n=2))
    first, second = prepared.engine_request_ids
    ids = encode(" the boats")
    message = pb.EngineCoreOutputs(outputs=[
        pb.EngineCoreOutput(request_id=first, new_token_ids=[*ids, EOS], finish_reason=1, stop_token_id=EOS),
        pb.EngineCoreOutput(request_id=second, new_token_ids=ids, finish_reason=2),
    ])
    wire = pb.EngineCoreOutputs.FromString(message.SerializeToString())
    deltas = {d.index: d for d in op.process_outputs(wire).deltas}
    assert (deltas[0].text, deltas[0].stop_reason, deltas[0].error) == (" the boats", None, None)
    assert (deltas[1].text, deltas[1].finish_reason, deltas[1].stop_reason) == (" the boats", "length", None)


def test_a_fault_in_one_completion_fails_only_that_completion(op, processor, encode):
    params = SamplingParams(max_tokens=8)
    broken, healthy = add(op, processor, params), add(op, processor, params, prompt="Tom ran")
    broken_id, healthy_id = broken.engine_request_ids[0], healthy.engine_request_ids[0]
    completion = op._completions[broken_id]

    class Exploding:
        def add(self, ids):
            raise RuntimeError("detokenizer bug")

    completion.detokenizer = Exploding()
    ids = encode(" by the sea")
    result = step(op, out(broken_id, ids[:1]), out(healthy_id, ids[:1]))
    by_id = {d.engine_request_id: d for d in result.deltas}
    assert by_id[broken_id].finish_reason == "error" and by_id[broken_id].error.code == 13
    assert result.reqs_to_abort == [broken_id]  # the engine is told to drop it
    assert by_id[healthy_id].finish_reason is None and by_id[healthy_id].token_ids == ids[:1]
    later = step(op, out(broken_id, ids[1:2]), out(healthy_id, ids[1:2], p.FinishReason.LENGTH))
    assert [d.engine_request_id for d in later.deltas] == [healthy_id]


def test_queue_times_are_handed_out_as_data_with_log_stats(tokenizer, processor, encode):
    queued, scheduled = p.EventType.QUEUED, p.EventType.SCHEDULED
    events = [p.RequestEvent(queued, 100.0), p.RequestEvent(scheduled, 100.25), p.RequestEvent(scheduled, 101.0)]
    for log_stats, expected in ((True, [0.25]), (False, [])):
        op = OutputProcessor(tokenizer, log_stats=log_stats)
        rid = add(op, processor, SamplingParams()).engine_request_ids[0]
        first = step(op, out(rid, encode(" the"), events=events), out("unknown", [5], events=events))
        assert first.queue_times == expected  # one per known request that carries both events
        assert step(op, out(rid, encode(" boats"), p.FinishReason.LENGTH)).queue_times == []
