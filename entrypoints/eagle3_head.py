"""A random-weight EAGLE-3 head for a target model, in the checkpoint layout vLLM loads.

`make_eagle3_head(target_dir, out_dir)` writes config.json (`architectures` ["LlamaForCausalLMEagle3"],
the target's width, heads, rope and vocabulary, `draft_vocab_size`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids` when given) and model.safetensors (`fc.weight`, `midlayer.*`,
`norm.weight`, `lm_head.weight`, `d2t`, `t2d`; no embedding: the head shares the target's). The draft
vocabulary is `draft_vocab_size` target ids drawn at random (sorted), mapped back by d2t.

`constant_draft=T`: a draft vocabulary of one id, which d2t maps to target id T: a head that always
proposes T, whose acceptance shows that proposals reach the target under their target ids. Random heads propose
tokens the target rarely picks (acceptance near 0): they measure what verification costs. Used by the
tests and bench/spec_decode.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def make_eagle3_head(target_dir: str | Path, out_dir: str | Path, *, draft_vocab_size: int | None = None,
                     aux_layer_ids: list[int] | None = None, constant_draft: int | None = None, seed: int = 0,
                     std: float = 0.05) -> Path:
    """Write the head (see the module docstring) into `out_dir`; return it."""
    import torch
    from safetensors.torch import save_file

    target: dict[str, Any] = json.loads((Path(target_dir) / "config.json").read_text())
    target = target.get("text_config", target)
    hidden, vocab = int(target["hidden_size"]), int(target["vocab_size"])
    heads = int(target["num_attention_heads"])
    kv_heads = int(target.get("num_key_value_heads") or heads)
    head_dim = int(target.get("head_dim") or hidden // heads)
    inter = int(target.get("intermediate_size") or 4 * hidden)
    draft_vocab = vocab if draft_vocab_size is None else draft_vocab_size
    if not 1 <= draft_vocab <= vocab:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab}], got {draft_vocab}")
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    if constant_draft is not None:  # one draft id, the constant
        draft_vocab, ids = 1, torch.tensor([constant_draft])
    else:
        ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    layer = "midlayer."
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        layer + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        layer + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        layer + "mlp.gate_proj.weight": rand(inter, hidden),
        layer + "mlp.up_proj.weight": rand(inter, hidden),
        layer + "mlp.down_proj.weight": rand(hidden, inter),
        layer + "input_layernorm.weight": torch.ones(hidden),
        layer + "hidden_norm.weight": torch.ones(hidden),
        layer + "post_attention_layernorm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": (torch.zeros(draft_vocab, hidden) if constant_draft is not None
                           else torch.randn(draft_vocab, hidden, generator=gen) * hidden ** -0.5),
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": hidden, "target_hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(target.get("max_position_embeddings", 2048)),
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "tie_word_embeddings": False,
        **{k: target[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if target.get(k) is not None},
    }
    if aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    """`tandem make-eagle3-head MODEL DIR [--draft-vocab-size N] [--aux-layer-ids A B C] [--seed S]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="tandem make-eagle3-head",
                                     description="write a random-weight EAGLE-3 head for MODEL into DIR (for "
                                                 "--speculative-config '{\"method\": \"eagle3\", ...}')")
    parser.add_argument("model")
    parser.add_argument("out_dir")
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="default: the target's vocab_size")
    parser.add_argument("--aux-layer-ids", type=int, nargs=3, default=None,
                        help="target layers the head reads (default: vLLM's 2, L/2, L-3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_eagle3_head(args.model, args.out_dir, draft_vocab_size=args.draft_vocab_size,
                           aux_layer_ids=args.aux_layer_ids, seed=args.seed)
    print(out)
    return 0
