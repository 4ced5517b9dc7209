"""Speculative decoding (ngram) end to end through the offline `LLM`, against the same engine without it.

Plain decoding is the oracle (it equals transformers token for token: test_hf_exact.py; the greedy
scenarios check transformers directly too). Greedy: the same tokens, logprobs, finish reasons and text,
through chunked prefill, prefix caching, blocks that drafts cross, stop ids, stop strings and max_tokens
falling inside an accepted run, preemption with drafts scheduled; every KV block back afterwards.
Sampled: the joint distribution of the first tokens against transformers' exact probabilities.

Two tiny models: the random llama, on which drafts are nearly all rejected (the rollback path), and
`looping`, the same llama with its attention output scaled down (layer 0 off, layer 1 at a tenth) so
its greedy output falls into a short cycle that prompt lookup predicts (the acceptance path). Layer 1's
attention still moves every logprob, so K/V written at a wrong position shows in the logprobs.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_svc.telemetry.metrics import EngineMetrics
from entrypoints import LLM, SamplingParams
from shared_runtime.from_pb import stats_from_pb
from shared_runtime.to_pb import stats_to_pb
from tests.engine.test_hf_exact import assert_no_block_leaks, hf_greedy, hf_model, make_prompts
from tests.engine.test_spec_rejection import chi2, chi2_critical

pytestmark = pytest.mark.timeout(300)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SMALL_STEPS = dict(block_size=4, max_num_batched_tokens=32)  # drafts cross blocks; prompts in chunks


@pytest.fixture(scope="module")
def looping_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("looping") / "llama"
    shutil.copytree(llama_dir, out)
    weights = next(out.glob("*.safetensors"))
    tensors = load_file(weights)
    for name in [n for n in tensors if "o_proj" in n]:
        tensors[name] = tensors[name] * (0.0 if ".layers.0." in name else 0.1)
    save_file(tensors, weights, metadata={"format": "pt"})
    return out


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    return [(p * 4)[: 6 + 3 * i] for i, p in enumerate(make_prompts(seed, count, 500, lo=3, hi=6))]


def generate(model_dir: Path, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             spec: dict[str, Any] | None, **engine_args: Any) -> tuple[list, LLM]:
    llm = LLM(str(model_dir), dtype="float32", speculative_config=spec, **engine_args)
    return llm.generate(prompts, params, use_tqdm=False), llm


def served_tokens(model_dir: Path, spec: dict[str, Any], prompt: list[int], max_tokens: int, tmp_path: Path,
                  extra_args: tuple[str, ...] = ()) -> list[int]:
    """Greedy tokens of `prompt` from a `tandem serve` process started with `--speculative-config spec`
    (and `extra_args`)."""
    import json
    import sys

    from frontend_svc.client import TandemClient, collect
    from tests.support import Service, free_port

    port, engine_port, http_port = free_port(), free_port(), free_port()
    serve = Service("serve", [sys.executable, "-m", "entrypoints.serve", "--model", str(model_dir),
                              "--port", str(port), "--engine-port", str(engine_port), "--http-port", str(http_port),
                              "--dtype", "float32", "--speculative-config", json.dumps(spec), *extra_args],
                    port, tmp_path).start()
    try:
        serve.wait_serving(120)
        with TandemClient(f"127.0.0.1:{port}") as client:
            got = collect(client.generate(token_ids=prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                          timeout=60))[0]
        tokens: list[int] = got["token_ids"]
        return tokens
    finally:
        serve.stop()


def completions(outs: list) -> list[tuple]:
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for out in outs for c in out.outputs]


def assert_same_logprobs(a: list, b: list) -> None:
    for x, y in zip(a, b):
        for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert q.logprob == pytest.approx(p.logprob, abs=1e-4)
            assert q.rank == p.rank and [t for t, _ in q.top] == [t for t, _ in p.top]
            assert [v for _, v in q.top] == pytest.approx([v for _, v in p.top], abs=1e-4)


@pytest.mark.parametrize("model", ["random", "looping"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_equals_plain_decoding(model: str, k: int, llama_dir: Path, looping_dir: Path) -> None:
    model_dir = llama_dir if model == "random" else looping_dir
    prompts = repetitive_prompts(k, 6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    plain, _ = generate(model_dir, prompts, params, None, **SMALL_STEPS)
    spec, llm = generate(model_dir, prompts, params, {**NGRAM, "num_speculative_tokens": k}, **SMALL_STEPS)
    assert completions(spec) == completions(plain)
    assert_same_logprobs(plain, spec)
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_drafts
    if model == "looping":  # the cycle is predicted: most drafts accepted, several tokens per verification
        assert stats.spec_decode_num_accepted_tokens > 0.6 * stats.spec_decode_num_draft_tokens
        assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
        assert len(stats.spec_decode_num_accepted_tokens_per_pos) == k
    assert_no_block_leaks(llm)


def test_greedy_speculation_equals_transformers(looping_dir: Path) -> None:
    prompts = repetitive_prompts(7, 3)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
    outs, llm = generate(looping_dir, prompts, params, NGRAM, enable_prefix_caching=False)
    for prompt, out in zip(prompts, outs):
        expected, expected_lp = hf_greedy(looping_dir, prompt, 30)
        assert out.outputs[0].token_ids == expected
        assert [e.logprob for e in out.outputs[0].logprobs] == pytest.approx(expected_lp, abs=1e-4)
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0


def stops_inside_runs(model_dir: Path) -> tuple[list[list[int]], list[SamplingParams], int, str]:
    """Three prompts and their params: a stop id deep in the model's cycle, a stop string from the middle
    of an output, max_tokens 23 (with the stop id and string it ends them)."""
    prompts = repetitive_prompts(3, 3)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference, _ = generate(model_dir, prompts, free, None)
    cycle_token = reference[0].outputs[0].token_ids[20]  # deep in the cycle: drafts predict it
    text = reference[1].outputs[0].text
    stop_string = text[len(text) // 2 : len(text) // 2 + 3]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[cycle_token], logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_string]),
              SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, logprobs=1)]
    return prompts, params, cycle_token, stop_string


def test_stops_and_max_tokens_inside_an_accepted_run(looping_dir: Path) -> None:
    """A stop id, a stop string and max_tokens while drafts are being accepted end the request exactly
    where plain decoding ends it (a stop id in the middle of a run: test_spec_scheduler.py)."""
    prompts, params, cycle_token, stop_string = stops_inside_runs(looping_dir)
    plain, _ = generate(looping_dir, prompts, params, None)
    spec, llm = generate(looping_dir, prompts, params, NGRAM)
    assert completions(spec) == completions(plain)
    assert plain[0].outputs[0].finish_reason == "stop" and plain[0].outputs[0].stop_reason == cycle_token
    assert plain[1].outputs[0].stop_reason == stop_string and len(plain[2].outputs[0].token_ids) == 23
    assert [len(o.outputs[0].logprobs or []) for o in spec] == [len(o.outputs[0].token_ids) if i != 1 else 0
                                                              for i, o in enumerate(spec)]
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert_no_block_leaks(llm)


def test_preemption_with_drafts_scheduled(looping_dir: Path, llama_dir: Path) -> None:
    """A cache of 12 blocks of 4 tokens for 6 requests: requests verifying drafts get preempted and
    resume; the tokens stay those of plain decoding and every block comes back."""
    prompts = repetitive_prompts(5, 6)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
    args = dict(num_gpu_blocks_override=12, block_size=4, max_num_batched_tokens=64)
    for model_dir in (looping_dir, llama_dir):
        plain, _ = generate(model_dir, prompts, params, None, **args)
        spec, llm = generate(model_dir, prompts, params, NGRAM, **args)
        assert completions(spec) == completions(plain)
        assert_same_logprobs(plain, spec)
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0 and stats.spec_decode_num_drafts > 0
        assert_no_block_leaks(llm)


@pytest.mark.slow  # 1500 requests through the offline API: about two minutes on a shared CPU
def test_sampled_tokens_follow_the_target_distribution(looping_dir: Path) -> None:
    """The joint distribution of the first three sampled tokens (temperature 1, top-k 3) equals the
    product of transformers' conditional probabilities; drafts are verified (and some accepted) for the
    second and third."""
    seed_prompt = repetitive_prompts(11, 1)[0]
    greedy, _ = generate(looping_dir, [seed_prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                         None)
    prompt = seed_prompt + greedy[0].outputs[0].token_ids  # ends inside the model's cycle: drafts match
    n = 1500
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    outs, llm = generate(looping_dir, [prompt] * n, params, {**NGRAM, "num_speculative_tokens": 2})
    assert_first_tokens_follow_the_target(looping_dir, prompt, outs, depth=3, top_k=3)
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > n // 3 and stats.spec_decode_num_accepted_tokens > n // 10


def assert_first_tokens_follow_the_target(model_dir: Path, prompt: list[int], outs: list, depth: int,
                                          top_k: int) -> None:
    """Chi-square of the outputs' first `depth` tokens against their exact joint top-k probabilities."""
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        key = tuple(out.outputs[0].token_ids[:depth])
        counts[key] = counts.get(key, 0) + 1
    exact = _joint_top_k(model_dir, prompt, depth=depth, top_k=top_k)
    assert set(counts) <= set(exact)
    cells = sorted(exact)
    stat, df = chi2([counts.get(c, 0) for c in cells], [exact[c] for c in cells])
    assert stat < chi2_critical(df), (stat, df)


