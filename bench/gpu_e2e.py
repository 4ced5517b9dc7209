"""End-to-end generation throughput on one GPU: tandem vs Hugging Face generate(), against a bandwidth floor.

Model: random weights with Qwen3-0.6B's shapes (28 layers, hidden 1024, 16 query / 8 KV heads, head_dim
128, intermediate 3072, vocab 151936, tied embeddings), built with transformers' Qwen3Config and saved
with save_pretrained in bfloat16. Nothing can be downloaded, so the directory borrows a small tokenizer
from `entrypoints.tiny_model`; the engine needs token ids only, and every prompt id is < 10001, far
below the model's vocabulary (ids the tokenizer lacks would simply decode to nothing).

Workload: nano-vllm's bench.py. 256 sequences, prompt and output lengths uniform in [100, 1024], prompt
ids uniform in [0, 10000], Python `random` seeded with 0 (prompts drawn first, then output lengths),
ignore_eos, temperature 0.6. All requests are queued at once; output tokens / wall time is reported.

Also measured:
- HBM bandwidth: a large device-to-device copy (bytes read + bytes written per second);
- the bandwidth floor of the decode-only steps: sum over those steps of (weight bytes + KV bytes that
  step's attention must read) / bandwidth, and the fraction of it achieved (floor / measured time);
- batch-1 decode TPOT (one request alone, 512-token prompt, 256 outputs) against the same floor;
- HF generate() on the same GPU and workload, the way vLLM's `benchmark_throughput --backend hf` runs
  it: static batches in input order, left padding, max_new_tokens = the batch's longest requested
  output (min_new_tokens too, so EOS cannot end it early), output tokens counted as requested.

Prints a markdown block ready to paste into BENCHMARKS.md. Needs a CUDA GPU; on a machine without one
it says so and exits with status 2 (use bench/offline.py there).

`--async-scheduling off on` runs tandem once per mode in the same process (one model, one bandwidth
measurement) and prints each mode's table and their ratio. A step's time is the wall time of the
`EngineCore.step()` call that returned its output: with async scheduling that call also scheduled the
next step, and in steady state it lasts one device step.

    python bench/gpu_e2e.py [--num-seqs 256] [--enforce-eager] [--skip-hf] [--hf-batch-size 64]
    python bench/gpu_e2e.py --skip-hf --async-scheduling off on
"""

from __future__ import annotations

import argparse
import datetime
import gc
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_0_6B_SHAPES: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_PROMPT_ID = 10000
TEMPERATURE = 0.6


# ---- model and workload -----------------------------------------------------------------------
def build_model_dir(out: Path, seed: int, **shape_overrides: Any) -> Path:
    """A bf16 random-weight Qwen3 model directory (Qwen3-0.6B shapes unless overridden) + tokenizer."""
    import transformers

    from entrypoints.tiny_model import make_tiny_model

    shapes = {**QWEN3_0_6B_SHAPES, **shape_overrides}
    config = transformers.Qwen3Config(
        **shapes,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    tokenizer_src = make_tiny_model(out / "_tokenizer_src", arch="qwen3", seed=seed)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_src / name, out / name)
    shutil.rmtree(tokenizer_src)
    return out


def nano_vllm_workload(num_seqs: int, seed: int = 0, lo: int = 100, hi: int = 1024) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs drawn exactly as nano-vllm's bench.py draws them."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, MAX_PROMPT_ID) for _ in range(rng.randint(lo, hi))] for _ in range(num_seqs)]
    output_lens = [rng.randint(lo, hi) for _ in range(num_seqs)]
    return list(zip(prompts, output_lens))


