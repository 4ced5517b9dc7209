"""The CPU quota of the cgroup this process runs in (a Kubernetes CPU limit, `docker run --cpus`,
systemd's CPUQuota=), read the way the kernel applies it.

The kernel throttles a cgroup by its own quota and by every ancestor's, so the quota that binds is the
smallest on the path from the process's cgroup up to the hierarchy's root. Which cgroup that is comes
from /proc/self/cgroup (`0::/path` on the unified hierarchy, `N:cpu,cpuacct:/path` on v1's cpu
controller), and where that path lies in this process's file system from /proc/self/mountinfo (the
mount's root and mount point): inside a container with its own cgroup namespace the path is `/` and the
mount point is the container's cgroup; on a host, or a container without a namespace, the path names a
directory below the mount (reading the mount point alone would find the host root's "no quota").

Invariant: `cgroup_cpu_quota` returns None or a positive number of CPUs (quota / period), the smallest
of every level of every hierarchy found (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`);
anything unreadable or malformed counts as no quota at that level.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

_PROC_CGROUP = Path("/proc/self/cgroup")
_MOUNTINFO = Path("/proc/self/mountinfo")


def cgroup_cpu_quota(proc_cgroup: Path = _PROC_CGROUP, mountinfo: Path = _MOUNTINFO) -> float | None:
    """The CPUs this process's cgroup quotas allow (e.g. 2.5), or None without a quota."""
    try:
        memberships = _memberships(proc_cgroup.read_text())
        mounts = _cgroup_mounts(mountinfo.read_text())
    except OSError:
        return None
    quotas = []
    for hierarchy, (mount_root, mount_point) in mounts.items():
        path = memberships.get(hierarchy)
        if path is None:
            continue
        for directory in _levels(mount_point, mount_root, path):
            quota = _quota_v2(directory) if hierarchy == "v2" else _quota_v1(directory)
            if quota is not None:
                quotas.append(quota)
    return min(quotas) if quotas else None


def _memberships(text: str) -> dict[str, str]:
    """{"v2": path, "v1": path} from /proc/self/cgroup (v1: the hierarchy holding the cpu controller)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy_id, controllers, path = parts
        if hierarchy_id == "0" and controllers == "":
            found["v2"] = path
        elif "cpu" in controllers.split(","):
            found["v1"] = path
    return found


def _cgroup_mounts(text: str) -> dict[str, tuple[str, Path]]:
    """{"v2": (root, mount point), "v1": (root, mount point)} from /proc/self/mountinfo: the cgroup2 mount
    and the v1 mount that carries the cpu controller."""
    mounts: dict[str, tuple[str, Path]] = {}
    for line in text.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point = _unescape(fields[3]), Path(_unescape(fields[4]))
        if tail[0] == "cgroup2":
            mounts.setdefault("v2", (root, point))
        elif tail[0] == "cgroup" and "cpu" in tail[2].split(","):
            mounts.setdefault("v1", (root, point))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _levels(mount_point: Path, mount_root: str, path: str) -> list[Path]:
    """The directories from the process's cgroup up to the mount point, the cgroup first. A path outside
    the mount's root (another namespace's view) leaves the mount point alone."""
    cgroup, root = PurePosixPath(path), PurePosixPath(mount_root)
    if cgroup != root and root not in cgroup.parents:
        return [mount_point]
    relative = cgroup.relative_to(root)
    return [mount_point / level for level in (relative, *relative.parents)]


def _quota_v2(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _positive(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _quota_v1(directory: Path) -> float | None:
    try:
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        period_us = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return _positive(quota_us, period_us)


def _positive(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None