def _joint_top_k(model_dir: Path, prompt: list[int], depth: int, top_k: int) -> dict[tuple[int, ...], float]:
    """Exact probabilities of every `depth`-token continuation under top-k sampling, from transformers."""
    model = hf_model(model_dir)
    result: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        grown: dict[tuple[int, ...], float] = {}
        for seq, p in result.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1].float()
            top = logits.topk(top_k)
            probs = torch.softmax(top.values, dim=-1).tolist()
            for token, q in zip(top.indices.tolist(), probs):
                grown[(*seq, token)] = p * q
        result = grown
    return result


def output_dependent_params(model_dir: Path, prompts: list[list[int]]) -> list[SamplingParams]:
    """Greedy requests whose next token depends on their output so far, each mild enough to stay in the
    model's cycle (where prompt lookup drafts well): three penalties; a bad word that is a pair of the
    cycle's tokens; a stop id from the cycle held back by min_tokens past its first appearance."""
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reference, _ = generate(model_dir, prompts, free, None)
    cycle = reference[3].outputs[0].token_ids
    return [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.05),
            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, frequency_penalty=0.05,
                           presence_penalty=0.1, logprobs=1),
            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, bad_words_token_ids=[cycle[16:18]]),
            SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[cycle[12]], min_tokens=20)]