# ---- measurements -----------------------------------------------------------------------------
def measure_hbm_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes per second moved by a device-to-device copy (each byte counted read and written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


@dataclass
class StepStat:
    decode_only: bool
    num_reqs: int
    context_tokens: int  # sum of seq_lens: K/V tokens the step's attention reads
    seconds: float = 0.0


@dataclass
class TandemRun:
    tokens: int
    elapsed: float
    steps: list[StepStat] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.elapsed


class Engine:
    """tandem's in-process EngineCore plus per-step instrumentation (TP = 1)."""

    def __init__(self, model_dir: Path, *, device: str, enforce_eager: bool, max_num_seqs: int,
                 max_model_len: int, async_scheduling: bool | None = None) -> None:
        from engine_svc.config import EngineConfig
        from engine_svc.core import EngineCore

        config = EngineConfig.create(
            model=str(model_dir), dtype="bfloat16", device=device, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=16384, enforce_eager=enforce_eager,
            async_scheduling=async_scheduling,
        )
        self.core = EngineCore(config)
        self.async_scheduling = config.resolved_async_scheduling
        worker = self.core.executor.worker  # type: ignore[attr-defined]
        self.graphs_on = worker.runner.cuda_graphs is not None
        self.attention_backend = config.resolved_attention_backend
        self.weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
        self.kv_bytes_per_token = worker.kv_block_bytes // config.block_size
        self._stats: list[StepStat] = []
        self._wrap_prepare(worker.runner.batch)
        self._num_updated = 0  # non-empty steps whose output the scheduler has taken, in order
        self._wrap_update()
        self._next_id = 0

    def _wrap_update(self) -> None:
        inner = self.core.scheduler.update_from_output

        def update(so: Any, out: Any) -> Any:
            if so.total_num_scheduled_tokens:
                self._num_updated += 1
            return inner(so, out)

        self.core.scheduler.update_from_output = update

    def _wrap_prepare(self, batch: Any) -> None:
        inner = batch.prepare

        def prepare(num_scheduled: dict[str, int]) -> Any:
            inputs = inner(num_scheduled)
            self._stats.append(StepStat(inputs.num_decodes == len(inputs.req_ids), len(inputs.req_ids),
                                        int(inputs.seq_lens.sum())))
            return inputs

        batch.prepare = prepare

    def run(self, work: list[tuple[list[int], int]], temperature: float) -> TandemRun:
        """Queue every request, step until all finish; time each step that ran the model."""
        from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

        for prompt, max_tokens in work:
            params = EngineSamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
            self.core.add_request(EngineCoreRequest(request_id=str(self._next_id), prompt_token_ids=prompt,
                                                    sampling_params=params))
            self._next_id += 1
        self._stats = []
        tokens = 0
        start = time.perf_counter()
        self._num_updated = 0
        while self.core.has_unfinished_requests():
            num_before = self._num_updated
            t = time.perf_counter()
            outputs = self.core.step()
            seconds = time.perf_counter() - t
            if self._num_updated > num_before:  # the call that returned that step's output (stats: run order)
                self._stats[self._num_updated - 1].seconds = seconds
            for out in outputs.outputs:
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error.message}")
                tokens += len(out.new_token_ids)
        elapsed = time.perf_counter() - start
        expected = sum(n for _, n in work)
        if tokens != expected:
            raise RuntimeError(f"tandem produced {tokens} tokens, {expected} were asked for")
        return TandemRun(tokens, elapsed, self._stats)

    def floor_seconds(self, steps: list[StepStat], bandwidth: float) -> float:
        """Bandwidth floor of these steps: each reads every weight once and its requests' whole KV."""
        return sum(self.weight_bytes + s.context_tokens * self.kv_bytes_per_token for s in steps) / bandwidth

    def shutdown(self) -> None:
        self.core.shutdown()


def run_tandem(model_dir: Path, work: list[tuple[list[int], int]], args: argparse.Namespace,
               bandwidth: float | None, device: str = "cuda", async_scheduling: bool | None = None) -> dict[str, Any]:
    engine = Engine(model_dir, device=device, enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
                    max_model_len=args.max_model_len, async_scheduling=async_scheduling)
    try:
        warmup = nano_vllm_workload(16, seed=args.seed + 1, lo=16, hi=128)
        engine.run(warmup, TEMPERATURE)  # compiles the Triton kernel variants of mixed and decode steps
        main_run = engine.run(work, TEMPERATURE)
        rng = random.Random(args.seed + 2)
        single = engine.run([([rng.randint(0, MAX_PROMPT_ID) for _ in range(512)], 256)], 0.0)
    finally:
        engine.shutdown()
    decode = [s for s in main_run.steps if s.decode_only]
    single_decode = [s for s in single.steps if s.decode_only]
    result: dict[str, Any] = {
        "tok_s": main_run.tok_s, "tokens": main_run.tokens, "elapsed": main_run.elapsed,
        "steps": len(main_run.steps), "decode_steps": len(decode),
        "decode_seconds": sum(s.seconds for s in decode),
        "tpot": sum(s.seconds for s in single_decode) / max(1, len(single_decode)),
        "graphs_on": engine.graphs_on, "attention_backend": engine.attention_backend,
        "weight_bytes": engine.weight_bytes, "async_scheduling": engine.async_scheduling,
    }
    if bandwidth is not None:
        result["decode_floor"] = engine.floor_seconds(decode, bandwidth)
        result["all_floor"] = engine.floor_seconds(main_run.steps, bandwidth)
        result["tpot_floor"] = engine.floor_seconds(single_decode, bandwidth) / max(1, len(single_decode))
    return result


