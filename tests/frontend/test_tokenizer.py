"""frontend_svc.tokenizer.Tokenizer: agrees with transformers, reads EOS ids, never imports torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from transformers import AutoTokenizer

from frontend_svc.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and a trailing one ",
    "naïve café — Ελληνικά, русский, 中文字符, 日本語 🚀👩‍💻",
    "def f(x):\n\treturn x ** 2  # 12345",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bonjour ☕ ?"}]


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_using_it_never_imports_torch(tiny_model_dir: Path) -> None:
    code = (
        "import sys\n"
        "from frontend_svc.tokenizer import Tokenizer\n"
        "tok = Tokenizer.from_pretrained(sys.argv[1])\n"
        "tok.decode(tok.apply_chat_template([{'role': 'user', 'content': 'hi'}]) + tok.encode('x'))\n"
        "print(','.join(sorted(m for m in ('torch', 'triton', 'engine_svc') if m in sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],  # the repo root, so frontend_svc imports
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_attributes_of_the_tiny_model(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    assert tok.vocab_size == 512
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == [1, 4]  # <|eos|> from the tokenizer, then <|im_end|> from generation_config
    assert sorted(tok.all_special_ids) == [0, 1, 2, 3, 4]
    assert tok.model_max_length == 2048
    assert isinstance(tok.backend, RustTokenizer)
    assert tok.has_chat_template


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_encode_decode_match_transformers(make_model, arch: str) -> None:
    model_dir = make_model(arch)
    tok = Tokenizer.from_pretrained(model_dir)
    reference = AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)


def test_decode_round_trips_and_skips_specials(tokenizer_under_test: Tokenizer) -> None:
    tok = tokenizer_under_test
    for text in TEXTS[:4]:
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == "<|bos|>" + text
    assert tok.decode([]) == ""
    assert tok.decode((1, 4)) == ""


def test_decode_of_a_cut_character_is_a_replacement_char(tokenizer_under_test: Tokenizer) -> None:
    tok = tokenizer_under_test
    pieces = [tok.decode([i]) for i in tok.encode("👩‍💻🦋", add_special_tokens=False)]
    assert any("\ufffd" in piece for piece in pieces)


def test_chat_template_matches_transformers(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    for add_generation_prompt in (True, False):
        expected_text = reference.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
        assert tok.render_chat(MESSAGES, add_generation_prompt) == expected_text
        assert ids == reference.encode(expected_text, add_special_tokens=False)
        assert ids.count(tok.bos_token_id) == 1  # the template's BOS only, none added on top
    assert tok.decode(tok.apply_chat_template(MESSAGES), skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n"
    )


def test_missing_chat_template_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_model(tiny_model_dir, tmp_path / "no-template")
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(model_dir)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)
    assert tok.encode("still encodes") == Tokenizer.from_pretrained(tiny_model_dir).encode("still encodes")


@pytest.mark.parametrize(
    ("generation_eos", "expected"),
    [(None, [1]), (1, [1]), (4, [1, 4]), ([4, 1, 3], [1, 4, 3]), ("absent", [1])],
)
def test_eos_ids_merge_generation_config(
    tiny_model_dir: Path, tmp_path: Path, generation_eos: object, expected: list[int]
) -> None:
    model_dir = _copy_model(tiny_model_dir, tmp_path / "eos")
    gen_path = model_dir / "generation_config.json"
    if generation_eos == "absent":
        gen_path.unlink()
    else:
        gen_path.write_text(json.dumps({"bos_token_id": 0, "eos_token_id": generation_eos}))
    assert Tokenizer.from_pretrained(model_dir).eos_token_ids == expected


def test_model_max_length_absent_is_none(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_model(tiny_model_dir, tmp_path / "no-max")
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["model_max_length"]
    config_path.write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(model_dir).model_max_length is None


def test_requires_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.fixture(scope="module")
def tokenizer_under_test(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)
