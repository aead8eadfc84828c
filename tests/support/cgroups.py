"""A memory cgroup with a hard limit for a test (or a bench) to run a process in.

Created as a child of this process's own memory cgroup (v1: the memory
controller's group, ``memory.limit_in_bytes`` and, when present,
``memory.memsw.limit_in_bytes`` so no swap either; v2: ``memory.max`` and
``memory.swap.max``, when the parent lets its children use the memory
controller), removed on exit. :func:`why_not` says why none can be made here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mlx_tier.engine.limits import PROC_SELF, cgroup_dirs


def _own_groups() -> list[tuple[int, Path, Path]]:
    try:
        return cgroup_dirs((PROC_SELF / "cgroup").read_text(), (PROC_SELF / "mountinfo").read_text())
    except OSError:
        return []


def _usable(version: int, folder: Path) -> bool:
    if version == 1:
        return (folder / "memory.limit_in_bytes").exists() and os.access(folder, os.W_OK)
    controls = (folder / "cgroup.subtree_control")
    return controls.exists() and "memory" in controls.read_text().split() and os.access(folder, os.W_OK)


def why_not() -> str | None:
    """``None`` when a memory cgroup can be made here, else the reason."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "creating a memory cgroup needs root"
    groups = _own_groups()
    if not groups:
        return "no cgroup memory controller is mounted (not Linux, or a container without cgroupfs)"
    if not any(_usable(v, folder) for v, folder, _ in groups):
        return "this process's memory cgroup is not writable (or v2 without the memory controller for its children)"
    return None


class MemoryCgroup:
    """A child memory cgroup limited to ``limit_bytes``; ``with`` creates and removes it.

    Raises:
        OSError: none can be made (:func:`why_not`).
    """

    def __init__(self, limit_bytes: int, name: str) -> None:
        version, folder, _ = next((g for g in _own_groups() if _usable(g[0], g[1])), (0, Path("/"), None))
        if not version:
            raise OSError(why_not() or "no usable memory cgroup")
        self.version, self.parent, self.path, self.limit = version, folder, folder / name, limit_bytes

    def __enter__(self) -> MemoryCgroup:
        self.path.mkdir()
        try:
            if self.version == 1:
                self._write("memory.limit_in_bytes", self.limit)
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    self._write("memory.memsw.limit_in_bytes", self.limit)
            else:
                self._write("memory.max", self.limit)
                if (self.path / "memory.swap.max").exists():
                    self._write("memory.swap.max", 0)
        except OSError:
            self.path.rmdir()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for _ in range(50):  # processes still inside go back to the parent first
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    (self.parent / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)

    def _write(self, name: str, value) -> None:
        (self.path / name).write_text(f"{value}\n")

    @property
    def limit_file(self) -> str:
        """The limit's source as :mod:`mlx_tier.engine.limits` names it."""
        return "cgroup v1 memory.limit_in_bytes" if self.version == 1 else "cgroup v2 memory.max"

    def oom_kills(self) -> int:
        """Processes of the group the OOM killer ended."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in (self.path / name).read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def peak(self) -> int | None:
        """The group's peak charge in bytes (page cache included), where the kernel keeps one."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError):
            return None

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started inside the group from its first instruction."""
        procs = self.path / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *cmd]
