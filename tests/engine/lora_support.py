"""Random PEFT LoRA adapters for tiny models, and PEFT's own greedy decoding as the oracle."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model_dir: Path, out_dir: Path, *, rank: int, alpha: float, targets: tuple[str, ...],
                 seed: int, rslora: bool = False, scale: float = 0.3) -> Path:
    """A PEFT adapter with random A and B (PEFT's own init leaves B = 0), saved in PEFT's format."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


@cache
def peft_model(model_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is None:
        return base.eval()
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int],
                max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with the (unmerged) PEFT model, recomputing the whole sequence each step."""
    model = peft_model(model_dir, adapter_dir)
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt):], logprobs


def make_prompts(seed: int, count: int, vocab: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]
