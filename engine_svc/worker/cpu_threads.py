"""How many intra-op threads a CPU worker runs: one per core it may use, split between TP ranks.

"Cores it may use" is the process's CPU affinity mask (taskset, cpusets, NUMA binding), capped by a
cgroup CPU quota when there is one (a Kubernetes CPU limit: a pod limited to 4 CPUs on a 64-core node
would otherwise start 64 threads, and every parallel op would wait on threads the quota has descheduled).
An explicit OMP_NUM_THREADS wins. Ranks of one engine divide the cores, so TP ranks on one host never
oversubscribe them.

`tandem serve` runs the frontend beside the engine on the same cores and still gives the engine all of
them: leaving a core to the frontend (as vLLM's CPU backend reserves one) served markedly fewer tokens
per second, since the frontend needs a small share of a core and the engine's GEMMs need every core.
Neither `OMP_WAIT_POLICY=PASSIVE` nor thread pinning (`OMP_PROC_BIND`/`OMP_PLACES`) is set, nor a lower
priority for `tandem serve`'s frontend: each measured worse or within noise (BENCHMARKS.md, "Served: step
sizes and threads" and "Where the served decode step goes").
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = Path("/sys/fs/cgroup/cpu")


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cgroup_cpu_quota(v2_max: Path = _CGROUP_V2_MAX, v1_dir: Path = _CGROUP_V1) -> float | None:
    """The CPUs a cgroup quota allows (quota / period, e.g. 2.5), or None without a quota."""
    try:
        quota, period = v2_max.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((v1_dir / "cpu.cfs_quota_us").read_text())
        period_us = int((v1_dir / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def available_cpus() -> int:
    """Cores this process may run on: the affinity mask, capped by a cgroup quota (rounded up)."""
    cpus = _affinity_cpus()
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return cpus


def cpu_threads_for(world_size: int) -> int | None:
    """Intra-op threads for one of `world_size` ranks, or None when OMP_NUM_THREADS decides."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, available_cpus() // world_size)


def set_cpu_threads(world_size: int = 1) -> int:
    """Apply `cpu_threads_for(world_size)` to torch; returns the thread count torch now uses."""
    import torch

    threads = cpu_threads_for(world_size)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
