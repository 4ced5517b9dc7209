"""Offline throughput: tandem's in-process engine vs Hugging Face generate(), side by side in one run.

Workload (issue "Engine core"): 64 requests, prompt and output lengths uniform in [16, 256], random
prompt token ids, ignore_eos, greedy, on a tiny random-weight Llama (6 layers x hidden 256 by default),
or on a real model with `--model DIR` (e.g. SmolLM2-135M-Instruct from `tandem make-demo-model DIR`).
`--dtype float32 bfloat16` runs every system in each dtype, side by side in the same run.

HF is run as vLLM's `benchmark_throughput --backend hf` runs it: static batches of 16 in input order,
left padding, max_new_tokens = the longest requested output in the batch, and output tokens counted as
requested (not as generated).

Also reports tandem's steady-state step time and the share of it spent outside the model forward.
`--async-scheduling off on --rounds 3` runs tandem with async scheduling off and on, alternating, and
reports each mode's median over the rounds with the spread (min-max).

    python bench/offline.py [--num-requests 64] [--tensor-parallel-size 1] [--skip-hf]
    python bench/offline.py --async-scheduling off on --rounds 5 --skip-hf
    python bench/offline.py --model .tiny-models/SmolLM2-135M-Instruct --dtype float32 bfloat16 \
        --num-requests 16 --max-len 128
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


def run_tandem(model_dir: Path, work: list[tuple[list[int], int]], tp: int,
               dtype: str = "float32", async_scheduling: bool | None = None) -> dict[str, float]:
    from entrypoints import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, tensor_parallel_size=tp, async_scheduling=async_scheduling)
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


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["tok_s"])[(len(runs) - 1) // 2]


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


def linear_flops_per_token(model_dir: Path) -> tuple[float, float]:
    """(FLOPs of the decoder's linear layers per token, FLOPs of the LM head per sampled token)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv = c.hidden_size * head_dim * (c.num_attention_heads + 2 * c.num_key_value_heads)
    o = c.num_attention_heads * head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return 2.0 * c.num_hidden_layers * (qkv + o + mlp), 2.0 * c.hidden_size * c.vocab_size


def gemm_flops_per_s(rows: int, model_dir: Path, dtype: str = "float32") -> float:
    """Measured GEMM throughput in `dtype` on this machine for the MLP up-projection at `rows` tokens."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    dt = getattr(torch, dtype)
    a, b = torch.randn(rows, c.hidden_size, dtype=dt), torch.randn(c.hidden_size, 2 * c.intermediate_size, dtype=dt)
    for _ in range(10):
        a @ b
    n, t0 = 200, time.perf_counter()
    for _ in range(n):
        a @ b
    return 2.0 * rows * c.hidden_size * 2 * c.intermediate_size * n / (time.perf_counter() - t0)


def matmul_floors(model_dir: Path, work: list[tuple[list[int], int]], hf_batch: int,
                  dtype: str = "float32") -> dict[str, float]:
    """Seconds each system must spend in linear-layer GEMMs alone, at this machine's measured rate.

    tandem computes every prompt and output token once (64-row decode batches); HF's static batches also
    compute left padding and outputs past each request's own length (16-row batches)."""
    per_token, per_sample = linear_flops_per_token(model_dir)
    prompt = sum(len(p) for p, _ in work)
    out = sum(o for _, o in work)
    tandem = (prompt + out) * per_token + out * per_sample
    hf = 0.0
    for i in range(0, len(work), hf_batch):
        batch = work[i : i + hf_batch]
        longest, max_new = max(len(p) for p, _ in batch), max(o for _, o in batch)
        hf += len(batch) * ((longest + max_new) * per_token + max_new * per_sample)
    return {"tandem tp=1": tandem / gemm_flops_per_s(len(work), model_dir, dtype),
            "hf generate": hf / gemm_flops_per_s(hf_batch, model_dir, dtype)}


def run_hf(model_dir: Path, work: list[tuple[list[int], int]], batch_size: int,
           dtype: str = "float32") -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
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


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload and model flags shared by bench/offline.py and bench/serve.py."""
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=6)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None,
                    help="a Hugging Face model directory to run instead of the tiny random-weight Llama "
                         "(e.g. SmolLM2: `tandem make-demo-model DIR`)")
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=("float32", "bfloat16", "float16"),
                    help="run every system in each of these dtypes, side by side")


def describe_model(model_dir: Path, args: argparse.Namespace) -> str:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    name = model_dir.name if args.model else "tiny random-weight Llama"
    return f"{name} ({c.num_hidden_layers}L x {c.hidden_size}, vocab {c.vocab_size})"


def build_model_and_workload(tmp: str, args: argparse.Namespace) -> tuple[Path, list[tuple[list[int], int]]]:
    """The model (`--model`, or a tiny random-weight Llama of the requested size) and the seeded workload
    over its vocabulary."""
    from transformers import AutoConfig

    from entrypoints.tiny_model import make_tiny_model

    if args.model:
        model_dir = Path(args.model)
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        return model_dir, make_workload(args.num_requests, vocab, args.seed, args.min_len, args.max_len)
    torch.manual_seed(args.seed)
    model_dir = make_tiny_model(Path(tmp) / "bench", arch="llama", seed=args.seed, num_layers=args.num_layers,
                                hidden_size=args.hidden_size, num_heads=args.hidden_size // 64,
                                num_kv_heads=max(1, args.hidden_size // 128), vocab_size=args.vocab_size)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size  # the trained tokenizer may come out smaller
    return model_dir, make_workload(args.num_requests, vocab, args.seed, args.min_len, args.max_len)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--async-scheduling", nargs="+", choices=("default", "off", "on"), default=["default"],
                    help="tandem's --async-scheduling: run each mode (alternating with --rounds)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat tandem's runs, alternating the modes")
    args = ap.parse_args()

    results: dict[str, dict[str, float]] = {}
    spreads: dict[str, str] = {}  # name -> min-max tok/s over the rounds
    pairs: dict[str, list[float]] = {}  # name -> async on / off throughput of each round
    floors: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, work = build_model_and_workload(tmp, args)
        print(f"workload: {len(work)} requests, prompt+output lengths U[{args.min_len},{args.max_len}], "
              f"model {describe_model(model_dir, args)}, dtypes {' '.join(args.dtype)}, torch threads "
              f"{torch.get_num_threads()}")
        for dtype in args.dtype:
            for tp in args.tensor_parallel_size:
                rounds: dict[str, list[dict[str, float]]] = {}
                for i in range(args.rounds):
                    for mode in args.async_scheduling[:: -1 if i % 2 else 1]:  # neither always goes first
                        flag = {"default": None, "off": False, "on": True}[mode]
                        rounds.setdefault(mode, []).append(run_tandem(model_dir, work, tp, dtype, flag))
                for mode, runs in rounds.items():
                    name = f"tandem tp={tp} {dtype}" + ("" if mode == "default" else f" async {mode}")
                    results[name] = median_run(runs)
                    if len(runs) > 1:
                        spreads[name] = f"{min(r['tok_s'] for r in runs):.0f}-{max(r['tok_s'] for r in runs):.0f}"
                if {"off", "on"} <= set(rounds):
                    pairs[f"tandem tp={tp} {dtype}"] = [b["tok_s"] / a["tok_s"] for a, b in zip(rounds["off"], rounds["on"])]
            if not args.skip_hf:
                results[f"hf generate {dtype}"] = run_hf(model_dir, work, args.hf_batch_size, dtype)
            for name, floor in matmul_floors(model_dir, work, args.hf_batch_size, dtype).items():
                floors[f"{name} {dtype}"] = floor

    print(f"\n| system | output tok/s{' (median, min-max)' if spreads else ''} | elapsed s | steps | step ms | "
          "outside forward | GEMM floor s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        floor = f"{floors[name]:.2f}" if name in floors else "-"
        step = (f"{r['step_ms']:.2f} | {100 * r['outside_forward']:.0f}%" if "step_ms" in r else "- | -")
        spread = f" ({spreads[name]})" if name in spreads else ""
        print(f"| {name} | {r['tok_s']:.0f}{spread} | {r['elapsed']:.2f} | {r.get('steps', '-')} | {step} | {floor} |")
    modes = [m for m in args.async_scheduling if m != "default"]
    if len(modes) == 2:
        for dtype in args.dtype:
            for tp in args.tensor_parallel_size:
                a, b = (results[f"tandem tp={tp} {dtype} async {m}"] for m in modes)
                per_round = ", ".join(f"{r:.2f}" for r in pairs.get(f"tandem tp={tp} {dtype}", []))
                print(f"tandem tp={tp} {dtype}: async {modes[1]} / async {modes[0]} = {b['tok_s'] / a['tok_s']:.3f}x "
                      f"(medians; per round on/off: {per_round})")
    print("\nGEMM floor: the time the linear layers alone need at this machine's measured GEMM rate in that dtype.")
    for dtype in args.dtype:
        hf = results.get(f"hf generate {dtype}")
        for name, r in results.items():
            if hf is not None and name.startswith("tandem") and f" {dtype}" in name:
                print(f"{name} / hf generate {dtype} = {r['tok_s'] / hf['tok_s']:.2f}x")
    first = args.dtype[0]
    for dtype in args.dtype[1:] if args.async_scheduling == ["default"] else []:
        for tp in args.tensor_parallel_size:
            a, b = results[f"tandem tp={tp} {first}"], results[f"tandem tp={tp} {dtype}"]
            print(f"tandem tp={tp}: {dtype} / {first} = {b['tok_s'] / a['tok_s']:.2f}x")
    if len(args.tensor_parallel_size) > 1 and args.async_scheduling == ["default"]:
        tps = args.tensor_parallel_size
        for dtype in args.dtype:
            a, b = results[f"tandem tp={tps[0]} {dtype}"], results[f"tandem tp={tps[1]} {dtype}"]
            print(f"{dtype}: tp={tps[1]} / tp={tps[0]} = {b['tok_s'] / a['tok_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
