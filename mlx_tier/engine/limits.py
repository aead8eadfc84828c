"""The memory this process may use: its container's limit, not the host's size.

A process inside a Linux memory cgroup (a Docker or Kubernetes memory limit,
a systemd slice) is killed or stalled at the cgroup's limit whatever the host
has free; psutil reports the host. This module finds the limit that binds:

- cgroup v2: ``memory.max`` (the OOM killer acts there) and ``memory.high``
  (above it the kernel throttles the group by reclaiming hard: the stall a run
  must stay out of), the smaller of the two, in the process's group and every
  ancestor up to the mount point;
- cgroup v1: ``memory.limit_in_bytes`` of the memory controller's group and
  its ancestors (``use_hierarchy``);
- the groups come from ``/proc/self/cgroup``, their folders from
  ``/proc/self/mountinfo`` (so a container's own namespace view works).

What a group already uses is its usage less its file pages (``active_file``
and ``inactive_file`` in ``memory.stat``): under a limit the page cache fills
the group (a run reads its cold experts through it) and the kernel reclaims
clean file pages before anything is killed, so counting them as used would
leave a run that has read its checkpoint once no memory at all. What the process may still take is the smallest of the host's
available memory and, at every limited level, limit minus that level's use.
Elsewhere (macOS, no limit) it is the host's available memory as psutil reads
it (on macOS: free plus inactive pages, what the system reports available).

Plain Python (no MLX); :func:`probe_limit` is the only function that reads the
system, through paths a test can point at a fake tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from mlx_tier.units import GIB

# Limits at or above this many bytes mean "no limit" (v1 writes 2^63 rounded down to a page).
UNLIMITED = 1 << 60
PROC_SELF = Path("/proc/self")


@dataclass(frozen=True)
class CgroupLevel:
    """One limited memory cgroup on the way from the process's group to the root.

    Attributes:
        path: the group's folder.
        version: 1 or 2.
        limit: the binding limit in bytes (v2: the smaller of ``memory.max`` and ``memory.high``).
        limit_file: the file it came from (``memory.max``, ``memory.high``, ``memory.limit_in_bytes``).
        used: bytes the group holds now, less its file pages (page cache).
    """

    path: Path
    version: int
    limit: int
    limit_file: str
    used: int

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class MemoryLimit:
    """How much memory this process may use, and who says so. Bytes throughout.

    Attributes:
        total: what the process may hold in all: the smaller of the host's
            memory and the binding cgroup limit.
        available: what it may still take now (see the module doc).
        source: ``"host"`` or the cgroup file that binds, e.g.
            ``"cgroup v2 memory.max"``.
        where: the folder of the binding cgroup (``None`` for the host).
        host_total: host memory installed.
        host_available: host memory available (psutil).
    """

    total: int
    available: int
    source: str
    where: str | None
    host_total: int
    host_available: int

    @property
    def limited(self) -> bool:
        """Whether a cgroup limit, not the host, binds."""
        return self.source != "host"

    def describe(self) -> str:
        """One line for people: ``"cgroup v1 memory.limit_in_bytes: 2.00 GiB, 1.61 GiB available"``."""
        if not self.limited:
            return f"host: {self.total / GIB:.2f} GiB, {self.available / GIB:.2f} GiB available"
        return f"{self.source}: {self.total / GIB:.2f} GiB, {self.available / GIB:.2f} GiB available"


def _mounts(mountinfo: str) -> list[tuple[int, str, str, str]]:
    """``(version, controllers, mount root, mount point)`` of every cgroup mount in ``mountinfo``."""
    found = []
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        if tail[0] == "cgroup2":
            found.append((2, "", fields[3], fields[4]))
        elif tail[0] == "cgroup" and len(tail) >= 3:
            found.append((1, tail[2], fields[3], fields[4]))
    return found


def cgroup_dirs(proc_cgroup: str, mountinfo: str) -> list[tuple[int, Path, Path]]:
    """The memory cgroups of a process: ``(version, its folder, the mount point)``.

    Args:
        proc_cgroup: the text of ``/proc/<pid>/cgroup``.
        mountinfo: the text of ``/proc/<pid>/mountinfo``.

    Returns:
        the v1 memory controller's group and/or the v2 group (only where the
        v2 group has memory files: on a hybrid host v2 may not hold the memory
        controller); empty when none is mounted.
    """
    mounts = _mounts(mountinfo)
    out = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        version = 2 if parts[0] == "0" and parts[1] == "" else 1
        if version == 1 and "memory" not in parts[1].split(","):
            continue
        for v, controllers, root, point in mounts:
            if v == version and (v == 2 or "memory" in controllers.split(",")):
                rel = os.path.relpath(parts[2], root) if parts[2].startswith(root) else parts[2].lstrip("/")
                folder = Path(point) / ("" if rel == "." else rel)
                out.append((version, folder if folder.is_dir() else Path(point), Path(point)))
                break
    return out


def _read_int(path: Path) -> int | None:
    """An integer file's value; ``None`` for ``max``, a missing or unreadable file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in (path / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def read_level(path: Path, version: int) -> CgroupLevel | None:
    """The limit of one group, or ``None`` when it has none (or it cannot be read)."""
    if version == 2:
        limits = [(v, f) for f in ("memory.max", "memory.high") if (v := _read_int(path / f)) is not None]
        current, files = _read_int(path / "memory.current"), _stat(path, "active_file") + _stat(path, "inactive_file")
    else:
        limits = [(v, "memory.limit_in_bytes") for v in [_read_int(path / "memory.limit_in_bytes")] if v is not None]
        files = _stat(path, "total_active_file") + _stat(path, "total_inactive_file")
        current = _read_int(path / "memory.usage_in_bytes")
    limits = [(v, f) for v, f in limits if v < UNLIMITED]
    if not limits:
        return None
    limit, name = min(limits)
    used = max(0, (current or 0) - files)
    return CgroupLevel(path, version, limit, name, used)


def cgroup_levels(proc: Path = PROC_SELF) -> list[CgroupLevel]:
    """Every limited memory cgroup above the process (``proc``: ``/proc/self`` or a fake), innermost first."""
    try:
        dirs = cgroup_dirs((proc / "cgroup").read_text(), (proc / "mountinfo").read_text())
    except OSError:
        return []
    levels = []
    for version, folder, point in dirs:
        while True:
            level = read_level(folder, version)
            if level is not None:
                levels.append(level)
            if folder == point or folder.parent == folder:
                break
            folder = folder.parent
    return levels


def combine(levels: list[CgroupLevel], host_total: int, host_available: int) -> MemoryLimit:
    """The :class:`MemoryLimit` of the cgroup ``levels`` on a host with these figures (bytes):
    the tightest limit below the host's memory names the source; what is available is the
    least any level (or the host) has left."""
    available = min([host_available] + [level.free for level in levels])
    limited = [level for level in levels if level.limit < host_total]
    if not limited:
        return MemoryLimit(int(host_total), int(available), "host", None, int(host_total), int(host_available))
    tight = min(limited, key=lambda level: level.limit)
    return MemoryLimit(tight.limit, int(available), f"cgroup v{tight.version} {tight.limit_file}", str(tight.path),
                       int(host_total), int(host_available))


def probe_limit(proc: Path = PROC_SELF) -> MemoryLimit:
    """The memory this process may use now (:class:`MemoryLimit`), from its cgroups and psutil."""
    vm = psutil.virtual_memory()
    return combine(cgroup_levels(proc), int(vm.total), int(vm.available))