def test_output_dependent_sampling_speculates_and_keeps_its_tokens(looping_dir: Path) -> None:
    """Penalties, bad words and min_tokens are applied per verified position with the drafts before it
    counted as output: the tokens of plain decoding, with drafts accepted. (Scoring every position
    with the request's state before the step fails here.)"""
    prompts = repetitive_prompts(2, 4)
    params = output_dependent_params(looping_dir, prompts)
    plain, _ = generate(looping_dir, prompts, params, None)
    spec, llm = generate(looping_dir, prompts, params, NGRAM, **SMALL_STEPS)
    assert completions(spec) == completions(plain)
    assert_same_logprobs(plain[1:2], spec[1:2])
    assert plain[3].outputs[0].finish_reason == "stop" and len(plain[3].outputs[0].token_ids) >= 20
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0.3 * stats.spec_decode_num_draft_tokens > 0
    assert_no_block_leaks(llm)


@pytest.mark.parametrize("temperature", [0.3, 1.0])
def test_seeded_sampling_speculates_with_the_tokens_of_plain_decoding(looping_dir: Path, temperature: float) -> None:
    """A seeded request verifies with its own stream: its tokens are plain decoding's, alone or beside
    other requests (seeded, unseeded, penalised), with drafts accepted."""
    prompts = repetitive_prompts(2, 4)
    seeded = [SamplingParams(temperature=temperature, seed=7 + i, max_tokens=24, ignore_eos=True, top_k=20)
              for i in range(2)]
    others = [SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.2)]
    plain, _ = generate(looping_dir, prompts[:2], seeded, None)
    alone, llm = generate(looping_dir, prompts[:2], seeded, NGRAM)
    assert completions(alone) == completions(plain)
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    mixed, llm = generate(looping_dir, [prompts[2], prompts[0], prompts[3], prompts[1]],
                          [others[0], seeded[0], others[1], seeded[1]], NGRAM, **SMALL_STEPS)
    assert completions([mixed[1], mixed[3]]) == completions(plain)
    assert_no_block_leaks(llm)


