"""What LoRA adapters cost a decode step: engine step times in process (CPU, or --device cuda), base vs
1 vs 8 adapters. On CUDA both engines replay CUDA graphs (the LoRA one through the Triton shrink/expand).

`--batch` requests decode together (short prompts, greedy). Four cases, alternated round by round in one
process so that a shared machine's noise hits them alike:
  base      an engine without --enable-lora
  lora-off  an engine with --enable-lora, every request on the base model (the hook's cost when unused)
  1 adapter every request on one adapter
  N adapters the requests spread over --adapters adapters (max_loras = that many)
The adapters are random PEFT adapters of --rank on all seven projections, made here with PEFT. Printed:
each case's median decode step (ms), its spread (min-max of the round medians) and its ratio to base; and
each case's fastest single step and its ratio to base's (on a shared machine the least disturbed figure).

    python bench/lora_step.py --model /tmp/smollm2 --dtype float32 --batch 32 --rank 16 --adapters 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: str, out: Path, count: int, rank: int) -> dict[str, str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES,
                                                 init_lora_weights=False))
    paths = {}
    for i in range(count):
        torch.manual_seed(i)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn_like(param) * 0.01)
        paths[f"a{i}"] = str(out / f"a{i}")
        peft_model.save_pretrained(paths[f"a{i}"])
    return paths


def decode_steps(core: EngineCore, loras: list[str], steps: int, tag: str) -> list[float]:
    """Each decode step's time (s) of len(loras) requests, request i on adapter loras[i] ("" = base)."""
    ids = [f"{tag}-{i}" for i in range(len(loras))]
    for i, (rid, lora) in enumerate(zip(ids, loras)):
        core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=[10 + i, 20, 30, 40, 50, 60, 70, 80],
                                           sampling_params=EngineSamplingParams(temperature=0.0, max_tokens=steps + 4,
                                                                                ignore_eos=True),
                                           lora_name=lora))
    core.step()  # the prefill
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    core.abort_requests(ids)
    while core.has_unfinished_requests():
        core.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(args.model, Path(tmp), args.adapters, args.rank)
        common = dict(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.batch,
                      max_model_len=256, kv_cache_memory_bytes=256 << 20)
        base = EngineCore(EngineConfig.create(**common))
        lora = EngineCore(EngineConfig.create(**common, enable_lora=True, lora_modules=paths,
                                              max_loras=args.adapters, max_lora_rank=args.rank))
        names = list(paths)
        cases = {
            "base": (base, [""] * args.batch),
            "lora-off": (lora, [""] * args.batch),
            "1 adapter": (lora, [names[0]] * args.batch),
            f"{args.adapters} adapters": (lora, [names[i % len(names)] for i in range(args.batch)]),
        }
        results: dict[str, list[float]] = {case: [] for case in cases}  # round medians
        fastest: dict[str, float] = {}  # the fastest single step: the least disturbed by a shared machine
        for r in range(args.rounds):
            for case, (core, loras) in cases.items():
                times = decode_steps(core, loras, args.steps, f"r{r}-{case}")
                results[case].append(statistics.median(times))
                fastest[case] = min(fastest.get(case, float("inf")), *times)
        ref = statistics.median(results["base"])
        print(f"{args.device}, batch {args.batch}, rank {args.rank} on all 7 projections, {args.dtype}, "
              f"{args.rounds} rounds")
        for case, values in results.items():
            med = statistics.median(values)
            print(f"{case:>12}: {1000 * med:7.1f} ms  (rounds {1000 * min(values):.1f}-{1000 * max(values):.1f})"
                  f"  x{med / ref:.3f}   fastest step {1000 * fastest[case]:6.1f} ms  x{fastest[case] / fastest['base']:.3f}")
        base.shutdown()
        lora.shutdown()


if __name__ == "__main__":
    main()
