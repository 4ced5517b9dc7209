"""The tokenizer, chat template and model limits of a GGUF file, without torch.

A GGUF file has no tokenizer.json: llama.cpp stores the vocabulary, merges, token types, special ids,
flags and the chat template as metadata. The metadata is read with the `gguf` package (numpy only) and
the tokenizer is rebuilt by transformers' own GGUF converter (`convert_gguf_tokenizer`, the function
`AutoTokenizer.from_pretrained(..., gguf_file=...)` uses), then wrapped in a `PreTrainedTokenizerFast`
with the file's special tokens, BOS/EOS flags and chat template. transformers' GGUF *reader* imports
torch, which the frontend never does, hence the metadata read here.

Invariants:
- Importing this module or building a tokenizer never imports torch.
- The result encodes and decodes as transformers' GGUF tokenizer does (tests/realmodel checks it).
- `generation_eos_ids` are llama.cpp's end-of-generation ids beyond EOS (EOT, EOM) when the file has them.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

_GGUF_END_IDS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}


def is_gguf(path: str | Path) -> bool:
    """True for an existing file named *.gguf."""
    p = Path(path)
    return p.suffix.lower() == ".gguf" and p.is_file()


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of a GGUF file as a Python value (no tensor data is read). Cached: the
    config and the tokenizer both read it at start; callers must not modify the dict."""
    return _read_metadata(str(Path(path).resolve()))


@lru_cache(maxsize=2)
def _read_metadata(path: str) -> dict[str, Any]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    return {key: field.contents() for key, field in reader.fields.items()}


def model_limits(metadata: dict[str, Any]) -> dict[str, int]:
    """`vocab_size` and `max_position_embeddings` as config.json would state them."""
    arch = metadata["general.architecture"]
    limits = {"vocab_size": int(metadata.get(f"{arch}.vocab_size") or len(metadata["tokenizer.ggml.tokens"]))}
    if f"{arch}.context_length" in metadata:
        limits["max_position_embeddings"] = int(metadata[f"{arch}.context_length"])
    return limits


def hf_tokenizer_from_gguf(metadata: dict[str, Any]) -> tuple[Any, list[int]]:
    """(a transformers fast tokenizer, extra end-of-generation ids) for a GGUF file's metadata."""
    from transformers import PreTrainedTokenizerFast

    try:  # where recent transformers keep it
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # older releases: the same table and converter in integrations.ggml
        from transformers.integrations.ggml import (  # type: ignore[attr-defined,no-redef]
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError("the GGUF file holds no tokenizer (no tokenizer.ggml.tokens)")
    groups = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, init_kwargs = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":  # sentencepiece files that do not say add BOS
        init_kwargs.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in _SPECIAL_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            init_kwargs[name] = tokens[int(token_id)]
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    limits = model_limits(metadata)
    hf = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, **init_kwargs, **extra, clean_up_tokenization_spaces=False,
        model_max_length=limits.get("max_position_embeddings", int(1e30)),
    )
    end_ids = [int(metadata[k]) for k in _GGUF_END_IDS if k in metadata]
    return hf, end_ids
