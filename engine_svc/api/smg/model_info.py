"""What SMG's protocol asks an engine about its model (GetModelInfo) and the EOS ids its requests stop at.

A tandem frontend sends each request's EOS ids; SMG does not (vLLM's engine knows its own), so the engine
reads them once, at start, as the frontend's tokenizer does (frontend_svc/tokenizer.py): the tokenizer's
EOS token (tokenizer_config.json's `eos_token`, looked up among tokenizer.json's tokens) followed by
generation_config.json's `eos_token_id`, then config.json's, without duplicates. A .gguf model: its
`tokenizer.ggml.eos_token_id` (through the config rebuilt from its metadata).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_svc.config import read_hf_config


@dataclass(frozen=True)
class ModelFacts:
    model_type: str = ""
    architectures: list[str] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int = 0
    pad_token_id: int = 0


def read_model_facts(model: str) -> ModelFacts:
    """The model's type, architectures and special token ids (blocking file reads: call it in a thread)."""
    config = read_hf_config(model)
    path = Path(model)
    eos: list[int] = []
    if path.is_dir():
        eos += _tokenizer_eos_id(path)
        eos += _ids(_json(path / "generation_config.json").get("eos_token_id"))
    eos += _ids(config.get("eos_token_id"))
    return ModelFacts(model_type=str(config.get("model_type") or ""),
                      architectures=[str(a) for a in config.get("architectures") or []],
                      eos_token_ids=list(dict.fromkeys(eos)),
                      bos_token_id=_first(config.get("bos_token_id")), pad_token_id=_first(config.get("pad_token_id")))


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _ids(value: object) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _first(value: object) -> int:
    ids = _ids(value)
    return ids[0] if ids else 0


def _tokenizer_eos_id(path: Path) -> list[int]:
    """tokenizer_config.json's eos_token as an id of tokenizer.json ([] when either is missing)."""
    eos = _json(path / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return []
    tokenizer = _json(path / "tokenizer.json")
    for added in tokenizer.get("added_tokens") or []:
        if added.get("content") == eos:
            return [int(added["id"])]
    vocab = (tokenizer.get("model") or {}).get("vocab")
    return [int(vocab[eos])] if isinstance(vocab, dict) and eos in vocab else []
