"""Processor: tokenization of text / ids / chat, the validation table, ids, engine request fields."""

from __future__ import annotations

import pytest

from frontend_svc.processor import ChatPrompt, Processor, PromptOptions
from shared_runtime.contract import (
    ENGINE_FIELDS,
    EngineCoreRequest,
    EngineSamplingParams,
    SamplingParams,
    StructuredOutputs,
)
from shared_runtime.violations import ValidationError

MAX_LEN = 64
CHAT = ChatPrompt([{"role": "user", "content": "Where are the boats?"}])


@pytest.fixture(scope="module")
def processor(tokenizer):
    return Processor(tokenizer, max_model_len=MAX_LEN, vocab_size=tokenizer.vocab_size, model_name="tiny")


def test_text_prompt(processor, tokenizer):
    prepared = processor.process("The gulls had not started", SamplingParams(max_tokens=5), priority=2)
    assert prepared.prompt_token_ids == list(tokenizer.encode("The gulls had not started"))
    assert prepared.eos_token_ids == list(tokenizer.eos_token_ids) and prepared.eos_token_ids
    assert prepared.prompt == "The gulls had not started"
    assert prepared.priority == 2 and prepared.arrival_time > 0
    assert len(prepared.request_id) == 32 and int(prepared.request_id, 16) >= 0  # uuid4 hex
    assert len(prepared.engine_request_ids) == 1


def test_token_ids_prompt_is_kept_as_is(processor):
    prepared = processor.process([0, 5, 6, 7], SamplingParams(), request_id="mine")
    assert prepared.prompt_token_ids == [0, 5, 6, 7]
    assert prepared.request_id == "mine" and prepared.prompt is None


def test_chat_prompt_uses_the_chat_template(processor, tokenizer):
    prepared = processor.process(CHAT, SamplingParams())
    expected = tokenizer.apply_chat_template(CHAT.messages, add_generation_prompt=True)
    if isinstance(expected, str):
        expected = tokenizer.encode(expected, add_special_tokens=False)
    assert prepared.prompt_token_ids == list(expected)
    without = processor.process(ChatPrompt(CHAT.messages, add_generation_prompt=False), SamplingParams())
    assert len(without.prompt_token_ids) < len(prepared.prompt_token_ids)


def test_engine_ids_are_unique_even_when_client_ids_repeat(processor):
    first = processor.process("hi", SamplingParams(n=3), request_id="same")
    second = processor.process("hi", SamplingParams(n=3), request_id="same")
    ids = first.engine_request_ids + second.engine_request_ids
    assert len(ids) == len(set(ids)) == 6
    assert all(i.startswith("same-") for i in ids)


def violation_fields(processor, prompt, params=None):
    with pytest.raises(ValidationError) as info:
        processor.process(prompt, params or SamplingParams(max_tokens=4))
    return info.value.fields


BAD_PROMPTS = [
    ("", "text"),
    ([], "token_ids.ids"),
    (ChatPrompt([]), "chat.messages"),
    (ChatPrompt([{"role": "user"}]), "chat.messages"),
    (ChatPrompt([{"role": "", "content": "x"}]), "chat.messages"),
    ([1, 2, 10**6], "token_ids.ids"),
    ([1, -1], "token_ids.ids"),
    ([5] * MAX_LEN, "token_ids.ids"),  # no room for even one token
    ("word " * (2 * MAX_LEN), "text"),
]


@pytest.mark.parametrize(("prompt", "field"), BAD_PROMPTS)
def test_bad_prompt_names_its_field(processor, prompt, field):
    assert violation_fields(processor, prompt) == [field]


def test_vocab_boundary(processor, tokenizer):
    assert processor.process([tokenizer.vocab_size - 1], SamplingParams())
    assert violation_fields(processor, [tokenizer.vocab_size]) == ["token_ids.ids"]


def test_prompt_plus_max_tokens_must_fit(processor):
    assert processor.process([5] * 60, SamplingParams(max_tokens=4))  # exactly MAX_LEN
    assert violation_fields(processor, [5] * 60, SamplingParams(max_tokens=5)) == [
        "sampling_params.max_tokens"]
    assert processor.process([5] * 63, SamplingParams(max_tokens=None))  # fill the context


def test_all_violations_are_reported_together(processor):
    params = SamplingParams()
    params.top_p, params.temperature = 0.0, float("nan")  # bypass __post_init__ to reach the processor
    assert violation_fields(processor, [], params) == [
        "token_ids.ids", "sampling_params.temperature", "sampling_params.top_p"]
    params = SamplingParams(max_tokens=MAX_LEN)
    params.n = 0
    assert violation_fields(processor, [5] * 8, params) == ["sampling_params.n", "sampling_params.max_tokens"]


