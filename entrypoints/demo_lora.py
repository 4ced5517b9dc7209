"""`tandem make-demo-lora MODEL_DIR OUT_DIR`: a LoRA adapter for a model, made with PEFT, to try serving.

Nothing can be downloaded here, so the adapter is not trained: its A and B are random (seeded), small
enough to leave the model fluent and large enough to change its greedy answers. It is a real PEFT
directory (`adapter_config.json` + `adapter_model.safetensors`), so it serves exactly as a trained one:

    tandem make-demo-model /tmp/smollm2 && tandem make-demo-lora /tmp/smollm2 /tmp/smollm2-lora
    tandem serve --model /tmp/smollm2 --enable-lora --lora-modules demo=/tmp/smollm2-lora
"""

from __future__ import annotations

import argparse
from pathlib import Path

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_demo_lora(model_dir: str | Path, out_dir: str | Path, *, rank: int = 8, alpha: float = 16.0,
                   targets: tuple[str, ...] = ALL_MODULES, scale: float = 0.02, seed: int = 0) -> Path:
    """Write a random PEFT LoRA adapter of `rank` on `targets` for the model at `model_dir` to `out_dir`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * scale)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem make-demo-lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="the base model's Hugging Face directory")
    p.add_argument("out_dir", help="directory to write the adapter into (created if missing)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--targets", nargs="+", default=list(ALL_MODULES), choices=ALL_MODULES)
    p.add_argument("--scale", type=float, default=0.02, help="standard deviation of the random A and B")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = make_demo_lora(args.model_dir, args.out_dir, rank=args.rank, alpha=args.alpha,
                         targets=tuple(args.targets), scale=args.scale, seed=args.seed)
    print(out)
    return 0
