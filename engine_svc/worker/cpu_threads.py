"""How many intra-op threads a CPU worker runs: one per core it may use, split between TP ranks, and fewer
while other processes hold some of those cores (`ThreadGovernor`).

"Cores it may use" is the process's CPU affinity mask (taskset, cpusets, NUMA binding), capped by a
cgroup CPU quota when there is one (read by cgroup_quota.py). A pod limited to 4 CPUs on a 64-core node
would otherwise start 64 threads, and every parallel op would wait on threads the quota has descheduled.
An explicit OMP_NUM_THREADS wins. Ranks of one engine divide the cores, so TP ranks on one host never
oversubscribe them.

`tandem serve` runs the frontend beside the engine on the same cores and still gives the engine all of
them: leaving a core to the frontend (as vLLM's CPU backend reserves one) served markedly fewer tokens
per second, since the frontend needs a small share of a core and the engine's GEMMs need every core.
Neither `OMP_WAIT_POLICY=PASSIVE` nor thread pinning (`OMP_PROC_BIND`/`OMP_PLACES`) is set, nor a lower
priority for `tandem serve`'s frontend: each measured worse or within noise (BENCHMARKS.md, "Served: step
sizes and threads" and "Where the served decode step goes").

A neighbour is another matter. An OpenMP team ends every parallel region at a barrier, so a team with a
thread on a core that another busy process shares waits, at every one of the hundreds of regions of a
step, for the scheduler to give that thread its turn: one spinning neighbour on one of two cores made
every step many times slower (BENCHMARKS.md, "The engine on shared cores"). `ThreadGovernor` therefore
follows the cores other processes leave free: every `GOVERNOR_INTERVAL_S` (looked at once per step) it
reads the busy time of the cores this process may run on (/proc/stat, steal included) and this process's
own CPU time (/proc/self/stat); the difference is what others used. The team is sized to the free cores
(others' share rounded, so a frontend's fraction of a core does not cost a thread), never more than the
static count and never less than one. TANDEM_CPU_THREAD_GOVERNOR=0 turns it off.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine_svc.worker.cgroup_quota import cgroup_cpu_quota


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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


GOVERNOR_INTERVAL_S = 0.5  # how often the governor samples who uses the cores
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat per-CPU: user nice system (idle iowait) irq softirq steal
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuSample:
    """Seconds of CPU time: busy on the watched cores (every process, steal included), and this process's."""

    at: float
    busy_s: float
    own_s: float


def read_cpu_sample(cpus: frozenset[int] | None = None, stat: Path = Path("/proc/stat"),
                    own: Path = Path("/proc/self/stat"), clock: Callable[[], float] = time.monotonic) -> CpuSample:
    """A sample of /proc: the busy time of `cpus` (default: the affinity mask) and this process's CPU time."""
    if cpus is None:
        cpus = _affinity_set()
    busy = 0
    for line in stat.read_text().splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *values = line.split()
        if int(name[3:]) in cpus:
            busy += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    fields = own.read_text().rsplit(")", 1)[1].split()
    own_ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the line)
    return CpuSample(clock(), busy / _CLOCK_TICKS, own_ticks / _CLOCK_TICKS)


def _affinity_set() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:
        return frozenset(range(os.cpu_count() or 1))


class ThreadGovernor:
    """The intra-op threads a CPU worker should run with now, following the cores others leave free.

    Invariant: `threads` is between 1 and `base` (the static count); with a core lent (a compile beside
    the step) it is one fewer, never below 1.
    """

    def __init__(self, base: int, world_size: int = 1, cpus: int | None = None,
                 sample: Callable[[], CpuSample] = read_cpu_sample,
                 interval_s: float = GOVERNOR_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.base = base
        self.world_size = world_size
        self.cpus = cpus if cpus is not None else _affinity_cpus()
        self.interval_s = interval_s
        self._sample = sample
        self._clock = clock
        self._last = sample()
        self.free_threads = base  # threads the free cores allow (before a lent core)

    def threads(self, lend: bool = False) -> int:
        return max(1, self.free_threads - 1) if lend else self.free_threads

    def observe(self) -> bool:
        """Sample if `interval_s` passed since the last sample; True when `free_threads` changed."""
        if self._clock() - self._last.at < self.interval_s:  # the usual call: one clock read
            return False
        now = self._sample()
        elapsed = now.at - self._last.at
        others = max(0.0, (now.busy_s - self._last.busy_s) - (now.own_s - self._last.own_s)) / elapsed
        self._last = now
        free = max(0.0, self.cpus - others) / self.world_size
        threads = min(self.base, max(1, math.floor(free + 0.5)))
        changed = threads != self.free_threads
        self.free_threads = threads
        return changed


def governor_enabled() -> bool:
    """False when TANDEM_CPU_THREAD_GOVERNOR=0 (or OMP_NUM_THREADS fixes the team)."""
    return os.environ.get("TANDEM_CPU_THREAD_GOVERNOR", "1") != "0" and not os.environ.get("OMP_NUM_THREADS")