def test_engine_requests_fan_out_with_distinct_seeds(processor):
    prepared = processor.process([0, 5, 6], SamplingParams(n=3, seed=41, stop="x", stop_token_ids=[9], top_k=-1))
    requests = processor.engine_requests(prepared, {"traceparent": "00-abc"})
    assert [r.request_id for r in requests] == prepared.engine_request_ids
    assert [r.sampling_params.seed for r in requests] == [41, 42, 43]
    for request in requests:
        assert type(request) is EngineCoreRequest and type(request.sampling_params) is EngineSamplingParams
        assert request.prompt_token_ids == [0, 5, 6] and request.trace_headers == {"traceparent": "00-abc"}
        assert request.eos_token_ids == prepared.eos_token_ids and request.arrival_time == prepared.arrival_time
        assert request.sampling_params.top_k == -1 and request.sampling_params.stop_token_ids == [9]
    requests[0].sampling_params.stop_token_ids.append(1)
    requests[0].trace_headers["tracestate"] = "x"
    assert requests[1].sampling_params.stop_token_ids == [9] == prepared.params.stop_token_ids  # no shared lists
    assert requests[1].trace_headers == {"traceparent": "00-abc"}
    assert processor.engine_requests(prepared)[0].trace_headers == {}


def test_engine_requests_carry_every_engine_field():
    """`engine_params` copies every token-level field, so a new one needs no code here."""
    values = {"temperature": 0.5, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "seed": 3, "max_tokens": 9,
              "min_tokens": 2, "stop_token_ids": [4], "ignore_eos": True, "presence_penalty": 0.5,
              "frequency_penalty": -0.5, "repetition_penalty": 1.5, "logprobs": 2, "prompt_logprobs": 1,
              "logit_bias": {3: -1.5}, "allowed_token_ids": [1, 5], "bad_words_token_ids": [[2, 3], [4]],
              "structured_outputs": StructuredOutputs(regex="a+")}
    assert set(values) == set(ENGINE_FIELDS)
    engine = SamplingParams(**values, stop=["x"], n=2).engine_params()
    assert {name: getattr(engine, name) for name in ENGINE_FIELDS} == values


def test_unseeded_and_wrapping_seeds(processor):
    unseeded = processor.engine_requests(processor.process([5], SamplingParams(n=2)))
    assert [r.sampling_params.seed for r in unseeded] == [None, None]
    top = (1 << 64) - 1
    wrapped = processor.engine_requests(processor.process([5], SamplingParams(n=2, seed=top)))
    assert [r.sampling_params.seed for r in wrapped] == [top, 0]


