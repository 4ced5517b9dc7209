"""CPU workers run one intra-op thread per core they may use: affinity, cgroup quota, TP share."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine_svc.config import EngineConfig
from engine_svc.worker import cpu_threads
from engine_svc.worker.worker import Worker


def test_threads_follow_affinity_quota_and_ranks(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "_affinity_cpus", lambda: 64)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: 2.5)  # a 2.5-CPU limit on a 64-core node
    assert cpu_threads.available_cpus() == 3
    assert cpu_threads.cpu_threads_for(1) == 3 and cpu_threads.cpu_threads_for(2) == 1
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: None)
    assert cpu_threads.cpu_threads_for(4) == 16
    assert cpu_threads.cpu_threads_for(128) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpu_threads.cpu_threads_for(1) is None  # the user's setting stands


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_cpu_worker_sets_its_threads(llama_dir, monkeypatch, restore_threads) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 3)
    Worker(EngineConfig.create(model=str(llama_dir), dtype="float32", device="cpu"))
    assert torch.get_num_threads() == 3
    Worker(EngineConfig.create(model=str(llama_dir), dtype="float32", device="cpu", tensor_parallel_size=2))
    assert torch.get_num_threads() == 1  # each of two ranks on three cores


# ---- the governor: fewer threads while other processes hold cores ----------------------------------------


class FakeProc:
    """/proc as the governor reads it: the watched cores' busy seconds and ours, advanced by `tick`."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0

    def tick(self, seconds: float, others: float, ours: float) -> None:
        """`seconds` pass with `others` cores kept busy by other processes and `ours` by this one."""
        self.now += seconds
        self.busy += seconds * (others + ours)
        self.own += seconds * ours

    def sample(self) -> Any:
        from engine_svc.worker.cpu_threads import CpuSample

        return CpuSample(self.now, self.busy, self.own)


def _governor(proc: FakeProc, base: int = 2, cpus: int = 2, world: int = 1) -> Any:
    from engine_svc.worker.cpu_threads import ThreadGovernor

    return ThreadGovernor(base, world, cpus=cpus, sample=proc.sample, clock=lambda: proc.now)


def test_a_spinning_neighbour_on_one_of_two_cores_leaves_one_thread() -> None:
    proc = FakeProc()
    governor = _governor(proc)
    proc.tick(1.0, others=1.0, ours=1.0)
    assert governor.observe() and governor.threads() == 1
    proc.tick(1.0, others=0.0, ours=2.0)  # the neighbour is gone
    assert governor.observe() and governor.threads() == 2


def test_a_frontend_s_share_of_a_core_does_not_cost_a_thread() -> None:
    proc = FakeProc()
    governor = _governor(proc)
    proc.tick(1.0, others=0.4, ours=1.6)
    assert not governor.observe() and governor.threads() == 2
    proc.tick(1.0, others=0.6, ours=1.4)
    assert governor.observe() and governor.threads() == 1


def test_the_governor_samples_at_most_every_interval_and_keeps_bounds() -> None:
    proc = FakeProc()
    governor = _governor(proc, base=4, cpus=8)
    proc.tick(0.1, others=8.0, ours=0.0)
    assert not governor.observe() and governor.threads() == 4  # too soon to tell
    proc.tick(0.5, others=8.0, ours=0.0)
    assert governor.observe() and governor.threads() == 1  # never fewer than one
    assert governor.threads(lend=True) == 1
    proc.tick(1.0, others=0.0, ours=4.0)
    assert governor.observe() and governor.threads() == 4  # never more than the static count
    assert governor.threads(lend=True) == 3


def test_tp_ranks_share_the_free_cores() -> None:
    proc = FakeProc()
    governor = _governor(proc, base=4, cpus=8, world=2)
    proc.tick(1.0, others=4.0, ours=4.0)
    assert governor.observe() and governor.threads() == 2


def test_the_real_proc_files_are_read(tmp_path: Path) -> None:
    from engine_svc.worker.cpu_threads import read_cpu_sample

    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 100 0 50 999 7 3 2 5 0 0\ncpu1 40 0 10 999 7 0 0 0 0 0\n")
    own = tmp_path / "self"
    own.write_text("123 (a name) with spaces) R 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20\n")
    sample = read_cpu_sample(frozenset({0}), stat=stat, own=own, clock=lambda: 5.0)
    ticks = __import__("os").sysconf("SC_CLK_TCK")
    assert sample.busy_s == (100 + 0 + 50 + 3 + 2 + 5) / ticks  # idle and iowait are not busy
    assert sample.own_s == (250 + 50) / ticks and sample.at == 5.0


def test_a_busy_neighbour_process_is_seen_on_this_machine() -> None:
    """The real /proc: a process spinning on one core is counted as another's work, not ours."""
    import subprocess
    import sys
    import time

    from engine_svc.worker.cpu_threads import read_cpu_sample

    cpus = frozenset(__import__("os").sched_getaffinity(0))
    before = read_cpu_sample(cpus)
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    try:
        time.sleep(1.0)
        after = read_cpu_sample(cpus)
    finally:
        spinner.wait(5)
    elapsed = after.at - before.at
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    assert others / elapsed > 0.6, f"a spinning neighbour used only {others / elapsed:.2f} cores"
    assert (after.own_s - before.own_s) / elapsed < 0.3  # this test process slept


STEP = SimpleNamespace(kv_loads=[], lora_loads=[], lora_drops=[])  # a step with nothing to do before it runs


def test_a_worker_runs_its_steps_with_the_governor_s_threads(llama_dir, monkeypatch, restore_threads) -> None:
    """The engine's worker asks its governor before every step and resizes torch's team when the free cores
    changed, a lent core taken off that (the governor is on by default; the suite turns it off elsewhere
    for repeatable numerics, tests/conftest.py)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("TANDEM_CPU_THREAD_GOVERNOR", "1")
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 2)
    worker = Worker(EngineConfig.create(model=str(llama_dir), dtype="float32", device="cpu"))
    assert worker.governor is not None and torch.get_num_threads() == 2
    proc = FakeProc()
    worker.governor = _governor(proc)
    seen: list[int] = []

    class Runner:  # what execute_model runs: here, only the team size it ran with
        def execute_model(self, so: Any) -> None:
            seen.append(torch.get_num_threads())

    worker.runner = Runner()  # type: ignore[assignment]
    worker.execute_model(STEP)  # type: ignore[arg-type]
    proc.tick(1.0, others=1.0, ours=1.0)  # a neighbour took a core
    worker.execute_model(STEP)  # type: ignore[arg-type]
    worker.lend_core(True)  # never below one
    worker.execute_model(STEP)  # type: ignore[arg-type]
    worker.lend_core(False)
    proc.tick(1.0, others=0.0, ours=2.0)  # it left
    worker.execute_model(STEP)  # type: ignore[arg-type]
    worker.lend_core(True)
    worker.execute_model(STEP)  # type: ignore[arg-type]
    assert seen == [2, 1, 1, 2, 1]
