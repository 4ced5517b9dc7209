"""Structured outputs in the engine (engine_svc/structured/), on a tiny random-weight model: without a
constraint its output is noise, so every match below is the grammar's doing.

Covers: each constraint kind, n > 1 (a matcher per completion), chunked prefill (only rows that sample
are masked and advance), preemption (the matcher keeps the recomputed output), compile errors and aborts
(nothing left behind: no request, block, queue entry or compile claim), the compile cache, WAITING_FOR_FSM
not blocking other requests, and an unconstrained row that is bit-for-bit what it is alone.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from engine_svc.sched.output import GrammarBitmask
from engine_svc.structured.compiler import GrammarCompilers, constraint_key
from engine_svc.structured.grammar import RequestGrammar
from entrypoints import LLM, SamplingParams
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams, StructuredOutputs

NUMBER = r"[1-9][0-9]{0,3}"


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), dtype="float32", block_size=8)


def texts(llm: LLM, prompt, params: SamplingParams) -> list[str]:
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    for completion in out:
        assert completion.error is None, completion.error
    return [c.text for c in out]


def constrained(so: StructuredOutputs, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": 3, "max_tokens": 40, "structured_outputs": so, **kw})


def assert_nothing_left(llm: LLM) -> None:
    core = llm.engine
    sched = core.scheduler
    assert not sched.requests and not sched.running and len(sched.waiting) == 0 and not sched._compiling
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert core.grammars.num_waiting() == 0


def test_regex_and_choice_outputs_match_fully(llm: LLM) -> None:
    for text in texts(llm, [5, 6, 7], constrained(StructuredOutputs(regex=NUMBER + r"-[a-c]{2}"), n=4)):
        assert re.fullmatch(NUMBER + r"-[a-c]{2}", text), text
    choices = ["yes", "no", 'maybe "so"']
    outs = texts(llm, [8, 9], constrained(StructuredOutputs(choice=choices), n=6))
    assert set(outs) <= set(choices)


def test_json_schema_output_validates(llm: LLM) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "tag": {"enum": ["a", "b"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    so = StructuredOutputs(json=json.dumps(schema))
    for text in texts(llm, [11, 12], constrained(so, n=3, max_tokens=150)):
        jsonschema.validate(json.loads(text), schema)


def test_a_string_pattern_with_a_bounded_repetition_compiles(llm: LLM) -> None:
    """xgrammar 0.2.x's own compile cache fails a check on this schema; the compilers turn it off (their
    LRU is the cache)."""
    schema = {"type": "string", "pattern": "^[a-c]{1,300}$"}
    for text in texts(llm, [14], constrained(StructuredOutputs(json=json.dumps(schema)), n=2, max_tokens=60)):
        assert re.fullmatch(r'"[a-c]{1,300}"', text) or (len(text) > 1 and re.fullmatch(r'"[a-c]+', text)), text


def test_an_ebnf_grammar_is_followed(llm: LLM) -> None:
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-z] | root'
    for text in texts(llm, [13], constrained(StructuredOutputs(grammar=grammar), n=3, max_tokens=30,
                                             temperature=0.5)):
        assert re.fullmatch(r"[(a-z,)]+", text) and text.startswith("(") and text.endswith(")"), text


def test_the_unconstrained_row_of_a_mixed_batch_equals_its_run_alone(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[40, 41, 42]], plain, use_tqdm=False)[0].outputs[0].token_ids
    so = constrained(StructuredOutputs(regex=NUMBER), max_tokens=12)
    mixed = llm.generate([[30, 31], [40, 41, 42], [50]], [so, plain, so], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    assert all(re.fullmatch(NUMBER, m.outputs[0].text) for m in (mixed[0], mixed[2]))


def test_chunked_prefill_and_preemption_keep_the_grammar(llama_dir) -> None:
    """A long prompt in 8-token chunks (no bitmask row until its last chunk) and a KV cache so small that
    requests are preempted and recomputed mid-output: every output still matches."""
    small = LLM(str(llama_dir), dtype="float32", block_size=4, num_gpu_blocks_override=14,
                max_num_batched_tokens=8, max_model_len=56)
    pattern = r"(ab|cd){3,12}"
    params = constrained(StructuredOutputs(regex=pattern), max_tokens=24, temperature=0.8)
    prompts = [list(range(20, 50)), [7, 8, 9], [10, 11, 12, 13], [14, 15]]
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0, "the cache should be too small for all four"
    for out in outs:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    assert_nothing_left(small)


def test_a_constraint_that_does_not_compile_is_invalid_argument_and_leaves_nothing(llm: LLM) -> None:
    for so, words in ((StructuredOutputs(regex="(ab"), "parenthesis"),
                      (StructuredOutputs(json='{"type": "frob"}'), "frob"),
                      (StructuredOutputs(grammar="root ::= missing"), "missing")):
        out = llm.generate([[5, 6]], constrained(so), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "error" and out.error is not None
        assert out.error.code == 3  # INVALID_ARGUMENT
        assert out.error.message.startswith("sampling_params.structured_outputs: ") and words in out.error.message
        assert "/project/" not in out.error.message  # xgrammar's source location is stripped
        assert_nothing_left(llm)
    assert all(not f.done() or f.exception() is None for f in llm.engine.grammars._cache.values())


def test_identical_constraints_compile_once(llama_dir) -> None:
    compilers = GrammarCompilers(str(llama_dir), 512)
    so = StructuredOutputs(regex="[ab]+")
    first, second = compilers.submit(so), compilers.submit(StructuredOutputs(regex="[ab]+"))
    assert first.future is second.future and compilers.num_cached() == 1
    first.future.result(timeout=60)
    assert compilers.result(first) is compilers.result(second)
    compilers.release(first)
    compilers.release(second)
    assert constraint_key(StructuredOutputs(choice=["a"])) != constraint_key(StructuredOutputs(regex='["a"]'))
    compilers.shutdown()


def test_the_cache_is_bounded_lru(llama_dir) -> None:
    compilers = GrammarCompilers(str(llama_dir), 512, cache_size=2)
    tickets = [compilers.submit(StructuredOutputs(regex=r)) for r in ("a+", "b+", "c+")]
    for t in tickets:
        t.future.result(timeout=60)
        compilers.result(t)
        compilers.release(t)
    compilers.submit(StructuredOutputs(regex="d+"))  # evicts the least recently used finished ones
    assert compilers.num_cached() == 2
    compilers.shutdown()


def test_a_request_waiting_for_its_grammar_does_not_hold_back_others(llm: LLM) -> None:
    """While one request's grammar compiles (slowed down here), an unconstrained request runs to its end
    and the core reports nothing to do for the waiting one (no busy stepping)."""
    core = llm.engine
    release = threading.Event()
    compile_ = core.grammars._compile

    def slow_compile(key):
        release.wait(10)
        return compile_(key)

    core.grammars._compile = slow_compile
    try:
        core.add_request(EngineCoreRequest(request_id="slow", prompt_token_ids=[5, 6], sampling_params=(
            EngineSamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="x{1,9}")))))
        core.add_request(EngineCoreRequest(request_id="fast", prompt_token_ids=[7, 8], sampling_params=(
            EngineSamplingParams(max_tokens=4, temperature=0, ignore_eos=True))))
        finished = set()
        for _ in range(6):
            finished |= {o.request_id for o in core.step().outputs if o.finished}
        assert finished == {"fast"} and core.scheduler.num_waiting == 1
        assert core.has_unfinished_requests() and not core.has_work()
        release.set()
        deadline = time.monotonic() + 10
        while "slow" not in finished and time.monotonic() < deadline:
            core.wait_for_work(0.1)
            finished |= {o.request_id for o in core.step().outputs if o.finished}
        assert "slow" in finished
    finally:
        core.grammars._compile = compile_
    assert_nothing_left(llm)


def test_an_abort_while_compiling_leaves_nothing(llm: LLM) -> None:
    core = llm.engine
    gate = threading.Event()
    compile_ = core.grammars._compile
    core.grammars._compile = lambda key: (gate.wait(10), compile_(key))[1]
    try:
        for i in range(3):  # the first occupies the pool's threads; the last is queued, then cancelled
            core.add_request(EngineCoreRequest(request_id=f"a{i}", prompt_token_ids=[5], sampling_params=(
                EngineSamplingParams(structured_outputs=StructuredOutputs(regex=f"q{{{i + 1}}}")))))
        core.abort_requests(["a0", "a1", "a2"])
        outputs = core.step().outputs
        assert sorted(o.request_id for o in outputs) == ["a0", "a1", "a2"]
        assert all(o.finish_reason == 3 for o in outputs)  # ABORT
        assert core.grammars.num_waiting() == 0
        assert constraint_key(StructuredOutputs(regex="q{3}")) not in core.grammars._cache  # cancelled
    finally:
        gate.set()
        core.grammars._compile = compile_
    assert_nothing_left(llm)


def test_bitmask_rows_only_for_constrained_requests_that_sample(llm: LLM) -> None:
    """A step with a partial prefill chunk of a constrained request carries no row for it, and a step
    without constrained requests carries no bitmask at all."""
    core = llm.engine
    sched = core.scheduler
    saved = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = 4
    try:
        core.add_request(EngineCoreRequest(request_id="c", prompt_token_ids=list(range(10, 20)),
                                           sampling_params=EngineSamplingParams(
                                               max_tokens=2, structured_outputs=StructuredOutputs(regex="[ab]+"))))
        while not core.has_work():
            core.wait_for_work(0.1)
        masks: list[GrammarBitmask | None] = []
        schedule = sched.schedule

        def spy():
            out = schedule()
            masks.append(out.grammar)
            return out

        sched.schedule = spy
        while core.has_unfinished_requests():
            core.step()
        core.add_request(EngineCoreRequest(request_id="u", prompt_token_ids=[5], sampling_params=(
            EngineSamplingParams(max_tokens=2))))
        while core.has_unfinished_requests():
            core.step()
    finally:
        sched.schedule = schedule
        sched.max_num_batched_tokens = saved
    # 10 prompt tokens in chunks of 4: two partial chunks, then the last chunk samples, then one decode
    assert masks[:2] == [None, None]
    assert [m.req_ids for m in masks[2:4]] == [["c"], ["c"]]
    assert all(m is None for m in masks[4:])
    assert_nothing_left(llm)


def test_structured_outputs_are_refused_by_a_scheduler_without_compilers() -> None:
    from engine_svc.request import Request
    from engine_svc.sched.scheduler import Scheduler

    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=16)
    sched.add_request(Request(EngineCoreRequest(request_id="r", prompt_token_ids=[1], sampling_params=(
        EngineSamplingParams(structured_outputs=StructuredOutputs(regex="a")))), 64))
    sched.schedule()
    from engine_svc.sched.output import ModelRunnerOutput

    (out,) = sched.update_from_output(sched.schedule(), ModelRunnerOutput(req_ids=[], sampled_token_ids=[])).outputs
    assert out.error is not None and "structured outputs are not available" in out.error.message


def test_drafts_are_checked_and_masked_position_by_position() -> None:
    """Speculative decoding's side of a grammar (engine_svc/structured/grammar.py): the leading drafts the
    grammar allows, and the mask after each of them, with the matcher left where it was."""
    import torch
    import xgrammar as xgr

    vocab = ["a", "b", "c", "x", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[4])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_regex("(ab)+x")
    a, b, c, x, eos = range(5)

    def mask_after(tokens: list[int]) -> list[int]:
        reference = RequestGrammar(compiled, [eos])
        assert all(reference.accept(t) for t in tokens)
        bitmask = xgr.allocate_token_bitmask(1, len(vocab))
        reference.fill(bitmask, 0)
        return [t for t in range(len(vocab)) if bitmask[0, 0] >> t & 1]

    grammar = RequestGrammar(compiled, [eos])
    assert grammar.accept(a)
    assert grammar.allowed_drafts([b, a, b, c, a]) == 3  # c breaks (ab)+
    assert grammar.allowed_drafts([a]) == 0 and grammar.allowed_drafts([-1, -1]) == 0  # unknown yet: none
    assert grammar.allowed_drafts([b, x, eos, a]) == 3  # the grammar ends at eos: nothing after it counts
    bitmask = xgr.allocate_token_bitmask(4, len(vocab))
    grammar.fill_positions(bitmask, 0, [b, a, b])
    rows = [[t for t in range(len(vocab)) if bitmask[r, 0] >> t & 1] for r in range(4)]
    assert rows == [mask_after([a]), mask_after([a, b]), mask_after([a, b, a]), mask_after([a, b, a, b])]
    assert rows[0] == [b] and rows[3] == [a, x]
    assert grammar.allowed_drafts([b, x]) == 2 and grammar.accept(b)  # the matcher is still after "a"
    with pytest.raises(AssertionError):
        grammar.fill_positions(torch.zeros((2, 1), dtype=torch.int32), 0, [c])
