"""What LoRA adapters cost a decode step: engine step times in process (CPU, or --device cuda), base vs
1 vs 8 adapters. On CUDA both engines replay CUDA graphs (the LoRA one through the Triton shrink/expand).

`--batch` requests decode together (short prompts, greedy). Four cases, alternated round by round in one
process so that a shared machine's noise hits them alike:
  base      an engine without --enable-lora
  lora-off  an engine with --enable-lora, every request on the base model (the hook's cost when unused)
  1 adapter every request on one adapter
  N adapters the requests spread over --adapters adapters (max_loras = that many)
On CPU, where the native op (engine_svc/lora/cpu_native.py) is built, `--torch-layouts` adds the 1 and N
adapter cases on the same engine with the op switched off (the torch layouts of engine_svc/lora/slots.py, the
path before the op), alternated with the others.
The adapters are random PEFT adapters of --rank on all seven projections, made here with PEFT. Printed:
each case's median decode step (ms), its spread (min-max of the round medians) and its ratio to base; and
each case's fastest single step and its ratio to base's (on a shared machine the least disturbed figure).

    python bench/lora_step.py --model /tmp/smollm2 --dtype float32 --batch 32 --rank 16 --adapters 8 --torch-layouts
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.lora.slots import StepLoRA
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


def lora_step_of(core: EngineCore) -> StepLoRA:
    """The in-process engine's per-step LoRA selection (its single worker's)."""
    manager = core.executor.worker.runner.lora  # type: ignore[attr-defined]
    assert manager is not None
    step: StepLoRA = manager.step
    return step


def decode_steps(core: EngineCore, loras: list[str], steps: int, tag: str,
                 native: ModuleType | None = None, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Each decode step's time (s) of len(loras) requests, request i on adapter loras[i] ("" = base); with
    `native` None on a LoRA engine, its native CPU op is switched off for these steps."""
    step = lora_step_of(core) if core.config.enable_lora else None
    if step is not None:
        step.native = native
    ids = [f"{tag}-{i}" for i in range(len(loras))]
    for i, (rid, lora) in enumerate(zip(ids, loras)):
        core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=[10 + i, 20, 30, 40, 50, 60, 70, 80],
                                           sampling_params=EngineSamplingParams(temperature=0.0, max_tokens=steps + 4,
                                                                                ignore_eos=True),
                                           lora_name=lora))
    core.step()  # the prefill
    times = []
    for _ in range(steps):
        t0 = clock()
        core.step()
        times.append(clock() - t0)
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
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="cpu: the process's CPU time per step, which a busy machine's descheduling does not "
                         "inflate (meaningful under OMP_NUM_THREADS=1, where no thread spins at a barrier)")
    ap.add_argument("--torch-layouts", action="store_true",
                    help="also the adapter cases with the native CPU op switched off")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(args.model, Path(tmp), args.adapters, args.rank)
        common = dict(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.batch,
                      max_model_len=256, kv_cache_memory_bytes=256 << 20)
        base = EngineCore(EngineConfig.create(**common))
        lora = EngineCore(EngineConfig.create(**common, enable_lora=True, lora_modules=paths,
                                              max_loras=args.adapters, max_lora_rank=args.rank))
        names = list(paths)
        op = lora_step_of(lora).native
        one, many = [names[0]] * args.batch, [names[i % len(names)] for i in range(args.batch)]
        cases = {
            "base": (base, [""] * args.batch, op),
            "lora-off": (lora, [""] * args.batch, op),
            "1 adapter": (lora, one, op),
            f"{args.adapters} adapters": (lora, many, op),
        }
        if args.torch_layouts:
            if op is None:
                raise SystemExit("--torch-layouts: the native CPU LoRA op is not in use here")
            cases["1 (torch)"] = (lora, one, None)
            cases[f"{args.adapters} (torch)"] = (lora, many, None)
        results: dict[str, list[float]] = {case: [] for case in cases}  # round medians
        fastest: dict[str, float] = {}  # the fastest single step: the least disturbed by a shared machine
        for r in range(args.rounds):
            for case, (core, loras, native) in cases.items():
                times = decode_steps(core, loras, args.steps, f"r{r}-{case}", native, clock)
                results[case].append(statistics.median(times))
                fastest[case] = min(fastest.get(case, float("inf")), *times)
        ref = statistics.median(results["base"])
        print(f"{args.device}, batch {args.batch}, rank {args.rank} on all 7 projections, {args.dtype}, "
              f"{args.rounds} rounds, {args.clock} clock, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}")
        for case, values in results.items():
            med = statistics.median(values)
            print(f"{case:>12}: {1000 * med:7.1f} ms  (rounds {1000 * min(values):.1f}-{1000 * max(values):.1f})"
                  f"  x{med / ref:.3f}   fastest step {1000 * fastest[case]:6.1f} ms  x{fastest[case] / fastest['base']:.3f}")
        base.shutdown()
        lora.shutdown()


if __name__ == "__main__":
    main()
