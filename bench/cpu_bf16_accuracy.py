"""How far bfloat16 decoding on CPU is from float32: tandem's paths and transformers', on real chat prompts.

Each configuration decodes the same chat prompts greedily (the demo's questions and 20 more, chat template
rendered by transformers), recording at every step the chosen token's logprob and the top-5. The
reference is transformers' float32 model on the same prefix (teacher-forced on each configuration's own
output): per step |Δ| of the chosen and of the top-5 logprobs, and whether the chosen token is float32's
argmax there (top-1 agreement). Also printed: the first answer token of "What is the capital of France?",
a near-tie between "The" (504) and "L" (60) in float32.

Configurations (each in its own process, so that the environment switches apply):
  hf_bf16        transformers LlamaForCausalLM in bfloat16 (torch's ops)
  tandem_bf16    tandem in bfloat16 with its native CPU ops (the default on an AVX512-BF16 CPU)
  tandem_bf16_torch   the same with TANDEM_CPU_PAGED_ATTENTION=0 (no native ops: torch attention and layers)
  tandem_f32     tandem in float32 (a check of the reference: ~0)

    python bench/cpu_bf16_accuracy.py --model .tiny-models/SmolLM2-135M-Instruct [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOP = 5
THE, L = 504, 60  # SmolLM2's "The" and "L"
QUESTIONS = [
    "What is the capital of France?", "Give me three tips for staying healthy.", "Write a haiku about the sea.",
    "Tell me a short story about a robot who learns to paint.", "¿Cuál es la capital de España?",
    "What is 12 times 7?", "Explain photosynthesis in one sentence.", "Who wrote Romeo and Juliet?",
    "List three primary colors.", "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into French.", "Why is the sky blue?", "Name a planet in our solar system.",
    "What does a CPU do?", "Give me a synonym for 'happy'.", "How many days are in a week?",
    "What is the largest ocean on Earth?", "Write one sentence about cats.", "What is the capital of Japan?",
    "Describe the color green to someone.", "What is Python used for?", "Suggest a name for a pet dog.",
    "What is the opposite of hot?", "How do airplanes fly?",
]
CONFIGS: dict[str, dict[str, str]] = {
    "hf_bf16": {},
    "tandem_bf16": {},
    "tandem_bf16_torch": {"TANDEM_CPU_PAGED_ATTENTION": "0"},
    "tandem_f32": {},
}


def chat_prompts(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out


def decode_hf(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[dict[str, Any]]]:
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    hf.eval()
    runs = []
    for p in prompts:
        with torch.no_grad():
            gen = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=max_tokens, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=hf.config.eos_token_id)
        steps = []
        for t, logits in zip(gen.sequences[0, len(p):].tolist(), gen.logits):
            lp = torch.log_softmax(logits[0].float(), -1)
            values, ids = lp.topk(TOP)
            steps.append({"tok": t, "lp": float(lp[t]), "top": list(zip(ids.tolist(), values.tolist()))})
        runs.append(steps)
    return runs


def decode_tandem(model: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> list[list[dict[str, Any]]]:
    from entrypoints import LLM, SamplingParams

    llm = LLM(model, dtype=dtype)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOP),
                            use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [[{"tok": e.token_id, "lp": e.logprob, "top": [list(x) for x in e.top]} for e in o.outputs[0].logprobs or []]
            for o in outs]


def decode(config: str, model: str, max_tokens: int) -> list[list[dict[str, Any]]]:
    prompts = chat_prompts(model)
    if config == "hf_bf16":
        return decode_hf(model, prompts, max_tokens)
    return decode_tandem(model, "float32" if config == "tandem_f32" else "bfloat16", prompts, max_tokens)


def compare(model: str, runs: dict[str, list[list[dict[str, Any]]]]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_model: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ref_model.eval()
    tok = AutoTokenizer.from_pretrained(model)
    prompts = chat_prompts(model)
    print(f"{'config':18s} {'steps':>5s} {'top-1 agree':>11s} {'chosen |Δ| max':>14s} {'mean':>7s} "
          f"{'top-5 |Δ| max':>13s} {'mean':>7s}  France: lp(The) lp(L), answer")
    for config, outputs in runs.items():
        chosen: list[float] = []
        top5: list[float] = []
        agree = 0
        for p, steps in zip(prompts, outputs):
            with torch.no_grad():
                seq = torch.tensor([p + [s["tok"] for s in steps]])
                ref = torch.log_softmax(ref_model(seq).logits[0].float(), -1)
            for i, s in enumerate(steps):
                row = ref[len(p) + i - 1]
                chosen.append(abs(s["lp"] - float(row[s["tok"]])))
                top5 += [abs(v - float(row[t])) for t, v in s["top"]]
                agree += int(s["tok"] == int(row.argmax()))
        first = dict((t, v) for t, v in outputs[0][0]["top"])
        text = tok.decode([s["tok"] for s in outputs[0]][:10], skip_special_tokens=True)
        print(f"{config:18s} {len(chosen):5d} {agree / len(chosen):11.4f} {max(chosen):14.4f} "
              f"{sum(chosen) / len(chosen):7.4f} {max(top5):13.4f} {sum(top5) / len(top5):7.4f}  "
              f"{first.get(THE, float('nan')):.3f} {first.get(L, float('nan')):.3f} {text!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".tiny-models/SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: CONFIG OUT.json, decode one config
    args = ap.parse_args()
    if args.one:
        config, path = args.one
        Path(path).write_text(json.dumps(decode(config, args.model, args.max_tokens)))
        return
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            out = Path(tmp) / f"{config}.json"
            subprocess.run([sys.executable, __file__, "--model", args.model, "--max-tokens", str(args.max_tokens),
                            "--one", config, str(out)], check=True, env={**os.environ, **CONFIGS[config]})
            runs[config] = json.loads(out.read_text())
    compare(args.model, runs)


if __name__ == "__main__":
    main()
