"""Structured outputs: what a JSON-schema constraint costs the engine, side by side in one run.

Workload (issue "Structured outputs and tool calling"): 32 concurrent chat requests on SmolLM2-135M-Instruct
(`tandem make-demo-model DIR`), each asking for a JSON example of one of four schemas (nested objects,
arrays with min/max items and enums, integer ranges with optional fields, string patterns), temperature
0.7, in the in-process engine (`engine_svc.LLM`, the engine is where a constraint costs: compile, bitmask
fill, logits mask, matcher advance).

1. constrained: the 32 requests with `structured_outputs.json` (the grammars compiled beforehand by a
   warm-up, as the LRU cache holds them in a running server; the cold compile time is printed apart).
2. unconstrained: the same 32 prompts, each with max_tokens = the length its constrained run produced and
   ignore_eos, so both runs generate exactly the same number of tokens.
   Overhead = 1 - constrained tok/s / unconstrained tok/s (median over --rounds alternating rounds).
3. with `--baseline-tree DIR` (a checkout of the code before structured outputs, e.g.
   `git archive main | tar -x -C DIR`): the unconstrained run also in two fresh processes that never see a
   constrained request, one on this tree and one on DIR, to show a batch without constrained rows is not
   slower. Every run of a round is timed in turn (the order reversed every other round); the worker
   processes are idle while another runs.

    python bench/structured_outputs.py --model /tmp/smollm2 [--rounds 3] [--baseline-tree /tmp/base]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3},
        "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["colors", "size"], "additionalProperties": False},
    "profile": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number"},
        "nickname": {"type": "string", "maxLength": 12}},
        "required": ["age"], "additionalProperties": False},
    "codes": {"type": "array", "items": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
              "minItems": 1, "maxItems": 4},
}


def prompts(model: str, n: int) -> list[tuple[list[int], str]]:
    """n chat prompts (token ids) cycling over the schemas, with the schema's name."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    names = list(SCHEMAS)
    out = []
    for i in range(n):
        name = names[i % len(names)]
        messages = [{"role": "user", "content": f"Reply with JSON for a {name} (example {i})."}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append((list(tok(text, add_special_tokens=False)["input_ids"]), name))
    return out


def timed(llm: Any, ids: list[list[int]], params: list[Any]) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    outs = llm.generate(ids, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def unconstrained_params(lengths: list[int]) -> list[Any]:
    from entrypoints import SamplingParams

    return [SamplingParams(temperature=0.7, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]


def unconstrained_worker(tree: str, model: str, work_file: str, rounds: int) -> None:
    """Subprocess mode: time the unconstrained run with the engine of `tree` when told (one stdin line per
    round); print elapsed seconds."""
    sys.path.insert(0, tree)
    import engine_svc
    from entrypoints import LLM

    assert Path(engine_svc.__file__).resolve().is_relative_to(Path(tree).resolve()), engine_svc.__file__

    work = json.loads(Path(work_file).read_text())
    llm = LLM(model, dtype="float32", max_num_seqs=32)
    params = unconstrained_params(work["lengths"])
    timed(llm, work["ids"][:2], params[:2])  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for _ in range(rounds):
        line = sys.stdin.readline()  # the parent says when (rounds alternate with this tree's)
        if not line:
            return
        elapsed, _ = timed(llm, work["ids"], params)
        print(json.dumps({"elapsed": elapsed}), flush=True)
    llm.engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="SmolLM2 directory (tandem make-demo-model DIR)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-tree", help="a checkout without structured outputs (see the docstring)")
    ap.add_argument("--worker", nargs=2, metavar=("TREE", "WORK_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        unconstrained_worker(args.worker[0], args.model, args.worker[1], args.rounds)
        return
    sys.path.insert(0, str(ROOT))
    import jsonschema

    from entrypoints import LLM, SamplingParams
    from shared_runtime.contract import StructuredOutputs

    work = prompts(args.model, args.num_requests)
    ids = [p for p, _ in work]
    llm = LLM(args.model, dtype="float32", max_num_seqs=args.num_requests)
    constrained = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens, structured_outputs=(
        StructuredOutputs(json=json.dumps(SCHEMAS[name])))) for i, (_, name) in enumerate(work)]
    cold = []
    for name in SCHEMAS:  # warm-up: compile each schema once (the first also reads the vocabulary)
        start = time.perf_counter()
        llm.generate([ids[0]], SamplingParams(max_tokens=1, structured_outputs=StructuredOutputs(
            json=json.dumps(SCHEMAS[name]))), use_tqdm=False)
        cold.append(time.perf_counter() - start)
    _, outs = timed(llm, ids, constrained)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    valid = 0
    for out, (_, name) in zip(outs, work, strict=True):
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name])
            valid += 1
        except ValueError:
            pass  # a completion cut by max_tokens (counted, not hidden)
    plain = unconstrained_params(lengths)
    print(f"constrained lengths: {sum(lengths)} tokens, {valid}/{len(outs)} valid", flush=True)
    workers: dict[str, subprocess.Popen[str]] = {}
    if args.baseline_tree:  # the same unconstrained run by fresh processes (no constrained request ever):
        work_file = Path(args.baseline_tree) / "structured-bench-work.json"  # this tree's and the baseline's
        work_file.write_text(json.dumps({"ids": ids, "lengths": lengths}))
        for name, tree in (("this tree, fresh process", str(ROOT)), ("baseline tree, fresh process",
                                                                       args.baseline_tree)):
            workers[name] = subprocess.Popen(
                [sys.executable, __file__, "--model", args.model, "--rounds", str(args.rounds),
                 "--worker", tree, str(work_file)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree)
        for worker in workers.values():
            assert worker.stdout is not None
            assert json.loads(worker.stdout.readline())["ready"]  # loaded: it competes for no CPU from here
    tokens = sum(lengths)
    rows: dict[str, list[float]] = {"constrained": [], "unconstrained": [], **{name: [] for name in workers}}

    def run_constrained() -> None:
        elapsed, outs = timed(llm, ids, constrained)
        assert [len(o.outputs[0].token_ids) for o in outs] == lengths, "seeded runs must repeat"
        rows["constrained"].append(tokens / elapsed)

    def run_plain() -> None:
        elapsed, outs = timed(llm, ids, plain)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == tokens
        rows["unconstrained"].append(tokens / elapsed)

    def run_worker(name: str) -> None:
        worker = workers[name]
        assert worker.stdin is not None and worker.stdout is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
        rows[name].append(tokens / json.loads(worker.stdout.readline())["elapsed"])

    runs = [run_constrained, run_plain, *(functools.partial(run_worker, name) for name in workers)]
    for i in range(args.rounds):  # alternating rounds, the order reversed every other one (drift hits all alike)
        for run in runs[:: 1 if i % 2 == 0 else -1]:
            run()
        print("round:", {k: round(v[-1], 1) for k, v in rows.items() if v}, flush=True)
    for worker in workers.values():
        worker.wait(60)
    llm.engine.shutdown()
    print(f"{args.num_requests} requests, {tokens} output tokens, {valid}/{len(outs)} outputs validate "
          f"against their schema; cold compile (first includes the vocabulary) "
          f"{', '.join(f'{c:.2f}' for c in cold)} s")
    median = {k: statistics.median(v) for k, v in rows.items() if v}
    for name, values in rows.items():
        if values:
            print(f"  {name:32s} {median[name]:7.1f} tok/s  (rounds: {', '.join(f'{v:.1f}' for v in values)})")
    print(f"structured-output overhead: {1 - median['constrained'] / median['unconstrained']:+.1%} "
          f"(1 - constrained / unconstrained tok/s, medians)")
    if workers:
        print(f"no constrained rows, fresh processes, this tree vs baseline: "
              f"{median['this tree, fresh process'] / median['baseline tree, fresh process']:.3f}x tok/s")


if __name__ == "__main__":
    main()
