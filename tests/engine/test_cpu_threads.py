"""CPU workers run one intra-op thread per core they may use: affinity, cgroup quota, TP share."""

from __future__ import annotations

import pytest
import torch

from engine_svc.config import EngineConfig
from engine_svc.worker import cpu_threads
from engine_svc.worker.worker import Worker


def test_cgroup_quota_v2_v1_and_none(tmp_path) -> None:
    v2, v1 = tmp_path / "cpu.max", tmp_path / "v1"
    v1.mkdir()
    v2.write_text("250000 100000\n")
    assert cpu_threads.cgroup_cpu_quota(v2, v1) == 2.5
    v2.write_text("max 100000\n")
    assert cpu_threads.cgroup_cpu_quota(v2, v1) is None
    v2.unlink()
    (v1 / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_threads.cgroup_cpu_quota(v2, v1) == 4.0
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no quota"
    assert cpu_threads.cgroup_cpu_quota(v2, v1) is None


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
