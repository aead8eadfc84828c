"""Page-cache helpers shared by the benches: drop a checkpoint's pages, say how.

Not a bench itself. ``drop_pages`` is what "cold" means in every bench here.
"""

from __future__ import annotations

import os
from pathlib import Path


def drop_pages(files: list[Path], global_drop: bool = False) -> str:
    """Evict ``files`` from the OS page cache; returns the method used, for the caliber.

    Args:
        files: the checkpoint's shards.
        global_drop: first try ``echo 1 > /proc/sys/vm/drop_caches`` (root,
            Linux; drops every clean page of the machine, so other users'
            caches too). ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file
            always follows, after an ``fsync`` of the file (DONTNEED drops clean
            pages only; pages still mapped stay).

    Returns:
        ``"drop_caches+fadvise"`` or ``"fadvise"``.
    """
    method = "fadvise"
    if global_drop:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            method = "drop_caches+fadvise"
        except OSError:
            pass
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # a file just written has dirty pages, which DONTNEED leaves in the cache
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return method
