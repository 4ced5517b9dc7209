"""bench/gpu_profile.py: its timeline arithmetic on synthetic kernels, and a CPU smoke run."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_profile():
    spec = importlib.util.spec_from_file_location("bench_gpu_profile", ROOT / "bench" / "gpu_profile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_merge_intervals(gpu_profile):
    assert gpu_profile.merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (8, 9)]) == [(0, 4), (5, 7), (8, 9)]
    assert gpu_profile.merge_intervals([]) == []


def test_device_timeline_busy_share_and_gaps(gpu_profile):
    # Two overlapping kernels (streams), a gap of 10, one kernel sticking out of the window on each side.
    kernels = [(-5, 5), (10, 30), (20, 40), (50, 60), (95, 120)]
    tl = gpu_profile.device_timeline(kernels, (0, 100))
    assert tl.window == 100
    assert tl.busy == 5 + 30 + 10 + 5
    assert tl.gaps == [5, 10, 35]
    assert tl.busy_share == pytest.approx(0.5)


def test_top_by_name(gpu_profile):
    rows = gpu_profile.top_by_name([("a", 1.0), ("b", 5.0), ("a", 3.0), ("c", 0.5)], top=2)
    assert rows == [("b", 1, 5.0), ("a", 2, 4.0)]


def test_cpu_smoke_run(gpu_profile, capsys):
    assert gpu_profile.main(["--device", "cpu", "--batch", "2", "--prompt-len", "8", "--warmup", "1",
                             "--steps", "2", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "#### batch 2, prompt 8: 2 decode steps profiled, async scheduling off" in out
    assert "| wall time |" in out and "top CPU ops by self time" in out
    assert len(re.findall(r"^\| `\w+::", out, re.MULTILINE)) == 3  # aten:: and mkldnn:: (the packed linears)


def test_cpu_smoke_run_with_async_scheduling_on_and_off(gpu_profile, capsys):
    assert gpu_profile.main(["--device", "cpu", "--batch", "2", "--prompt-len", "8", "--warmup", "1",
                             "--steps", "2", "--top", "3", "--async-scheduling", "off", "on"]) == 0
    out = capsys.readouterr().out
    assert "profiled, async scheduling off" in out and "profiled, async scheduling on" in out
    assert out.count("| host time before the step's sync") == 1  # not a figure when steps overlap
