"""IncrementalDetokenizer: split multi-byte characters, prompt context, special tokens, chunking, and the
positional definition text == decode(prompt + output)[len(decode(prompt)):] over random token ids."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_runtime.detokenizer import IncrementalDetokenizer, prompt_context

REPLACEMENT = "\ufffd"
MULTIBYTE_CANDIDATES = ["日本語のテキスト", "🙂🚀 emoji", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "Ωμέγα ça va", "你好，世界"]


def stream(backend, prompt_ids, ids, skip_special_tokens=True, chunk=1):
    detok = IncrementalDetokenizer(backend, prompt_ids, skip_special_tokens)
    return [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.fixture(scope="module")
def split_char_text(encode, backend):
    """A text some of whose tokens hold only part of a UTF-8 character."""
    for text in MULTIBYTE_CANDIDATES:
        ids = encode(text)
        if any(REPLACEMENT in backend.decode([t]) for t in ids):
            return text
    pytest.fail("no candidate text splits a character across tokens")


def test_split_characters_are_withheld_until_complete(encode, encode_prompt, backend, split_char_text):
    prompt = encode_prompt("The harbour was quiet.")
    ids = encode(split_char_text)
    deltas = stream(backend, prompt, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "" in deltas  # at least one token completed no character
    assert "".join(deltas) == backend.decode(ids) == split_char_text


def test_output_decodes_in_the_context_of_the_prompt(encode, encode_prompt, backend):
    prompt = encode_prompt("Mara walked along the")
    ids = encode(" pier with a thermos")
    text = "".join(stream(backend, prompt, ids))
    assert text == " pier with a thermos"
    assert backend.decode(prompt + ids) == backend.decode(prompt) + text


@pytest.mark.parametrize("chunk", [2, 3, 100])
def test_several_ids_per_step_give_the_same_text(encode, encode_prompt, backend, split_char_text, chunk):
    prompt = encode_prompt("hello")
    ids = encode(split_char_text + " and the boats")
    deltas = stream(backend, prompt, ids, chunk=chunk)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == split_char_text + " and the boats"


def test_a_batch_ending_inside_a_character_withholds_only_that_character(encode, encode_prompt, backend,
                                                                         split_char_text):
    """Ids fed together give what they give one at a time: a batch whose last id leaves a character
    unfinished still returns the complete text before it (a completion cut there keeps that text)."""
    ids = encode(" and the boats " + split_char_text)
    cut = next(k for k in range(1, len(ids)) if backend.decode(ids[:k]).endswith(REPLACEMENT))
    prompt = encode_prompt("hello")
    one_by_one = "".join(stream(backend, prompt, ids[:cut]))
    batched = IncrementalDetokenizer(backend, prompt, True).add(ids[:cut])
    assert batched == one_by_one and batched.startswith(" and the boats")
    assert REPLACEMENT not in batched


def test_skip_special_tokens_both_ways(encode, encode_prompt, backend):
    prompt = encode_prompt("hi")
    words = encode(" the boats")
    im_start, eos = 3, 1
    ids = [*words, im_start, *words, eos]
    assert "".join(stream(backend, prompt, ids, skip_special_tokens=True)) == " the boats the boats"
    shown = "".join(stream(backend, prompt, ids, skip_special_tokens=False))
    assert shown == " the boats<|im_start|> the boats<|eos|>"


def test_random_texts_and_chunkings_roundtrip(encode, encode_prompt, backend):
    rng = random.Random(1234)
    alphabet = list("abc xyz.,\n") + list("éüß日本語🙂🚀ΩЖ")
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = encode(text)
        detok = IncrementalDetokenizer(backend, encode_prompt("start"), True)
        out, i = [], 0
        while i < len(ids):
            step = rng.randint(1, 4)
            out.append(detok.add(ids[i : i + step]))
            i += step
        assert all(REPLACEMENT not in d for d in out)
        assert "".join(out) == text


def test_prompt_context_is_short_and_starts_on_a_character(encode, encode_prompt, backend, split_char_text):
    prompt = encode_prompt("word " * 50 + split_char_text * 3)
    context = prompt_context(backend, prompt)
    assert 4 <= len(context) <= 24
    assert context == prompt[-len(context) :]
    assert REPLACEMENT not in backend.decode(context)
    assert prompt_context(backend, prompt[:3]) == prompt[:3]


def test_empty_step_returns_empty_text(encode, encode_prompt, backend):
    detok = IncrementalDetokenizer(backend, encode_prompt("x"), True)
    assert detok.add([]) == ""


def test_flush_releases_a_character_the_completion_never_finished(encode, encode_prompt, backend, split_char_text):
    ids = encode(split_char_text)
    cut = next(k for k in range(1, len(ids)) if backend.decode(ids[:k]).endswith("\ufffd"))
    prompt = encode_prompt("Say it:")
    det = IncrementalDetokenizer(backend, prompt, skip_special_tokens=True)
    streamed = "".join(det.add([i]) for i in ids[:cut])
    assert "\ufffd" not in streamed  # withheld while it might still complete
    tail = det.flush()
    assert tail.endswith("\ufffd")
    assert streamed + tail == backend.decode(prompt + ids[:cut])[len(backend.decode(prompt)):]
    assert det.flush() == ""  # nothing left


def positional_text(backend, prompt, ids, skip_special_tokens=True):
    """What the completion's text must be: decode(prompt + output) minus decode(prompt), by position."""
    full = backend.decode(prompt + ids, skip_special_tokens=skip_special_tokens)
    return full[len(backend.decode(prompt, skip_special_tokens=skip_special_tokens)) :]