def test_processing_modules_import_neither_torch_nor_the_engine():
    import subprocess
    import sys

    modules = ["frontend_svc." + m for m in ("service_error", "processor", "outputs", "output_processor")]
    modules += ["shared_runtime." + m for m in ("contract", "limits", "to_pb", "from_pb", "detokenizer", "stop",
                                                "token_texts")]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'engine_svc')]\n"
        + "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class CountingTokenizer:
    """The real tokenizer, counting how often text is encoded or a chat rendered."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.encoded = 0
        self.rendered = 0
        self.eos_token_ids = tokenizer.eos_token_ids

    def encode(self, text, add_special_tokens=True):
        self.encoded += 1
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages, add_generation_prompt=True, options=None):
        self.rendered += 1
        return self._tokenizer.render_chat(messages, add_generation_prompt, options)


@pytest.fixture()
def counting(tokenizer):
    counter = CountingTokenizer(tokenizer)
    return counter, Processor(counter, max_model_len=MAX_LEN, vocab_size=tokenizer.vocab_size, model_name="t")


def test_an_oversized_text_prompt_is_rejected_without_tokenizing(counting):
    from shared_runtime.limits import max_prompt_bytes

    counter, processor = counting
    limit = max_prompt_bytes(MAX_LEN)
    assert violation_fields(processor, "x" * (limit + 1)) == ["text"]
    assert violation_fields(processor, "é" * (limit // 2 + 1)) == ["text"]  # counted in UTF-8 bytes
    assert counter.encoded == 0
    violation_fields(processor, "word " * (limit // 5))  # within the byte budget: tokenized, too long
    assert counter.encoded == 1


def test_an_oversized_chat_is_rejected_without_rendering(counting):
    from shared_runtime.limits import max_prompt_bytes

    counter, processor = counting
    many = ChatPrompt([{"role": "user", "content": "hi"}] * (MAX_LEN + 1))
    assert violation_fields(processor, many) == ["chat.messages"]
    huge = ChatPrompt([{"role": "user", "content": "x" * max_prompt_bytes(MAX_LEN)}])
    assert violation_fields(processor, huge) == ["chat.messages"]
    assert counter.rendered == 0 and counter.encoded == 0


def test_a_token_prompt_longer_than_the_context_is_rejected_before_scanning(processor):
    class NoScan(list):
        def __iter__(self):
            raise AssertionError("the ids were scanned although their count is over the limit")

    assert violation_fields(processor, NoScan([5] * (MAX_LEN + 10))) == ["token_ids.ids"]


@pytest.mark.parametrize("request_id", ["x" * 257, "tab\there", "naïve", "new\nline"])
def test_request_id_is_capped_and_printable_ascii(processor, request_id):
    with pytest.raises(ValidationError) as info:
        processor.process("hi", SamplingParams(max_tokens=2), request_id=request_id)
    assert info.value.fields == ["request_id"]


def test_longest_allowed_request_id(processor):
    rid = "~" * 256
    assert processor.process("hi", SamplingParams(max_tokens=2), request_id=rid).request_id == rid


# ---- OpenAI-style prompt options (PromptOptions), bad words, the rendered chat ----------------------------


def test_a_chat_keeps_its_rendered_text(processor, tokenizer):
    prepared = processor.process(CHAT, SamplingParams())
    assert prepared.prompt == tokenizer.render_chat(CHAT.messages, add_generation_prompt=True)
    assert prepared.prompt_token_ids == tokenizer.encode(prepared.prompt, add_special_tokens=False)


@pytest.mark.parametrize(("keep", "side", "expected"), [
    (3, "left", slice(-3, None)), (3, "right", slice(0, 3)), (-1, "left", slice(None)), (100, "left", None),
    (0, "left", None),
])
def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens(processor, keep, side, expected):
    ids = list(range(10, 20))
    options = PromptOptions(truncate_prompt_tokens=keep, truncation_side=side)
    if expected is None:  # more than max_model_len, or nothing left: refused, naming the field
        with pytest.raises(ValidationError) as info:
            processor.process(ids, SamplingParams(max_tokens=2), options=options)
        assert info.value.fields == ["truncate_prompt_tokens"]
        return
    assert processor.process(ids, SamplingParams(max_tokens=2), options=options).prompt_token_ids == ids[expected]
    long = list(range(MAX_LEN + 5))  # -1: max_model_len - 1 tokens, leaving one for the output
    kept = processor.process(long, SamplingParams(max_tokens=1), options=PromptOptions(truncate_prompt_tokens=-1))
    assert kept.prompt_token_ids == long[-(MAX_LEN - 1):]


def test_truncating_a_huge_text_cuts_it_before_tokenizing(processor):
    from shared_runtime.limits import max_prompt_bytes

    huge = "word " * max_prompt_bytes(MAX_LEN)
    prepared = processor.process(huge + "end", SamplingParams(max_tokens=2),
                                 options=PromptOptions(truncate_prompt_tokens=4))
    assert len(prepared.prompt_token_ids) == 4


def test_fit_max_tokens_generates_to_the_end_of_the_context(processor):
    ids = [5] * (MAX_LEN - 10)
    fitted = processor.process(ids, SamplingParams(max_tokens=50), options=PromptOptions(fit_max_tokens=True))
    assert fitted.params.max_tokens == 10
    params = SamplingParams(max_tokens=50)
    processor.process(ids, params, options=PromptOptions(fit_max_tokens=True))
    assert params.max_tokens == 50  # the caller's params are never modified
    assert violation_fields(processor, ids, SamplingParams(max_tokens=50)) == ["sampling_params.max_tokens"]
    with pytest.raises(ValidationError) as info:  # beyond the whole context: refused, as vLLM does
        processor.process(ids, SamplingParams(max_tokens=MAX_LEN + 1), options=PromptOptions(fit_max_tokens=True))
    assert info.value.fields == ["sampling_params.max_tokens"]
    with pytest.raises(ValidationError) as info:
        processor.process(ids, SamplingParams(max_tokens=50, min_tokens=20), options=PromptOptions(fit_max_tokens=True))
    assert info.value.fields == ["sampling_params.min_tokens"]


def reference_bad_words(tokenizer, words):
    """vLLM 0.32's SamplingParams.update_from_tokenizer, transcribed."""
    out = []
    for word in words:
        for add_prefix_space in (False, True):
            ids = tokenizer.encode((" " if add_prefix_space else "") + word.lstrip(), add_special_tokens=False)
            if not ids:
                continue
            if not add_prefix_space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out


def test_bad_words_are_tokenized_as_vllm_does(processor, tokenizer):
    words = ["boats", " gulls", "had not", "x", "boats"]
    params = SamplingParams(max_tokens=3, bad_words=words)
    prepared = processor.process("The gulls", params)
    assert prepared.params.bad_words_token_ids == reference_bad_words(tokenizer, words[:4])  # deduplicated
    assert params.bad_words_token_ids == []  # the caller's params are not modified
    [request] = processor.engine_requests(prepared)
    assert request.sampling_params.bad_words_token_ids == prepared.params.bad_words_token_ids
    for bad in ([""], [f"w{i}" for i in range(129)]):
        with pytest.raises(ValidationError) as info:
            SamplingParams(bad_words=bad)
        assert info.value.fields == ["bad_words"]
    many = [f" w{i}" for i in range(100)]  # 100 words, but more than 128 token sequences
    assert violation_fields(processor, "hi", SamplingParams(bad_words=many)) == ["sampling_params.bad_words"]
