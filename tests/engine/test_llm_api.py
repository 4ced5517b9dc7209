"""The offline API as a user of vLLM's `LLM` would use it: text and token prompts, n > 1, stop strings,
seeds, min_tokens, prompt logprobs, per-prompt sampling params, and clear errors for bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from entrypoints import LLM, SamplingParams
from shared_runtime.violations import ValidationError


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), dtype="float32", block_size=8)


def finished_text(decode: Any, prompt: list[int], ids: list[int]) -> str:
    """An output's text by position, as vLLM's detokenizer emits it: up to its last id whose text (after
    the prompt) does not end inside a character; an unfinished character at the end is left out."""
    k = len(ids)
    while k and decode(prompt + ids[:k]).endswith("\ufffd"):
        k -= 1
    return str(decode(prompt + ids[:k])[len(decode(prompt)):])


def test_text_prompt_is_tokenized_and_decoded(llm: LLM) -> None:
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt == "Hello there"
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello there")
    comp = out.outputs[0]
    assert len(comp.token_ids) == 8 and comp.finish_reason == "length"
    assert comp.text == finished_text(llm.tokenizer.decode, [], comp.token_ids)


def test_outputs_come_back_in_input_order_with_per_prompt_params(llm: LLM) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 1, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 1, 5]


def test_n_completions_with_a_seed_are_distinct_and_reproducible(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=12, ignore_eos=True)
    first = llm.generate([[20, 21, 22]], params, use_tqdm=False)[0]
    again = llm.generate([[20, 21, 22]], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3


def test_seeded_sampling_does_not_depend_on_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[30, 31]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    mixed = llm.generate([[40, 41, 42], [30, 31], [50]], [others, seeded, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_stop_string_ends_the_completion_and_is_excluded(llm: LLM) -> None:
    free = llm.generate([[60, 61, 62]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[3:6]
    assert stop.strip(), "the greedy text should be long enough to pick a stop string from"
    out = llm.generate([[60, 61, 62]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                      stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    kept = llm.generate([[60, 61, 62]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                       include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == free.text[: free.text.index(stop) + len(stop)]
    stats = llm.engine.get_stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks  # aborted, freed


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    free = llm.generate([[70, 71]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = free[2]
    out = llm.generate([[70, 71]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                  stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: free.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    held = llm.generate([[70, 71]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                   stop_token_ids=[stop_id], min_tokens=10), use_tqdm=False)
    assert stop_id not in held[0].outputs[0].token_ids  # masked until min_tokens is reached


def test_prompt_logprobs_match_transformers(llm: LLM, llama_dir) -> None:
    prompt = [3, 17, 99, 250, 7, 42]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry is not None
        expected = float(logprobs[pos - 1, prompt[pos]])
        got = entry[prompt[pos]].logprob if isinstance(entry, dict) else entry.logprob
        assert got == pytest.approx(expected, abs=1e-4)


def test_greedy_with_logit_bias_matches_transformers(llm: LLM, llama_dir) -> None:
    """The reference: transformers' logits of the same model plus the bias, argmax, token by token."""
    prompt, steps = [3, 17, 99, 250, 7, 42], 10
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    bias = {free[0]: -100.0, free[1]: -100.0, 321: 6.0, 77: 4.5, 500: -3.0}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logit_bias=bias),
                       use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    dense = torch.zeros(llm.engine.vocab_size)
    dense[list(bias)] = torch.tensor(list(bias.values()))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int((hf(torch.tensor([ids])).logits[0, -1].float() + dense).argmax()))
    assert out.token_ids == ids[len(prompt):]
    assert out.token_ids != free and free[0] not in out.token_ids  # the bias changed the output
    forced = llm.generate([prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True,
                                                   logit_bias={5: 250.0}), use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [5] * 4  # +100 (250, clamped) outweighs this model's logits


def test_logit_bias_ids_must_be_in_the_vocabulary(llm: LLM) -> None:
    with pytest.raises(ValidationError) as err:
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, logit_bias={llm.engine.vocab_size: 1.0}),
                     use_tqdm=False)
    assert err.value.fields == ["sampling_params.logit_bias"]


def test_bad_input_raises_a_validation_error_naming_the_field(llm: LLM) -> None:
    with pytest.raises(ValidationError) as err:
        llm.generate([[llm.engine.vocab_size + 5]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "token_ids.ids" in err.value.fields
    with pytest.raises(ValidationError) as err:
        SamplingParams(top_p=1.5)
    assert "top_p" in str(err.value)
    with pytest.raises(ValueError, match="SamplingParams for 2 prompts"):
        llm.generate([[1], [2]], [SamplingParams()] * 3, use_tqdm=False)


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValidationError):
        llm.generate([[5, 6], [llm.engine.vocab_size + 1], [7, 8]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6]], params, use_tqdm=False)  # the next call is unaffected
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 3


def test_random_token_id_prompts_decode_positionally(llm: LLM) -> None:
    """Regression (issue 12): a token-id prompt ending inside a UTF-8 character made the completion
    repeat the prompt's tail. The text must be decode(prompt + output) minus decode(prompt), by position,
    less a character the output never finished (vLLM's detokenizer leaves it out too)."""
    import random

    rng = random.Random(80)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 24))] for _ in range(80)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    decode = llm.tokenizer.decode
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        assert comp.text == finished_text(decode, prompt, comp.token_ids)


def test_chat_renders_the_template_like_generate_on_its_ids(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Where did the boats go?"}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    ids = llm.tokenizer.apply_chat_template(messages)
    assert chat.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    two = llm.chat([messages, messages], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [chat.outputs[0].token_ids] * 2


def test_a_kv_cache_smaller_than_max_model_len_lowers_it(llama_dir, caplog) -> None:
    """Regression (issue 12): max_model_len 128 with 4 blocks of 16 returned 54 of 100 requested tokens
    with finish reason LENGTH. The engine now serves max_model_len = what the cache holds, says so in the
    log, and requests beyond it are rejected up front."""
    with caplog.at_level("WARNING", logger="engine_svc.core"):
        small = LLM(str(llama_dir), dtype="float32", block_size=16, max_model_len=128, num_gpu_blocks_override=4)
    assert small.engine.max_model_len == 64 and small.processor.max_model_len == 64
    assert "serving with max_model_len=64" in caplog.text
    prompt = [5, 6, 7, 8]
    with pytest.raises(ValidationError) as err:
        small.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert "sampling_params.max_tokens" in err.value.fields and "max_model_len (64)" in str(err.value)
    out = small.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 60 and out[0].outputs[0].finish_reason == "length"
    small.engine.shutdown()
