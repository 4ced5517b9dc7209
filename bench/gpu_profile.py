"""Where a decode step's time goes, in one command: torch.profiler over steady decode steps.

    python bench/gpu_profile.py                       # CUDA: Qwen3-0.6B shapes, bf16, batch 1 and 64
    python bench/gpu_profile.py --batch 1 16 256 --prompt-len 512 --trace $OUT/trace.json
    TANDEM_FUSED_KERNELS=0 python bench/gpu_profile.py   # the same without the fused Triton kernels
    python bench/gpu_profile.py --device cpu          # CPU: a tiny model on the torch backend

For each batch size: `--batch` requests with `--prompt-len`-token prompts are prefilled, decoded for
`--warmup` steps, then `--steps` decode steps run under torch.profiler (each inside a "tandem.step"
range). Printed per batch size:

- per step: wall time, host time spent before the step's one sync (scheduling, input preparation and
  kernel launches: what async scheduling could hide), and on CUDA the GPU busy share of the wall time
  (union of kernel intervals) and the total idle gap between kernels (host overhead the GPU waits for),
  with the largest gaps;
- top kernels by device time (count per step, us per step, share of kernel time) on CUDA; top CPU ops
  by self time on CPU (there is no device timeline there);
- the decode step's bandwidth floor on CUDA (weights + KV read once at the measured HBM bandwidth).

`--trace PATH` also writes a Chrome trace (per batch size, suffixed) to open in Perfetto.

`--async-scheduling off on` profiles each mode on its own engine, one after the other. With async
scheduling the steps are not synchronised one by one (that would undo the overlap being measured): a
step's wall time is its `EngineCore.step()` call (which schedules step N+1 and returns step N's output),
the device is synchronised once after the last, and there is no "host time before the sync" (the host
waits for the device on the worker's event, not in a `tolist`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEP_RANGE = "tandem.step"


# ---- timeline analysis (pure: unit-tested on CPU) ---------------------------------------------
def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of [start, end) intervals, sorted and non-overlapping."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


@dataclass
class Timeline:
    """Device activity inside a window: busy time, and the idle gaps between kernels."""

    window: float
    busy: float
    gaps: list[float]  # idle stretches between device work inside the window (not the edges)

    @property
    def busy_share(self) -> float:
        return self.busy / self.window if self.window > 0 else 0.0


def device_timeline(kernels: list[tuple[float, float]], window: tuple[float, float]) -> Timeline:
    """Busy time and inner gaps of `kernels` (start, end) clipped to `window` (start, end)."""
    lo, hi = window
    clipped = [(max(s, lo), min(e, hi)) for s, e in kernels if e > lo and s < hi]
    merged = merge_intervals(clipped)
    busy = sum(e - s for s, e in merged)
    gaps = [b[0] - a[1] for a, b in pairwise(merged)]
    return Timeline(hi - lo, busy, gaps)


def top_by_name(events: list[tuple[str, float]], top: int) -> list[tuple[str, int, float]]:
    """(name, count, total) of the `top` names by total duration, largest first."""
    count: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for name, dur in events:
        count[name] += 1
        total[name] += dur
    return sorted(((n, count[n], total[n]) for n in total), key=lambda r: -r[2])[:top]


def short_name(name: str, width: int = 70) -> str:
    """Kernel names can be C++ template soup: keep the head."""
    name = name.replace("void ", "")
    return name if len(name) <= width else name[: width - 3] + "..."


# ---- running the engine -----------------------------------------------------------------------
def build_model(tmp: Path, args: argparse.Namespace) -> Path:
    if args.model == "qwen3-0.6b":
        from bench.gpu_e2e import build_model_dir

        return build_model_dir(tmp / "qwen3-0.6b-random", seed=0)
    from entrypoints.tiny_model import make_tiny_model

    return make_tiny_model(tmp / "tiny", arch="qwen3", seed=0, num_layers=4, hidden_size=256, num_heads=4,
                           num_kv_heads=2, head_dim=64, vocab_size=2048)


def make_engine(model_dir: Path, args: argparse.Namespace, max_num_seqs: int) -> Any:
    from engine_svc.config import EngineConfig
    from engine_svc.core import EngineCore

    config = EngineConfig.create(
        model=str(model_dir), dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        max_model_len=args.prompt_len + args.warmup + args.steps + 16, max_num_seqs=max_num_seqs,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_mode,
    )
    return EngineCore(config)


def add_requests(core: Any, batch: int, args: argparse.Namespace, first_id: int) -> None:
    from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

    vocab = core.vocab_size
    for i in range(batch):
        prompt = [(31 * (first_id + i) + 7 * j) % (vocab - 10) + 5 for j in range(args.prompt_len)]
        params = EngineSamplingParams(temperature=args.temperature, max_tokens=args.warmup + args.steps + 1,
                                      ignore_eos=True)
        core.add_request(EngineCoreRequest(request_id=str(first_id + i), prompt_token_ids=prompt,
                                           sampling_params=params))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class HostTimer:
    """Host time of each step up to its first device->host read (`Tensor.tolist` of sampled tokens):
    what the CPU spends before it has to wait for the GPU."""

    def __init__(self) -> None:
        self.first_sync: float | None = None
        self._orig = torch.Tensor.tolist

    def __enter__(self) -> HostTimer:
        timer = self

        def tolist(t: torch.Tensor) -> Any:
            if timer.first_sync is None and t.device.type != "cpu":
                timer.first_sync = time.perf_counter()
            return timer._orig(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.tolist = self._orig  # type: ignore[method-assign]


@dataclass
class StepTimes:
    wall: list[float]
    host: list[float]


def profile_batch(core: Any, batch: int, args: argparse.Namespace, first_id: int,
                  trace: Path | None) -> tuple[Any, StepTimes, tuple[float, float]]:
    """Prefill `batch` requests, warm up, then profile `args.steps` decode-only steps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    add_requests(core, batch, args, first_id)
    while len(core.scheduler.running) < batch or any(r.num_computed_tokens < args.prompt_len
                                                      for r in core.scheduler.running):
        core.step()
    for _ in range(args.warmup):
        core.step()
    _sync(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    times = StepTimes([], [])
    overlapped = core.config.resolved_async_scheduling
    with profile(activities=activities) as prof:
        t_start = time.perf_counter()
        for _ in range(args.steps):
            with HostTimer() as timer, record_function(STEP_RANGE):
                t0 = time.perf_counter()
                core.step()
                if not overlapped:
                    _sync(args.device)
                t1 = time.perf_counter()
            times.wall.append(t1 - t0)
            times.host.append((timer.first_sync or t1) - t0)
        _sync(args.device)
        t_end = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return prof, times, (t_start, t_end)


# ---- report -----------------------------------------------------------------------------------
def _events(prof: Any) -> list[Any]:
    return list(prof.events())


def _step_window(events: list[Any]) -> tuple[float, float] | None:
    """(start, end) in profiler microseconds spanning every profiled step range."""
    steps = [e for e in events if e.name == STEP_RANGE]
    if not steps:
        return None
    return min(e.time_range.start for e in steps), max(e.time_range.end for e in steps)


def _is_device_kernel(e: Any) -> bool:
    return getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start


def report(prof: Any, times: StepTimes, batch: int, args: argparse.Namespace, floor_ms: float | None) -> str:
    steps = len(times.wall)
    wall_ms = 1e3 * sum(times.wall) / steps
    host_ms = 1e3 * sum(times.host) / steps
    overlapped = getattr(args, "overlapped", False)
    title = (f"#### batch {batch}, prompt {args.prompt_len}: {steps} decode steps profiled, async scheduling "
             f"{'on' if overlapped else 'off'}")
    lines = [title, "", "| metric | per step |", "|---|---|", f"| wall time | {wall_ms:.3f} ms |"]
    if not overlapped:
        lines.append(f"| host time before the step's sync (schedule, inputs, launches) | {host_ms:.3f} ms "
                     f"({100 * host_ms / wall_ms:.0f}% of the step) |")
    events = _events(prof)
    window = _step_window(events)
    kernels = [e for e in events if _is_device_kernel(e)]
    if kernels and window is not None:
        tl = device_timeline([(e.time_range.start, e.time_range.end) for e in kernels], window)
        gaps = sorted(tl.gaps, reverse=True)
        lines += [
            f"| GPU busy (union of kernel intervals / wall) | {100 * tl.busy_share:.1f}% |",
            f"| GPU idle between kernels (CPU gap) | {tl.window / steps / 1e3 - tl.busy / steps / 1e3:.3f} ms "
            f"(inner gaps {sum(tl.gaps) / steps / 1e3:.3f} ms; largest: "
            + ", ".join(f"{g:.0f} us" for g in gaps[:5]) + ") |",
            f"| kernels per step | {len(kernels) / steps:.0f} |",
        ]
        if floor_ms is not None:
            lines.append(f"| bandwidth floor (weights + KV once) | {floor_ms:.3f} ms: step at "
                         f"{100 * floor_ms / wall_ms:.0f}% of the floor rate |")
        kernel_total = sum(e.time_range.end - e.time_range.start for e in kernels)
        lines += ["", "| kernel | calls/step | us/step | share of kernel time |", "|---|---|---|---|"]
        for name, count, total in top_by_name([(e.name, e.time_range.end - e.time_range.start)
                                               for e in kernels], args.top):
            lines.append(f"| `{short_name(name)}` | {count / steps:.1f} | {total / steps:.1f} | "
                         f"{100 * total / kernel_total:.1f}% |")
    else:
        averages = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
        in_ops = sum(a.self_cpu_time_total for a in averages if a.key != STEP_RANGE) / steps / 1e3
        lines += [f"| in torch ops / outside them (Python: scheduling, inputs, sampling set-up, outputs) | "
                  f"{in_ops:.3f} ms / {wall_ms - in_ops:.3f} ms |",
                  "", "No device timeline (CPU run): top CPU ops by self time.", "",
                  "| op | calls/step | self us/step | share of step |", "|---|---|---|---|"]
        for a in [a for a in averages if a.key != STEP_RANGE][: args.top]:
            lines.append(f"| `{short_name(a.key)}` | {a.count / steps:.1f} | {a.self_cpu_time_total / steps:.1f} | "
                         f"{100 * a.self_cpu_time_total / steps / (1e3 * wall_ms):.1f}% |")
    return "\n".join(lines)


def decode_floor_ms(core: Any, batch: int, context: int, bandwidth: float) -> float:
    worker = core.executor.worker
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    kv_bytes = batch * context * worker.kv_block_bytes // core.config.block_size
    return 1e3 * (weight_bytes + kv_bytes) / bandwidth


def profile_engine(model_dir: Path, args: argparse.Namespace, bandwidth: float | None, fused: bool) -> None:
    """Build an engine (with `args.async_mode`) and print the profile of each batch size."""
    core = make_engine(model_dir, args, max_num_seqs=max(args.batch))
    args.overlapped = core.config.resolved_async_scheduling
    worker = core.executor.worker
    print(f"model {args.model} ({args.dtype}), {core.config.resolved_attention_backend} attention, "
          f"fused kernels {'on' if getattr(worker.model, 'fused_kernels', False) and fused else 'off'}, "
          f"CUDA graphs {'on' if worker.runner.cuda_graphs is not None else 'off'}, async scheduling "
          f"{'on' if core.config.resolved_async_scheduling else 'off'}"
          + (f", HBM {bandwidth / 1e9:,.0f} GB/s" if bandwidth else "") + "\n")
    next_id = 0
    try:
        for batch in args.batch:
            trace = None
            if args.trace is not None:
                suffix = "" if args.async_mode is None else f".async-{'on' if args.overlapped else 'off'}"
                trace = args.trace.with_suffix(f"{suffix}.b{batch}.json")
            prof, times, _ = profile_batch(core, batch, args, next_id, trace)
            next_id += batch
            context = args.prompt_len + args.warmup + args.steps // 2
            floor = decode_floor_ms(core, batch, context, bandwidth) if bandwidth else None
            print(report(prof, times, batch, args, floor) + "\n", flush=True)
    finally:
        core.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Run the profile; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default=None, choices=("qwen3-0.6b", "tiny"),
                    help="default: qwen3-0.6b on CUDA, tiny on CPU")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"))
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default: 1 64 on CUDA, 8 on CPU")
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 512 on CUDA, 64 on CPU")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="profiled decode steps (default: 32 CUDA, 4 CPU)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--trace", type=Path, default=None, help="write Chrome traces PATH.b<batch>.json")
    ap.add_argument("--async-scheduling", nargs="+", choices=("default", "off", "on"), default=["default"],
                    help="tandem's --async-scheduling; several modes are profiled one after the other")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda but CUDA is not available; use --device cpu", file=sys.stderr)
        return 2
    args.model = args.model or ("qwen3-0.6b" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.batch = args.batch or ([1, 64] if cuda else [8])
    args.prompt_len = args.prompt_len or (512 if cuda else 64)
    args.steps = args.steps or (32 if cuda else 4)

    device_name = torch.cuda.get_device_name() if cuda else "CPU"
    bandwidth = None
    if cuda:
        from bench.gpu_e2e import measure_hbm_bandwidth

        bandwidth = measure_hbm_bandwidth()
    fused = os.environ.get("TANDEM_FUSED_KERNELS", "1") != "0"
    print(f"### gpu_profile: {device_name}, {datetime.date.today().isoformat()}, torch {torch.__version__}\n")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp), args)
        for mode in args.async_scheduling:
            args.async_mode = {"default": None, "off": False, "on": True}[mode]
            profile_engine(model_dir, args, bandwidth, fused)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
