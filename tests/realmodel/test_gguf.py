"""GGUF files: clear errors for what tandem cannot serve, a conversion bit-identical to transformers' own GGUF
loading, and a frontend that reads a GGUF's tokenizer and chat template without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine_svc.config import ConfigError, EngineConfig
from entrypoints.demo_model import main_convert
from tests.realmodel.support import CHAT_QUESTIONS, chat
from tests.support import ROOT

SAMPLE_TEXTS = ("Hello world!", "Café, niño, 中国 and 12345.", "<|im_start|>user\nHi<|im_end|>\n", "  two  spaces\n\n")


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    """A minimal GGUF file (metadata of a 1-layer model and the given tensors)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": np.zeros((16, 8), np.float32)})
    with pytest.raises(ConfigError, match=r"GGUF architecture 'gpt2' is not supported.*llama, qwen2, qwen3"):
        EngineConfig.create(model=str(model))


def test_an_unsupported_tensor_type_is_a_clear_error(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "ints.gguf", "llama", {"token_embd.weight": np.zeros((16, 8), np.int8)})
    with pytest.raises(ConfigError, match=r"holds tensors of type I8.*supported types: F32, F16, BF16, Q4_0"):
        EngineConfig.create(model=str(model))


def test_convert_gguf_explains_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main_convert([str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2
    assert "missing.gguf is not a .gguf file" in capsys.readouterr().out


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(smollm2_gguf: Path):
    """transformers' own tokenizer for the GGUF file (its gguf_file path)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


FRONTEND_WITHOUT_TORCH = """
import json, sys
for name in ("torch", "triton", "engine_svc"):
    sys.modules[name] = None  # any import of them now fails
from frontend_svc.config import FrontendConfig
from frontend_svc.tokenizer import Tokenizer
config = FrontendConfig(model=sys.argv[1], metrics_port=0)
tokenizer = Tokenizer.from_pretrained(config.model)
texts = json.loads(sys.argv[2])
print(json.dumps({
    "limits": config.hf_config(), "eos": tokenizer.eos_token_ids, "bos": tokenizer.bos_token_id,
    "encoded": [tokenizer.encode(t) for t in texts],
    "chat": tokenizer.apply_chat_template(json.loads(sys.argv[3])),
    "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch" and sys.modules[m] is not None),
}))
"""


@pytest.mark.slow
def test_the_frontend_reads_a_gguf_tokenizer_without_torch(smollm2_gguf: Path, hf_gguf_tokenizer) -> None:
    """`tandem-frontend --model X.gguf`: tokenizer, chat template and limits from the file, torch unimportable,
    encoding exactly as transformers' GGUF tokenizer does."""
    messages = chat(CHAT_QUESTIONS[0])
    proc = subprocess.run(
        [sys.executable, "-c", FRONTEND_WITHOUT_TORCH, str(smollm2_gguf), json.dumps(SAMPLE_TEXTS), json.dumps(messages)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["torch"] == []
    assert got["limits"] == {"vocab_size": 49152, "max_position_embeddings": 8192}
    assert got["eos"] == [hf_gguf_tokenizer.eos_token_id] and got["bos"] == hf_gguf_tokenizer.bos_token_id
    assert got["encoded"] == [hf_gguf_tokenizer(t)["input_ids"] for t in SAMPLE_TEXTS]
    rendered = hf_gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert got["chat"] == hf_gguf_tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_conversion_is_bit_identical_to_transformers_gguf_loading(smollm2_gguf: Path, smollm2_dir: Path,
                                                                  hf_gguf_tokenizer) -> None:
    """`tandem convert-gguf` (tandem's own GGUF reader: names, q/k un-permutation, dequantization) against
    transformers' `from_pretrained(gguf_file=...)`, tensor by tensor; and the written tokenizer."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from frontend_svc.tokenizer import Tokenizer

    theirs = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                  dtype=torch.float32).state_dict()
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        ours = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: the embedding serves as the LM head
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    written = Tokenizer.from_pretrained(smollm2_dir)
    assert [written.encode(t) for t in SAMPLE_TEXTS] == [hf_gguf_tokenizer(t)["input_ids"] for t in SAMPLE_TEXTS]
    assert written.render_chat(chat("Hi")) == hf_gguf_tokenizer.apply_chat_template(
        chat("Hi"), add_generation_prompt=True, tokenize=False)
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["dtype"] == "float32"
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == [2]
