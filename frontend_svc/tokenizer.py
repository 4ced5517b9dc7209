"""The frontend's tokenizer: a thin, torch-free wrapper over a Hugging Face fast tokenizer.

It loads ``tokenizer.json`` exactly as written (transformers' ``PreTrainedTokenizerFast``, never a
model-specific class that might rebuild the pipeline), reads the chat template and special tokens from
``tokenizer_config.json`` and the extra EOS ids from ``generation_config.json``. A ``.gguf`` file is
read for the same things from its metadata (frontend_svc/gguf_tokenizer.py).

Invariants:
  * ``encode``/``decode`` go straight to the Rust ``tokenizers.Tokenizer`` (``backend``), the same object
    the incremental detokenizer streams with, so prompt and output text agree.
  * ``eos_token_ids`` is the tokenizer's EOS id followed by generation_config's, without duplicates.
  * ``sampling_defaults`` are generation_config's sampling fields (``SAMPLING_DEFAULT_KEYS``), what vLLM
    calls the model's defaults: only APIs whose contract says "the model's default" apply them.
  * Importing this module never imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from transformers import PreTrainedTokenizerFast

from frontend_svc import gguf_tokenizer
from frontend_svc.chat_template import ChatOptions, ChatTemplateError, render_chat
from shared_runtime.token_texts import TokenTexts

__all__ = ["ChatTemplateError", "Tokenizer"]

# transformers' placeholder for "no limit given" is int(1e30); anything this large means unknown.
_NO_MAX_LENGTH = 10**12
# generation_config.json's sampling fields, vLLM's model-specific sampling defaults
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class Tokenizer:
    """Text <-> token ids and chat rendering for one model."""

    def __init__(self, hf_tokenizer: Any, generation_eos_ids: Iterable[int] = (),
                 sampling_defaults: Mapping[str, float] | None = None) -> None:
        """``hf_tokenizer``: a transformers fast tokenizer; ``generation_eos_ids``: extra EOS ids;
        ``sampling_defaults``: the model's sampling defaults (generation_config.json)."""
        self._hf = hf_tokenizer
        self.sampling_defaults: dict[str, float] = dict(sampling_defaults or {})
        self.backend: tokenizers.Tokenizer = hf_tokenizer.backend_tokenizer
        """The Rust ``tokenizers.Tokenizer``: ``encode``/``decode`` here, and the incremental detokenizer's
        decodes (shared_runtime/detokenizer.py: a prefix/read-offset window, not ``DecodeStream``)."""
        self.token_texts = TokenTexts(self.backend)
        """Each token's text decoded alone, cached once for the detokenizer, logprobs and the OpenAI layer."""
        self.vocab_size: int = len(hf_tokenizer)
        """Number of ids, added tokens included."""
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.eos_token_ids: list[int] = _dedupe([hf_tokenizer.eos_token_id, *generation_eos_ids])
        self.all_special_ids: list[int] = list(hf_tokenizer.all_special_ids)
        max_len = hf_tokenizer.model_max_length
        self.model_max_length: int | None = int(max_len) if max_len and max_len < _NO_MAX_LENGTH else None
        """From tokenizer_config.json; None when the model does not say."""

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load the tokenizer of a local HF model directory (it must hold ``tokenizer.json``) or of a
        ``.gguf`` file."""
        path = Path(model_dir)
        if gguf_tokenizer.is_gguf(path):
            return cls.from_gguf(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        config = path / "generation_config.json"
        return cls(hf_tokenizer, _generation_eos_ids(config), generation_sampling_defaults(config))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer and chat template stored in a GGUF file's metadata."""
        hf_tokenizer, end_ids = gguf_tokenizer.hf_tokenizer_from_gguf(gguf_tokenizer.read_metadata(path))
        return cls(hf_tokenizer, end_ids)

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (chat template included) to ``out_dir``."""
        self._hf.save_pretrained(str(out_dir), save_jinja_files=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the model's template (e.g. BOS).
        ``encode_batch_fast`` (same ids, no offsets) releases the GIL while it runs, ``encode`` does not."""
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (invalid UTF-8 from a cut multi-byte character decodes to U+FFFD)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (transformers' convert_ids_to_tokens: e.g. "Ġhello", not decoded)."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    @property
    def has_chat_template(self) -> bool:
        return bool(self._hf.chat_template)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    options: ChatOptions | None = None) -> str:
        """The chat template applied to ``messages`` (dicts with ``role`` and ``content``), as text;
        ``options``: continue the final message, a per-request template, extra template variables
        (frontend_svc/chat_template.py). Raises ChatTemplateError."""
        return render_chat(self._hf, messages, add_generation_prompt, options)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat; the template supplies any BOS, so none is added."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def _generation_eos_ids(path: Path) -> list[int]:
    """``eos_token_id`` of a generation_config.json (an int or a list); [] when absent."""
    if not path.is_file():
        return []
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def generation_sampling_defaults(path: Path) -> dict[str, float]:
    """The numeric sampling fields of a generation_config.json (``SAMPLING_DEFAULT_KEYS``); {} when absent."""
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    return {key: float(config[key]) for key in SAMPLING_DEFAULT_KEYS
            if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool)}


def _dedupe(ids: Iterable[int | None]) -> list[int]:
    """``ids`` in first-seen order, without None or repeats."""
    seen: dict[int, None] = {}
    for i in ids:
        if i is not None:
            seen.setdefault(int(i), None)
    return list(seen)
