"""The step loop's longest pause while a LoRA adapter loads at run time, beside a running victim stream.

In process (the offline engine core, CPU, float32): a base-model victim decodes one token a step; `--reps`
times, a random PEFT adapter of `--rank` on all seven projections is loaded (`LoRARegistry.add`, what
`/v1/load_lora_adapter` does after its checks) and a one-token request names it; the window runs from the
load to that request's token. Printed per tree: the median and the spread (min-max) over loads of the
window's longest step (the victim's longest gap between two tokens), of the longest of as many steps
right after it without a load (the control: what a shared machine's noise alone gives), of the median
step before each load (the victim's usual gap), and of the load-to-token time.

With `--baseline-tree DIR` (another checkout, e.g. the main branch before the reads went off the step
loop), each round runs this script once in DIR's code and once in this tree's, alternating, each in its
own process; the same flags otherwise. Only APIs both trees have are used.

    tandem make-demo-model /tmp/smollm2
    python bench/lora_load_stall.py --model /tmp/smollm2 --rank 16 --reps 5 --rounds 3 --baseline-tree /work/main
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_STEPS = 8  # victim steps measured before each load
TREE = Path(__file__).resolve().parent.parent


def measure(model: str, rank: int, reps: int) -> dict[str, list[float]]:
    """One process's loads (see the module docstring): seconds per load of the window's longest step,
    of the median step before it, and of the load-to-token time."""
    from entrypoints import LLM
    from entrypoints.demo_lora import make_demo_lora
    from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

    def request(rid: str, prompt: list[int], lora: str, max_tokens: int) -> EngineCoreRequest:
        return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, lora_name=lora,
                                 sampling_params=EngineSamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                      ignore_eos=True))

    longest, usual, to_token, control = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        adapter = str(make_demo_lora(model, Path(tmp) / "adapter", rank=rank, targets=MODULES))
        llm = LLM(model, dtype="float32", enable_lora=True, max_lora_rank=max(16, rank), max_cpu_loras=2)
        core, registry = llm.engine, llm.engine.loras
        assert registry is not None
        core.add_request(request("victim", [1, 2, 3, 4, 5, 6, 7, 8], "", 100_000))
        for _ in range(BASE_STEPS):  # warm-up
            core.step()
        for i in range(reps):
            steps = []
            for _ in range(BASE_STEPS):
                start = time.perf_counter()
                core.step()
                steps.append(time.perf_counter() - start)
            usual.append(statistics.median(steps))
            loaded = time.perf_counter()
            registry.add(f"a{i}", adapter)
            core.add_request(request(f"new{i}", [9, 10, 11, 12], f"a{i}", 1))
            window, done = [], False
            while not done:
                start = time.perf_counter()
                outputs = core.step().outputs
                window.append(time.perf_counter() - start)
                done = any(o.request_id == f"new{i}" and o.finish_reason for o in outputs)
            to_token.append(time.perf_counter() - loaded)
            longest.append(max(window))
            registry.remove(f"a{i}")
            for _ in range(2):  # carry the drop
                core.step()
            steps = []
            for _ in range(len(window)):  # the control: as many steps, no load
                start = time.perf_counter()
                core.step()
                steps.append(time.perf_counter() - start)
            control.append(max(steps))
        core.shutdown()
    return {"longest": longest, "control": control, "usual": usual, "to_token": to_token}


def _summary(values: list[float]) -> str:
    ms = [1000 * v for v in values]
    return f"median {statistics.median(ms):.1f} ms (min {min(ms):.1f}, max {max(ms):.1f})"


def _child(tree: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{tree / 'protos'}")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--rank", str(args.rank),
           "--reps", str(args.reps), "--json"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=tree).stdout
    line = next(x for x in reversed(out.splitlines()) if x.startswith("{"))
    result: dict[str, list[float]] = json.loads(line)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5, help="loads per process")
    parser.add_argument("--rounds", type=int, default=1, help="with --baseline-tree: alternated rounds")
    parser.add_argument("--baseline-tree", help="another checkout to run side by side (alternating)")
    parser.add_argument("--json", action="store_true", help="print one process's raw figures as JSON")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.model, args.rank, args.reps)))
        return
    trees = {"this tree": TREE}
    if args.baseline_tree:
        trees = {f"baseline {args.baseline_tree}": Path(args.baseline_tree).resolve(), **trees}
    results: dict[str, dict[str, list[float]]] = {label: {} for label in trees}
    for _ in range(args.rounds if args.baseline_tree else 1):
        for label, tree in trees.items():
            for key, values in _child(tree, args).items():
                results[label].setdefault(key, []).extend(values)
    print(f"adapter: rank {args.rank} on {len(MODULES)} projections; {args.reps} loads x "
          f"{args.rounds if args.baseline_tree else 1} rounds per tree")
    for label, figures in results.items():
        print(f"{label}:")
        print(f"  longest step while loading (the victim's longest gap): {_summary(figures['longest'])}")
        print(f"  longest step of as many steps without a load (control): {_summary(figures['control'])}")
        print(f"  usual step (median of {BASE_STEPS} before each load): {_summary(figures['usual'])}")
        print(f"  load -> the adapter's first token: {_summary(figures['to_token'])}")


if __name__ == "__main__":
    main()
