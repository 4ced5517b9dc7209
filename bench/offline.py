"""Offline throughput: tandem's in-process engine vs Hugging Face generate(), side by side in one run.

Workload (issue "Engine core"): 64 requests, prompt and output lengths uniform in [16, 256], random
prompt token ids, ignore_eos, greedy, on a tiny random-weight Llama (6 layers x hidden 256 by default).

HF is run as vLLM's `benchmark_throughput --backend hf` runs it: static batches of 16 in input order,
left padding, max_new_tokens = the longest requested output in the batch, and output tokens counted as
requested (not as generated).

Also reports tandem's steady-state step time and the share of it spent outside the model forward.

    python bench/offline.py [--num-requests 64] [--tensor-parallel-size 1] [--skip-hf]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_workload(n: int, vocab: int, seed: int, lo: int, hi: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
            for _ in range(n)]


def run_tandem(model_dir: Path, work: list[tuple[list[int], int]], tp: int) -> dict[str, float]:
    from engine_svc import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", tensor_parallel_size=tp)
    forward_time = _instrument_forward(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True) for _, out in work]
    llm.generate([work[0][0]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    steps = _count_steps(llm)
    forward_time[0] = 0.0
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == sum(out for _, out in work), "tandem produced a different number of tokens"
    n_steps = steps[0] - 1  # minus the warm-up's count base
    result = {"elapsed": elapsed, "tokens": generated, "tok_s": generated / elapsed, "steps": n_steps}
    if forward_time[0] > 0 and n_steps > 0:
        result["step_ms"] = 1e3 * elapsed / n_steps
        result["outside_forward"] = 1 - forward_time[0] / elapsed
    llm.engine.shutdown()
    return result


def _instrument_forward(llm) -> list[float]:
    """Accumulate wall time of model forward + logits (uniproc only; TP runs in other processes)."""
    acc = [0.0]
    worker = getattr(llm.engine.executor, "worker", None)
    if worker is None:
        return acc
    model = worker.model
    inner_forward, inner_logits = model.forward, model.compute_logits

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            acc[0] += time.perf_counter() - t
            return out
        return wrapper

    model.forward = timed(inner_forward)
    model.compute_logits = timed(inner_logits)
    return acc


def _count_steps(llm) -> list[int]:
    count = [0]
    inner = llm.engine.step

    def counted():
        count[0] += 1
        return inner()

    llm.engine.step = counted
    return count


def run_hf(model_dir: Path, work: list[tuple[list[int], int]], batch_size: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    counted = 0
    t0 = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i : i + batch_size]
        longest = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch])
        max_new = max(out for _, out in batch)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                           min_new_tokens=max_new, pad_token_id=pad, use_cache=True)
        counted += sum(out for _, out in batch)
    elapsed = time.perf_counter() - t0
    return {"elapsed": elapsed, "tokens": counted, "tok_s": counted / elapsed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=6)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from engine_svc.tiny_model import make_tiny_model

    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "bench", arch="llama", seed=args.seed,
                                    num_layers=args.num_layers, hidden_size=args.hidden_size,
                                    num_heads=args.hidden_size // 64, num_kv_heads=max(1, args.hidden_size // 128),
                                    vocab_size=args.vocab_size)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        work = make_workload(args.num_requests, vocab, args.seed, args.min_len, args.max_len)
        print(f"workload: {len(work)} requests, prompt+output lengths U[{args.min_len},{args.max_len}], "
              f"model {args.num_layers}L x {args.hidden_size}, vocab {vocab}, torch threads "
              f"{torch.get_num_threads()}")
        results = {}
        for tp in args.tensor_parallel_size:
            results[f"tandem tp={tp}"] = run_tandem(model_dir, work, tp)
        if not args.skip_hf:
            results["hf generate"] = run_hf(model_dir, work, args.hf_batch_size)

    print("\n| system | output tok/s | elapsed s | steps | step ms | outside forward |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['tok_s']:.0f} | {r['elapsed']:.2f} | {r.get('steps', '-')} | "
              f"{r['step_ms']:.2f} | {100 * r['outside_forward']:.0f}% |" if "step_ms" in r else
              f"| {name} | {r['tok_s']:.0f} | {r['elapsed']:.2f} | {r.get('steps', '-')} | - | - |")
    if "hf generate" in results:
        for name, r in results.items():
            if name != "hf generate":
                print(f"\n{name} / hf generate = {r['tok_s'] / results['hf generate']['tok_s']:.2f}x")
    tps = [results[k]["tok_s"] for k in results if k.startswith("tandem tp=")]
    if len(tps) > 1:
        print(f"tp={args.tensor_parallel_size[1]} / tp={args.tensor_parallel_size[0]} = {tps[1] / tps[0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
