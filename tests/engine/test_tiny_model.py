"""make_tiny_model: HF-loadable dirs for every arch, deterministic files, a byte-level tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from entrypoints.tiny_model import ARCHS, SPECIAL_TOKENS, main, make_tiny_model

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
MULTIBYTE_TEXT = "naïve café — Ελληνικά, русский, 中文字符, 日本語, 한국어 🚀👩‍💻 ∑ x² €5\n\ttab"


def _read_all(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_each_arch_loads_back_with_transformers(make_model, arch: str) -> None:
    model_dir = make_model(arch)
    assert {p.name for p in model_dir.iterdir()} == EXPECTED_FILES

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__ == HF_CLASSES[arch]
    assert model.dtype == torch.float32
    # Every id the model can emit decodes, and the tokenizer reaches the requested size.
    assert model.config.vocab_size == len(tokenizer) == 512
    assert model.get_input_embeddings().weight.shape == (512, 64)
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (0, 1, 2)
    assert tokenizer.unk_token is None


def test_arch_specific_shapes(make_model) -> None:
    qwen2 = load_file(make_model("qwen2") / "model.safetensors")
    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = qwen2[f"model.layers.0.self_attn.{proj}.bias"]
        assert bias.abs().sum() > 0  # randomised, so an engine that drops it diverges from HF
    assert qwen2["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)  # one KV head

    qwen3_config = json.loads((make_model("qwen3") / "config.json").read_text())
    assert qwen3_config["head_dim"] == 32
    qwen3 = load_file(make_model("qwen3") / "model.safetensors")
    assert qwen3["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert not torch.equal(qwen3["model.layers.0.self_attn.q_norm.weight"], torch.ones(32))

    mistral_config = json.loads((make_model("mistral") / "config.json").read_text())
    assert mistral_config["sliding_window"] is None

    gpt_oss = load_file(make_model("gpt_oss") / "model.safetensors")
    for name in ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias", "mlp.router.bias", "self_attn.sinks"):
        assert gpt_oss[f"model.layers.0.{name}"].abs().sum() > 0, name  # randomised: a dropped one diverges

    llama = load_file(make_model("llama") / "model.safetensors")
    assert not any(name.endswith(".bias") for name in llama)
    assert not torch.equal(llama["model.norm.weight"], torch.ones(64))


def test_generation_config_lists_both_eos_ids(llama_dir: Path) -> None:
    gen = json.loads((llama_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 4]
    assert (gen["bos_token_id"], gen["pad_token_id"]) == (0, 2)


def test_same_seed_gives_identical_files_and_new_seed_new_weights(tmp_path: Path) -> None:
    kwargs = dict(arch="qwen2", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    first = _read_all(make_tiny_model(tmp_path / "a", seed=7, **kwargs))
    again = _read_all(make_tiny_model(tmp_path / "b", seed=7, **kwargs))
    other = _read_all(make_tiny_model(tmp_path / "c", seed=8, **kwargs))
    assert first == again
    assert first["model.safetensors"] != other["model.safetensors"]
    for name in EXPECTED_FILES - {"model.safetensors"}:
        assert first[name] == other[name]  # the seed only changes the weights


def test_tokenizer_round_trips_multibyte_text(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == MULTIBYTE_TEXT
    assert tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False) == ids[1:]
    # Some characters are split across tokens: a lone piece is not valid UTF-8 on its own.
    lone_pieces = [tokenizer.decode([i]) for i in ids[1:]]
    assert any("\ufffd" in piece for piece in lone_pieces)


def test_any_byte_sequence_is_encodable(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    text = "".join(chr(c) for c in range(1, 0x250)) + "\U0001f9ea\u200d\U000e0041"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_chatml(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☕"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi ☕<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[:2] == [0, 3] and ids.count(3) == 3 and ids.count(4) == 2


def test_greedy_generations_are_varied(llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    for prompt in ("The quick brown fox", "def main():", "今天天气很好"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=2)
        generated = out[0, ids.shape[1] :].tolist()
        assert len(set(generated)) >= 8, generated
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert logits.std() > 1.0  # not near-uniform, so greedy picks are not coin flips


def test_tied_embeddings(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tied", num_layers=1, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert "lm_head.weight" not in load_file(model_dir / "model.safetensors")


def test_cli_passes_sizes_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    argv = [str(out), "--arch", "qwen3", "--seed", "3", "--num-layers", "1", "--hidden-size", "32"]
    argv += ["--num-heads", "4", "--num-kv-heads", "1", "--head-dim", "16", "--intermediate-size", "48"]
    argv += ["--vocab-size", "300", "--max-position-embeddings", "256"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    expected = dict(model_type="qwen3", num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=16, intermediate_size=48, vocab_size=300,
                    max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    assert {k: config[k] for k in expected} == expected
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 256


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(arch="gpt2"),
        dict(num_heads=4, num_kv_heads=3),
        dict(hidden_size=65, num_heads=4),
        dict(vocab_size=100),
    ],
)
def test_rejects_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path / "bad", **kwargs)
