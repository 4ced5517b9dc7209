"""An EAGLE-3 head directory, read and checked against its target at start (no weights loaded).

The layout vLLM loads (its `Eagle3LlamaForCausalLM`): `config.json` with `architectures`
`LlamaForCausalLMEagle3` or `Eagle3LlamaForCausalLM`, a Llama config for the one decoder layer
(`hidden_size`, heads, `intermediate_size`, rope settings), `vocab_size` (the target's), optionally
`draft_vocab_size` (the head's own, smaller, output vocabulary), `target_hidden_size` (the target's
width when it differs) and `eagle_aux_hidden_state_layer_ids` (the target layers whose inputs the head
reads; default (2, L // 2, L - 3) for an L-layer target, as vLLM); and safetensors with
- `fc.weight` [H, 3 * target_hidden]: folds the three auxiliary hidden states into one;
- `midlayer.*` (or `layers.0.*`): the decoder layer, whose q/k/v projections read cat(embeds, hidden) (2H);
  its norms `input_layernorm` (embeds), `hidden_norm` (hidden), `post_attention_layernorm`;
- `norm.weight`, `lm_head.weight` [draft_vocab, H];
- `d2t` [draft_vocab]: draft id i is target id i + d2t[i] (needed when the vocabularies differ); `t2d`
  (unused, as in vLLM);
- `embed_tokens.weight` only if the head has its own embedding; otherwise it shares the target's.
A "model." prefix on tensor names is dropped. Every refusal names the field and both directories.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_svc.spec.config import SpeculativeConfigError

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX_LAYERS = 3


@dataclass(frozen=True)
class Eagle3HeadInfo:
    """What the engine needs to know about a head before loading it."""

    config: dict[str, Any]  # the head's config.json
    aux_layer_ids: tuple[int, ...]  # target layers whose inputs feed the head, in fc's order
    vocab_size: int  # the target's
    draft_vocab_size: int
    has_embedding: bool
    has_lm_head: bool


def checkpoint_name(name: str) -> str:
    """A head tensor's name as the loader matches it: no "model." prefix, the layer as `midlayer.`."""
    name = name.removeprefix("model.")
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's default: an early, the middle and a late layer of the target."""
    return 2, num_target_layers // 2, num_target_layers - 3


def read_eagle3_head(target_dir: str, head_dir: str) -> Eagle3HeadInfo:
    """Read `head_dir` and check it fits the target in `target_dir` (see the module docstring)."""
    from safetensors import safe_open

    head, target = _config(head_dir, "EAGLE-3 head"), _config(target_dir, "target")
    target = target.get("text_config", target)
    where = f"--speculative-config model {head_dir!r}"
    archs = head.get("architectures") or []
    if not archs or archs[0] not in ARCHITECTURES:
        raise SpeculativeConfigError(f"{where}: config.json architectures {archs!r} is not an EAGLE-3 head "
                                     f"(expected one of {', '.join(ARCHITECTURES)})")
    files = sorted(Path(head_dir).glob("*.safetensors"))
    if not files:
        raise SpeculativeConfigError(f"{where}: no *.safetensors files")
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names.update(checkpoint_name(n) for n in f.keys())  # noqa: SIM118 (safe_open is not a mapping)
    missing = [n for n in ("fc.weight", "norm.weight") if n not in names]
    if not any(n.startswith("midlayer.") for n in names):
        missing.append("midlayer.*")
    if missing:
        raise SpeculativeConfigError(f"{where}: the checkpoint lacks {', '.join(missing)}")
    target_hidden, hidden = int(target["hidden_size"]), int(head["hidden_size"])
    head_target_hidden = int(head.get("target_hidden_size") or hidden)
    if head_target_hidden != target_hidden:
        raise SpeculativeConfigError(f"{where}: target_hidden_size {head_target_hidden} (the width its fc "
                                     f"reads) differs from the target {target_dir!r}'s hidden_size {target_hidden}")
    has_embedding = "embed_tokens.weight" in names
    if not has_embedding and hidden != target_hidden:
        raise SpeculativeConfigError(f"{where}: hidden_size {hidden} differs from the target {target_dir!r}'s "
                                     f"{target_hidden}, and the head has no embed_tokens.weight of its own")
    vocab = int(target["vocab_size"])
    if int(head.get("vocab_size") or vocab) != vocab:
        raise SpeculativeConfigError(f"{where}: vocab_size {head.get('vocab_size')} differs from the target "
                                     f"{target_dir!r}'s {vocab}")
    draft_vocab = int(head.get("draft_vocab_size") or vocab)
    if not 1 <= draft_vocab <= vocab:
        raise SpeculativeConfigError(f"{where}: draft_vocab_size {draft_vocab} must be in [1, {vocab}] (the "
                                     "target's vocab_size)")
    if draft_vocab != vocab and "d2t" not in names:
        raise SpeculativeConfigError(f"{where}: draft_vocab_size {draft_vocab} differs from the target's "
                                     f"vocab_size {vocab} and the checkpoint has no d2t (draft -> target ids)")
    has_lm_head = "lm_head.weight" in names
    if not has_lm_head and draft_vocab != vocab:
        raise SpeculativeConfigError(f"{where}: the checkpoint lacks lm_head.weight (only a head over the "
                                     "target's whole vocabulary may share the target's)")
    num_layers = int(target["num_hidden_layers"])
    ids = head.get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(ids) if ids is not None else default_aux_layer_ids(num_layers)
    if len(aux) != NUM_AUX_LAYERS or not all(isinstance(i, int) and 0 <= i < num_layers for i in aux):
        source = "eagle_aux_hidden_state_layer_ids" if ids is not None else "the default aux layer ids"
        raise SpeculativeConfigError(f"{where}: {source} {list(aux)} must be {NUM_AUX_LAYERS} layer indices in "
                                     f"[0, {num_layers}) of the target {target_dir!r}")
    return Eagle3HeadInfo(head, aux, vocab, draft_vocab, has_embedding, has_lm_head)


def _config(path: str, role: str) -> dict[str, Any]:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise SpeculativeConfigError(f"--speculative-config model: no config.json in the {role} directory {path!r}")
    data: dict[str, Any] = json.loads(config.read_text())
    return data
