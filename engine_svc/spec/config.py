"""`--speculative-config`: vLLM's JSON keys, checked at start with errors that name the key.

Accepted: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b,
"disable_by_batch_size": n}, and {"method": "draft_model", "model": DIR, "num_speculative_tokens": k,
"disable_by_batch_size": n} (a smaller model with the target's vocabulary, run by the same workers:
engine_svc/worker/draft_step.py), and {"method": "eagle3", "model": DIR, "num_speculative_tokens": k} (an
EAGLE-3 head in vLLM's checkpoint layout, checked by engine_svc/spec/eagle3_head.py and run by
engine_svc/worker/eagle3_step.py). As in vLLM, a missing bound of the lookup takes the other's value, and
both default to 5 when neither is given; without "method", a "model" means `draft_model` (vLLM infers
EAGLE heads from "eagle" in the model's name: "eagle3" for a name with "eagle3"; EAGLE-1 heads are refused). `disable_by_batch_size`: no
request speculates in a step while that many requests (or more) are running, where verification no
longer pays.

Every request speculates, with the meaning of each sampling setting kept token by token: verification
scores position j of a request as if drafts 0..j-1 were its output (penalties, bad words and min_tokens
hold per token); seeded random requests verify with their own stream and get the tokens of plain
decoding (engine_svc/spec/rejection.py); a structured output constraint keeps only the drafts its
grammar allows and masks every verified position (engine_svc/structured/grammar.py) - prompt-lookup
drafts only: a draft model's or EAGLE-3 head's drafts are made in the step itself, after the mask, so
constrained requests decode one token a step with them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("ngram", "draft_model", "eagle3")
NOT_YET = ("eagle", "mtp", "medusa", "suffix")
MAX_SPECULATIVE_TOKENS = 8
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "disable_by_batch_size")


class SpeculativeConfigError(ValueError):
    """A --speculative-config value is invalid; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft's directory

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From the flag's JSON text, a dict (the offline API), or an already parsed config."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SpeculativeConfigError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                                         f"known: {', '.join(_KEYS)}")
        method = value.get("method")
        model = value.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise SpeculativeConfigError(f"--speculative-config model must be a model directory, got {model!r}")
        if method is None and model is not None:
            method = _inferred_method(model)
        if method in NOT_YET:
            raise SpeculativeConfigError(f"--speculative-config method {method!r} is not implemented in tandem "
                                         f"yet; available: {', '.join(METHODS)}")
        if method not in METHODS:
            raise SpeculativeConfigError(f"--speculative-config method {method!r} is not supported; "
                                         f"choose one of {', '.join(METHODS)}")
        k = _int(value, "num_speculative_tokens", None)
        if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(f"--speculative-config num_speculative_tokens must be an integer in "
                                         f"[1, {MAX_SPECULATIVE_TOKENS}], got {value.get('num_speculative_tokens')!r}")
        low, high = _int(value, "prompt_lookup_min", None), _int(value, "prompt_lookup_max", None)
        if low is None and high is None:
            low = high = 5
        low = high if low is None else low
        high = low if high is None else high
        assert low is not None and high is not None
        if low < 1:
            raise SpeculativeConfigError(f"--speculative-config prompt_lookup_min must be >= 1, got {low}")
        if high < low:
            raise SpeculativeConfigError(f"--speculative-config prompt_lookup_max ({high}) must be >= "
                                         f"prompt_lookup_min ({low})")
        disable = _int(value, "disable_by_batch_size", None)
        if disable is not None and disable < 1:
            raise SpeculativeConfigError(f"--speculative-config disable_by_batch_size must be >= 1, got {disable}")
        if method in ("draft_model", "eagle3") and model is None:
            raise SpeculativeConfigError(f'--speculative-config method "{method}" needs "model": the '
                                         f"{'draft model' if method == 'draft_model' else 'EAGLE-3 head'}'s directory")
        if method == "ngram" and model is not None:
            raise SpeculativeConfigError('--speculative-config model is not used by method "ngram"; drop it')
        return cls(method, k, low, high, disable, model)


def _inferred_method(model: str) -> str:
    """vLLM's choice when "method" is absent: EAGLE heads by their name, otherwise a draft model."""
    name = model.lower()
    if "eagle3" in name:
        return "eagle3"
    if "eagle-" in name:
        return "eagle"
    return "draft_model"


def check_draft_vocab(target_dir: str, draft_dir: str) -> None:
    """The draft must score the target's vocabulary: refuse a missing config or a vocab_size mismatch,
    naming both models (read from their config.json files; no weights are touched)."""
    sizes = []
    for role, path in (("target", target_dir), ("draft", draft_dir)):
        config = Path(path) / "config.json"
        if not config.is_file():
            raise SpeculativeConfigError(f"--speculative-config model: no config.json in the {role} model "
                                         f"directory {path!r}")
        data = json.loads(config.read_text())
        data = data.get("text_config", data)
        sizes.append(data.get("vocab_size"))
    if sizes[0] != sizes[1]:
        raise SpeculativeConfigError(f"--speculative-config model: the draft {draft_dir!r} has vocab_size "
                                     f"{sizes[1]}, the target {target_dir!r} has {sizes[0]}; a draft must "
                                     "share the target's vocabulary")


def _int(value: dict[str, Any], key: str, default: int | None) -> int | None:
    raw = value.get(key, default)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise SpeculativeConfigError(f"--speculative-config {key} must be an integer, got {raw!r}")
    return raw
