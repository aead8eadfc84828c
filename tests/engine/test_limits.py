"""The memory a process may use is its cgroup's limit (v1 or v2, at any level above it)
when that is below the host's, less what the group already holds; the host's
available memory otherwise. Fake ``/proc/self`` and cgroup trees stand in for
the system; a real group is exercised in tests/job/test_memory_limit.py."""

from __future__ import annotations

from pathlib import Path

from mlx_tier.engine.limits import CgroupLevel, cgroup_dirs, cgroup_levels, combine

GIB = 2**30
HOST = dict(host_total=24 * GIB, host_available=20 * GIB)


def fake_proc(tmp_path: Path, cgroup: str, mounts: list[str]) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("\n".join(mounts) + "\n")
    return proc


def group(folder: Path, **files) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (folder / name.replace("__", ".")).write_text(f"{value}\n")
    return folder


def v2_mount(point: Path, root: str = "/") -> str:
    return f"30 25 0:26 {root} {point} rw,nosuid - cgroup2 cgroup2 rw"


def v1_mount(point: Path, root: str = "/") -> str:
    return f"35 25 0:31 {root} {point} rw,relatime - cgroup cgroup rw,memory"


def test_cgroup_v2_memory_high_below_max_binds(tmp_path):
    point = tmp_path / "cg2"
    group(point, memory__max="max")
    job = group(point / "user.slice" / "job", memory__max=4 * GIB, memory__high=3 * GIB,
                memory__current=GIB, memory__stat=f"anon 100\nactive_file {GIB // 4}\ninactive_file {GIB // 4}\n")
    proc = fake_proc(tmp_path, "0::/user.slice/job\n", [v2_mount(point)])
    (level,) = cgroup_levels(proc)
    assert level == CgroupLevel(job, 2, 3 * GIB, "memory.high", GIB // 2)  # page cache: reclaimable, not used
    limit = combine([level], **HOST)
    assert (limit.total, limit.available, limit.source) == (3 * GIB, 3 * GIB - GIB // 2, "cgroup v2 memory.high")
    assert limit.limited and "cgroup v2 memory.high: 3.00 GiB, 2.50 GiB available" == limit.describe()


def test_cgroup_v1_limit_of_a_parent_binds_a_child_without_one(tmp_path):
    point = tmp_path / "memory"
    group(point, memory__limit_in_bytes=9223372036854771712)  # v1's "no limit"
    parent = group(point / "jobs", memory__limit_in_bytes=2 * GIB, memory__usage_in_bytes=GIB,
                   memory__stat=f"cache 5\ntotal_active_file {GIB // 8}\ntotal_inactive_file {GIB // 8}\n")
    group(parent / "one", memory__limit_in_bytes=9223372036854771712, memory__usage_in_bytes=GIB)
    proc = fake_proc(tmp_path, "5:cpu:/\n4:memory:/jobs/one\n0::/\n", [v1_mount(point)])
    limit = combine(cgroup_levels(proc), **HOST)
    assert limit.source == "cgroup v1 memory.limit_in_bytes" and limit.where == str(parent)
    assert (limit.total, limit.available) == (2 * GIB, 2 * GIB - 3 * GIB // 4)


def test_hybrid_host_reads_the_v1_memory_controller_only(tmp_path):
    v1, v2 = tmp_path / "memory", tmp_path / "unified"
    group(v1 / "a", memory__limit_in_bytes=GIB, memory__usage_in_bytes=0)
    group(v2)  # cgroup2 mounted without the memory controller: no memory files
    proc = fake_proc(tmp_path, "4:memory:/a\n0::/\n", [v1_mount(v1), v2_mount(v2)])
    assert [d[0] for d in cgroup_dirs((proc / "cgroup").read_text(), (proc / "mountinfo").read_text())] == [1, 2]
    assert combine(cgroup_levels(proc), **HOST).total == GIB


def test_a_containers_own_namespace_view(tmp_path):
    """Inside a container the group's path may be the mount's own root: its folder is the mount point."""
    point = group(tmp_path / "cg", memory__max=GIB, memory__current=GIB // 8)
    proc = fake_proc(tmp_path, "0::/docker/abc\n", [v2_mount(point, root="/docker/abc")])
    limit = combine(cgroup_levels(proc), **HOST)
    assert (limit.total, limit.available, limit.where) == (GIB, GIB - GIB // 8, str(point))


def test_no_cgroup_or_a_limit_above_the_host_means_the_host(tmp_path):
    assert combine(cgroup_levels(tmp_path / "missing"), **HOST).source == "host"
    point = group(tmp_path / "cg", memory__max=64 * GIB, memory__current=0)
    proc = fake_proc(tmp_path, "0::/\n", [v2_mount(point)])
    limit = combine(cgroup_levels(proc), **HOST)
    assert (limit.source, limit.total, limit.available) == ("host", 24 * GIB, 20 * GIB)
    assert limit.describe() == "host: 24.00 GiB, 20.00 GiB available"


def test_host_shorter_than_the_group_still_bounds_what_is_available(tmp_path):
    level = CgroupLevel(tmp_path, 2, 16 * GIB, "memory.max", GIB)
    limit = combine([level], host_total=24 * GIB, host_available=5 * GIB)
    assert (limit.total, limit.available, limit.source) == (16 * GIB, 5 * GIB, "cgroup v2 memory.max")