def test_disable_by_batch_size(looping_dir: Path) -> None:
    prompts = repetitive_prompts(4, 3)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain, _ = generate(looping_dir, prompts, params, None)
    spec, llm = generate(looping_dir, prompts, params, {**NGRAM, "disable_by_batch_size": 2})
    assert completions(spec) == completions(plain)
    # Drafts only once fewer than two requests run: the last one, after the others finished (none here,
    # since they all finish together) - so none at all.
    assert llm.engine.get_stats().spec_decode_num_drafts == 0
    _, llm = generate(looping_dir, prompts[:1], params, {**NGRAM, "disable_by_batch_size": 2})
    assert llm.engine.get_stats().spec_decode_num_drafts > 0


def test_acceptance_metrics_are_exported_and_cross_the_wire(looping_dir: Path) -> None:
    _, llm = generate(looping_dir, repetitive_prompts(6, 2),
                      SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), NGRAM)
    stats = llm.engine.get_stats()
    assert stats_from_pb(stats_to_pb(stats)) == stats
    metrics = EngineMetrics("m")
    metrics.track(lambda: stats)
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    assert f'tandem_spec_decode_num_drafts_total{{model_name="m"}} {float(stats.spec_decode_num_drafts)}' in text
    assert (f'tandem_spec_decode_num_accepted_tokens_total{{model_name="m"}} '
            f'{float(stats.spec_decode_num_accepted_tokens)}') in text
    first = stats.spec_decode_num_accepted_tokens_per_pos[0]
    assert f'tandem_spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {float(first)}' in text


@pytest.mark.slow  # two worker processes over gloo
def test_greedy_speculation_at_tp2_equals_plain_tp1(looping_dir: Path) -> None:
    prompts = repetitive_prompts(8, 3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    plain, _ = generate(looping_dir, prompts, params, None)
    spec, llm = generate(looping_dir, prompts, params, NGRAM, tensor_parallel_size=2)
    try:
        assert completions(spec) == completions(plain)
        assert_same_logprobs(plain, spec)
        assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
        assert_no_block_leaks(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=5)])
def test_structured_outputs_speculate_within_the_grammar(llama_dir: Path, sampling: dict[str, Any]) -> None:
    """A constrained request keeps only the drafts its grammar allows and every verified position is
    masked: the output follows the grammar and is plain decoding's (greedy, or seeded at random), with
    prompt-lookup drafts accepted (the grammar makes the output repeat itself)."""
    from shared_runtime.contract import StructuredOutputs

    pattern = r"(ab|cd|ef){4,30}x"
    prompts = [[5, 6, 7], [10, 11, 12, 13]]
    params = [SamplingParams(max_tokens=48, structured_outputs=StructuredOutputs(regex=pattern), **sampling),
              SamplingParams(max_tokens=48, structured_outputs=StructuredOutputs(regex=r"(ab){6}[a-f]{1,4}"),
                             **sampling)]
    plain, _ = generate(llama_dir, prompts, params, None)
    spec, llm = generate(llama_dir, prompts, params, NGRAM, **SMALL_STEPS)
    assert completions(spec) == completions(plain)
    assert re.fullmatch(pattern, spec[0].outputs[0].text), spec[0].outputs[0].text
    assert re.fullmatch(r"(ab){6}[a-f]{1,4}", spec[1].outputs[0].text), spec[1].outputs[0].text
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert_no_block_leaks(llm)
