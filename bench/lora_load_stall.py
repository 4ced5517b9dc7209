"""What loading a LoRA adapter at run time costs, and where (CPU, in process).

A run-time load (docs/lora.md) has two parts: the engine process reads and checks the directory in a
thread, beside the step loop (`validate`, then `fingerprint`: the SHA-256 of its files that keys its
prefix-cache blocks), and then every worker reads it again and lays it out at the
start of the next step, which that step waits for (`worker read`: the step loop's one pause per load).
Both are timed here, `--reps` times alternated, for a random PEFT adapter of `--rank` on all seven
projections, and beside them the worker read with the step's whole thread team (what it was before the
read ran on one thread: each of its hundreds of tiny tensor ops then waits at the team's barrier, which
costs most on a loaded machine); printed: the median and the spread (min-max) of each, and the adapter's
file size.

    tandem make-demo-model /tmp/smollm2
    python bench/lora_load_stall.py --model /tmp/smollm2 --rank 16 --reps 7
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine_svc.lora.fingerprint import adapter_fingerprint
from engine_svc.lora.peft_dir import WEIGHTS_FILE, load_peft_adapter, validate_for_model
from entrypoints import LLM
from entrypoints.demo_lora import make_demo_lora

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        adapter = make_demo_lora(args.model, Path(tmp) / "adapter", rank=args.rank, targets=MODULES)
        llm = LLM(args.model, dtype="float32", enable_lora=True, max_lora_rank=max(16, args.rank),
                  max_cpu_loras=args.reps + 1)
        cfg, manager = llm.config, llm.engine.executor.worker.runner.lora  # type: ignore[attr-defined]
        validate_s, fingerprint_s, read_s, team_s = [], [], [], []
        for i in range(args.reps):
            start = time.perf_counter()
            validate_for_model(cfg.model, cfg.architecture, cfg.max_lora_rank, f"a{i}", str(adapter))
            validate_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            adapter_fingerprint(adapter)
            fingerprint_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            manager.read(100 + i, f"a{i}", str(adapter))
            read_s.append(time.perf_counter() - start)
            manager.remove(100 + i)
            start = time.perf_counter()
            manager.add(200 + i, load_peft_adapter(f"b{i}", str(adapter), max_rank=manager.rank,
                                                   num_layers=manager.num_layers, shapes=manager.shapes))
            team_s.append(time.perf_counter() - start)
            manager.remove(200 + i)
        llm.engine.shutdown()
        size = (Path(adapter) / WEIGHTS_FILE).stat().st_size
    print(f"adapter: rank {args.rank}, {len(MODULES)} projections, {size / 2**20:.1f} MiB")
    for label, values in (("validate (engine process, off the step loop)", validate_s),
                          ("fingerprint (engine process, off the step loop)", fingerprint_s),
                          ("worker read (the next step waits for it)", read_s),
                          (f"worker read on the team of {torch.get_num_threads()} threads (before)", team_s)):
        ms = [1000 * v for v in values]
        print(f"{label}: median {statistics.median(ms):.1f} ms (min {min(ms):.1f}, max {max(ms):.1f}; "
              f"{len(ms)} reps)")


if __name__ == "__main__":
    main()