def run_hf(model_dir: Path, work: list[tuple[list[int], int]], batch_size: int, device: str = "cuda") -> dict[str, Any]:
    """HF generate() in static batches (input order, left padding), sampling at TEMPERATURE."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    pad = model.config.pad_token_id
    counted = 0
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i : i + batch_size]
        longest = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        max_new = max(n for _, n in batch)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=TEMPERATURE,
                           top_k=0, top_p=1.0, max_new_tokens=max_new, min_new_tokens=max_new,
                           pad_token_id=pad, use_cache=True)
        counted += sum(n for _, n in batch)
    elapsed = time.perf_counter() - start
    del model
    return {"tok_s": counted / elapsed, "tokens": counted, "elapsed": elapsed}


# ---- report -----------------------------------------------------------------------------------
def _pct(floor: float, measured: float) -> str:
    return f"{100 * floor / measured:.0f}%" if measured > 0 else "n/a"


def markdown_report(device_name: str, args: argparse.Namespace, t: dict[str, Any], hf: dict[str, Any] | None,
                    bandwidth: float | None) -> str:
    mode = "CUDA graphs for decode" if t["graphs_on"] else "eager (no CUDA graphs)"
    mode += ", async scheduling " + ("on" if t["async_scheduling"] else "off")
    lines = [
        f"### gpu_e2e: {device_name}, {datetime.date.today().isoformat()}",
        "",
        f"Random-weight Qwen3-0.6B shapes, bf16 ({t['weight_bytes'] / 1e9:.2f} GB of weights); "
        f"{args.num_seqs} seqs, prompt and output lengths U[100, 1024] (nano-vllm workload, seed {args.seed}), "
        f"ignore_eos, temperature {TEMPERATURE}; tandem {mode}, {t['attention_backend']} attention; "
        f"torch {torch.__version__}.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| tandem output throughput | {t['tok_s']:,.0f} tok/s ({t['tokens']:,} tokens in {t['elapsed']:.1f} s, "
        f"{t['steps']:,} steps) |",
    ]
    if hf is not None:
        lines.append(f"| HF generate() output throughput (static batches of {args.hf_batch_size}, left padding) "
                     f"| {hf['tok_s']:,.0f} tok/s ({hf['elapsed']:.1f} s) |")
        lines.append(f"| tandem / HF | {t['tok_s'] / hf['tok_s']:.1f}x |")
    if bandwidth is not None:
        lines += [
            f"| HBM bandwidth (device-to-device copy, read + write) | {bandwidth / 1e9:,.0f} GB/s |",
            f"| decode-only steps: time vs bandwidth floor | {t['decode_seconds']:.2f} s vs {t['decode_floor']:.2f} s "
            f"over {t['decode_steps']:,} steps: {_pct(t['decode_floor'], t['decode_seconds'])} of the floor rate |",
            f"| all steps: elapsed vs bandwidth floor (prefill compute not counted) | {t['elapsed']:.2f} s vs "
            f"{t['all_floor']:.2f} s: {_pct(t['all_floor'], t['elapsed'])} |",
            f"| batch-1 decode TPOT (512-token prompt) vs floor | {1e3 * t['tpot']:.2f} ms vs "
            f"{1e3 * t['tpot_floor']:.2f} ms: {_pct(t['tpot_floor'], t['tpot'])} |",
        ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true", help="tandem without CUDA graphs")
    ap.add_argument("--skip-hf", action="store_true", help="do not run the HF generate() baseline")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-scheduling", nargs="+", choices=("default", "off", "on"), default=["default"],
                    help="tandem's --async-scheduling; several modes run one after the other")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_e2e.py needs a CUDA GPU and torch.cuda.is_available() is False here: nothing was "
              "measured. On CPU, run bench/offline.py instead.", file=sys.stderr)
        return 2

    device_name = torch.cuda.get_device_name()
    print(f"device: {device_name}; measuring HBM bandwidth ...", flush=True)
    bandwidth = measure_hbm_bandwidth()
    work = nano_vllm_workload(args.num_seqs, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        print("building the random-weight Qwen3-0.6B-shaped model ...", flush=True)
        model_dir = build_model_dir(Path(tmp) / "qwen3-0.6b-random", args.seed)
        runs = {}
        for mode in args.async_scheduling:
            print(f"running tandem (async scheduling {mode}) ...", flush=True)
            flag = {"default": None, "off": False, "on": True}[mode]
            runs[mode] = run_tandem(model_dir, work, args, bandwidth, async_scheduling=flag)
            gc.collect()
            torch.cuda.empty_cache()
        hf = None
        if not args.skip_hf:
            print("running HF generate() ...", flush=True)
            try:
                hf = run_hf(model_dir, work, args.hf_batch_size)
            except torch.cuda.OutOfMemoryError as exc:
                print(f"HF generate() ran out of memory ({exc}); try a smaller --hf-batch-size", file=sys.stderr)
    for tandem in runs.values():
        print()
        print(markdown_report(device_name, args, tandem, hf, bandwidth))
    if {"off", "on"} <= set(runs):
        off, on = runs["off"], runs["on"]
        print(f"\nasync scheduling on / off: throughput {on['tok_s'] / off['tok_s']:.3f}x, decode-step time "
              f"{on['decode_seconds'] / max(on['decode_steps'], 1) * 1e3:.3f} vs "
              f"{off['decode_seconds'] / max(off['decode_steps'], 1) * 1e3:.3f} ms, batch-1 TPOT "
              f"{on['tpot'] * 1e3:.3f} vs {off['tpot'] * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