def test_a_prompt_ending_inside_a_character_is_not_repeated(encode, encode_prompt, backend, split_char_text):
    """The bug: a token-id prompt cut inside a UTF-8 character made the first delta repeat its tail."""
    ids = encode(split_char_text)
    cut = next(k for k in range(1, len(ids)) if backend.decode(ids[:k]).endswith(REPLACEMENT))
    prompt = encode_prompt("The harbour was quiet.") + ids[:cut]
    completion = ids[cut:] + encode(" and the boats")
    det = IncrementalDetokenizer(backend, prompt, skip_special_tokens=True)
    text = "".join(det.add([i]) for i in completion) + det.flush()
    assert text == positional_text(backend, prompt, completion)
    assert "quiet" not in text and not text.startswith(REPLACEMENT)
    assert text.endswith(" and the boats")


@settings(max_examples=300, derandomize=True, deadline=None)
@given(data=st.data())
def test_random_token_id_prompts_follow_the_positional_definition(tokenizer, backend, data) -> None:
    """Property: for any token-id prompt and output (specials included, any chunking), the streamed
    text is decode(prompt + output)[len(decode(prompt)):] - it never contains prompt text."""
    ids = st.integers(min_value=0, max_value=tokenizer.vocab_size - 1)
    prompt = data.draw(st.lists(ids, min_size=1, max_size=40), label="prompt")
    output = data.draw(st.lists(ids, min_size=1, max_size=24), label="output")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(output), max_size=len(output)), label="chunks")
    det = IncrementalDetokenizer(backend, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    for size in chunks:
        if i >= len(output):
            break
        deltas.append(det.add(output[i : i + size]))
        i += size
    deltas.append(det.flush())
    assert "".join(deltas) == positional_text(backend, prompt, output, skip)


def test_a_copy_is_primed_like_the_original_and_independent_of_it(encode, encode_prompt, backend,
                                                                  split_char_text):
    """The n completions of one prompt share one priming (OutputProcessor copies it): each copy must then
    produce exactly what a detokenizer of its own would, whatever the others are fed."""
    prompt = encode_prompt("Once upon a time")
    original = IncrementalDetokenizer(backend, prompt, True)
    twin = original.copy()
    first, second = encode(split_char_text + " and more"), encode(" a different ending")
    got_first = [original.add([t]) for t in first]
    got_second = [twin.add([t]) for t in second]
    assert got_first == stream(backend, prompt, first)
    assert got_second == stream(backend, prompt, second)
    assert "".join(got_second) == backend.decode(prompt + second)[len(backend.decode(prompt)):]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE, 49152 ids), from the GGUF `make install` puts in
    the environment."""
    from entrypoints.demo_model import demo_gguf_path
    from frontend_svc.tokenizer import Tokenizer

    return Tokenizer.from_gguf(demo_gguf_path())


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def any_tokenizer(request, tokenizer, smollm2_tokenizer):
    return tokenizer if request.param == "tiny" else smollm2_tokenizer


@settings(max_examples=150, derandomize=True, deadline=None)
@given(data=st.data())
def test_streamed_text_is_byte_identical_to_a_full_decode(any_tokenizer, data) -> None:
    """Property, on the tiny and the SmolLM2 tokenizer, with the shared single-token cache warm or cold
    (the one-call-per-token path reads a prefix's length from it): the concatenated deltas are, byte for
    byte, decode(prompt + output)[len(decode(prompt)):], one token per step as the engine sends them."""
    backend = any_tokenizer.backend
    ids = st.integers(min_value=0, max_value=any_tokenizer.vocab_size - 1)
    prompt = data.draw(st.lists(ids, min_size=1, max_size=30), label="prompt")
    output = data.draw(st.lists(ids, min_size=1, max_size=40), label="output")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    det = IncrementalDetokenizer(backend, prompt, skip, any_tokenizer.token_texts)
    text = "".join(det.add([t]) for t in output) + det.flush()
    assert text.encode() == positional_text(backend, prompt, output, skip).encode()


def test_streamed_real_text_matches_decode_on_smollm2(smollm2_tokenizer) -> None:
    """Real text (multi-byte characters, emoji, code) split at every token, in the context of a chat prompt."""
    tk = smollm2_tokenizer
    prompt = tk.apply_chat_template([{"role": "user", "content": "Write something."}])
    output = tk.encode("Café au lait — naïve 🌊 日本語 `x = {\"a\": 1}`\n\n  indented\tend.", add_special_tokens=False)
    det = IncrementalDetokenizer(tk.backend, prompt, True, tk.token_texts)
    deltas = [det.add([t]) for t in output]
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) + det.flush() == positional_text(tk.backend, prompt, output)


class CountingBackend:
    """A tokenizers.Tokenizer stand-in that counts decode calls."""

    def __init__(self, backend) -> None:
        self.backend, self.calls = backend, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def test_one_tokenizer_call_per_token_once_the_cache_is_warm(encode, encode_prompt, backend) -> None:
    """The hot path: a step that emits one token's text costs one decode (the prefix comes from the shared
    single-token cache), not two."""
    from shared_runtime.token_texts import TokenTexts

    counting = CountingBackend(backend)
    texts = TokenTexts(counting)
    ids = encode(" the boats came home and the boats went out")
    for t in ids:  # warm the cache
        texts.text(t, True)
    det = IncrementalDetokenizer(counting, encode_prompt("Once"), True, texts)
    counting.calls = 0
    text = "".join(det.add([t]) for t in ids)
    assert text == " the boats came home and the boats went out"
    assert counting.calls == len(ids)


def test_token_texts_are_single_token_decodes_per_flag(tokenizer, backend) -> None:
    texts = tokenizer.token_texts
    special = tokenizer.all_special_ids[0]
    for t in [special, *range(5, 60)]:
        assert texts.text(t) == backend.decode([t], skip_special_tokens=False)
        assert texts.text(t, True) == backend.decode([t], skip_special_tokens=True)
    assert texts.text(special) != "" and texts.text(special, True) == ""
