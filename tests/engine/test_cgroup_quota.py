"""The cgroup CPU quota that binds this process: its own cgroup's and every ancestor's, found through
/proc/self/cgroup and /proc/self/mountinfo (faked here as files over a fake cgroup tree)."""

from __future__ import annotations

from pathlib import Path

from engine_svc.worker.cgroup_quota import cgroup_cpu_quota

V1_CGROUP = "4:memory:/x\n3:cpu,cpuacct:{path}\n1:name=systemd:/\n0::/\n"
V2_CGROUP = "0::{path}\n"


def _mountinfo(tmp_path: Path, fstype: str, root: str, options: str) -> str:
    return (f"31 23 0:28 / {tmp_path}/tmpfs rw,relatime - tmpfs tmpfs rw,mode=755\n"
            f"32 31 0:29 {root} {tmp_path}/mnt rw,nosuid shared:9 - {fstype} {fstype} rw,{options}\n")


def _quota(tmp_path: Path, cgroup: str, mountinfo: str) -> float | None:
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mountinfo").write_text(mountinfo)
    return cgroup_cpu_quota(tmp_path / "cgroup", tmp_path / "mountinfo")


def _v1(directory: Path, quota_us: int, period_us: int = 100_000) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (directory / "cpu.cfs_period_us").write_text(f"{period_us}\n")


def _v2(directory: Path, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cpu.max").write_text(text)


def test_a_v1_host_cgroup_below_the_mount_is_the_one_read(tmp_path: Path) -> None:
    """The bug this module fixed: on a host (no cgroup namespace) the process's cgroup is a directory
    below /sys/fs/cgroup/cpu, whose root file says "no quota"."""
    mnt = tmp_path / "mnt"
    _v1(mnt, -1)
    _v1(mnt / "bench" / "tandem", 100_000)
    info = _mountinfo(tmp_path, "cgroup", "/", "cpu")
    assert _quota(tmp_path, V1_CGROUP.format(path="/bench/tandem"), info) == 1.0
    assert _quota(tmp_path, V1_CGROUP.format(path="/"), info) is None


def test_an_ancestors_quota_binds_when_it_is_the_smallest(tmp_path: Path) -> None:
    """A Kubernetes pod's limit sits on the pod's cgroup, its containers' below it."""
    mnt = tmp_path / "mnt"
    _v1(mnt, -1)
    _v1(mnt / "kubepods" / "pod1", 250_000)
    _v1(mnt / "kubepods" / "pod1" / "ctr", -1)
    info = _mountinfo(tmp_path, "cgroup", "/", "cpu,cpuacct")
    assert _quota(tmp_path, V1_CGROUP.format(path="/kubepods/pod1/ctr"), info) == 2.5
    _v1(mnt / "kubepods" / "pod1" / "ctr", 400_000)  # a container's own, looser than its pod's
    assert _quota(tmp_path, V1_CGROUP.format(path="/kubepods/pod1/ctr"), info) == 2.5
    _v1(mnt / "kubepods" / "pod1" / "ctr", 150_000, 100_000)
    assert _quota(tmp_path, V1_CGROUP.format(path="/kubepods/pod1/ctr"), info) == 1.5


def test_v2_reads_cpu_max_up_the_tree(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    _v2(mnt / "system.slice" / "tandem.service", "max 100000\n")
    _v2(mnt / "system.slice", "300000 100000\n")
    info = _mountinfo(tmp_path, "cgroup2", "/", "nsdelegate")
    assert _quota(tmp_path, V2_CGROUP.format(path="/system.slice/tandem.service"), info) == 3.0
    _v2(mnt / "system.slice", "max 100000\n")
    assert _quota(tmp_path, V2_CGROUP.format(path="/system.slice/tandem.service"), info) is None


def test_a_namespaced_container_reads_its_mount_point(tmp_path: Path) -> None:
    """With its own cgroup namespace a container sees `0::/` and its cgroup mounted at the mount point;
    without one (older Docker) it sees the host path, which is also the mount's root."""
    _v2(tmp_path / "mnt", "200000 100000\n")
    assert _quota(tmp_path, V2_CGROUP.format(path="/"), _mountinfo(tmp_path, "cgroup2", "/", "rw")) == 2.0
    docker = "/docker/abc123"
    info = _mountinfo(tmp_path, "cgroup", docker, "cpu")
    _v1(tmp_path / "mnt", 50_000)
    assert _quota(tmp_path, V1_CGROUP.format(path=docker), info) == 0.5


def test_no_cgroup_mount_or_unreadable_files_mean_no_quota(tmp_path: Path) -> None:
    assert _quota(tmp_path, V1_CGROUP.format(path="/a"), "") is None  # nothing mounted
    info = _mountinfo(tmp_path, "cgroup", "/", "memory")  # a v1 mount without the cpu controller
    assert _quota(tmp_path, V1_CGROUP.format(path="/a"), info) is None
    _v2(tmp_path / "mnt", "garbage\n")
    assert _quota(tmp_path, V2_CGROUP.format(path="/"), _mountinfo(tmp_path, "cgroup2", "/", "rw")) is None
    assert cgroup_cpu_quota(tmp_path / "missing", tmp_path / "missing") is None


def test_escaped_mount_points_are_decoded(tmp_path: Path) -> None:
    point = tmp_path / "cg root"
    _v2(point, "100000 100000\n")
    info = f"32 31 0:29 / {str(point).replace(' ', chr(92) + '040')} rw - cgroup2 cgroup2 rw\n"
    assert _quota(tmp_path, V2_CGROUP.format(path="/"), info) == 1.0
