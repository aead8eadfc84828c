"""Progress that keeps being written while one step runs long.

The job rewrites its progress file after each engine step; a step deep in
MLX or the expert kernel (a long prompt step, a machine near its memory
limit) would leave the file unchanged for minutes and ``mlx-tier status``
blind. A :class:`Heartbeat` thread rewrites the last snapshot every few
seconds with how long the step in progress has run, the process's resident
set, what its memory limit leaves, and whether a stop was asked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psutil

from mlx_tier.engine.limits import probe_limit

BEAT_SECONDS = 5.0


def memory_now() -> dict:
    """The process's resident set and what its memory limit leaves, in bytes."""
    limit = probe_limit()
    return {"rss_bytes": int(psutil.Process().memory_info().rss), "memory_available": limit.available,
            "memory_source": limit.source}


class Heartbeat:
    """A daemon thread, inside ``with``: every ``every`` seconds, when the main thread's
    last :meth:`step` is older than that, ``progress.beat`` gets ``busy_seconds`` (since
    that step), the memory figures (:func:`memory_now`) and ``stopping`` (``stopping()``).

    Args:
        progress: a :class:`~mlx_tier.outdir.jobdir.ProgressFile`.
        stopping: whether a stop was asked (read from the thread).
        every: seconds between beats.
    """

    def __init__(self, progress, stopping: Callable[[], bool], every: float = BEAT_SECONDS) -> None:
        self.progress, self.stopping, self.every = progress, stopping, every
        self._last_step = time.monotonic()
        self._done = threading.Event()

    def step(self) -> None:
        """The main thread finished a step (its progress was written)."""
        self._last_step = time.monotonic()

    def _run(self) -> None:
        while not self._done.wait(self.every):
            busy = time.monotonic() - self._last_step
            if busy >= self.every:
                self.progress.beat({"busy_seconds": round(busy, 1), "stopping": bool(self.stopping()),
                                    **memory_now()}, self.every)

    def __enter__(self) -> Heartbeat:
        threading.Thread(target=self._run, name="mlx-tier-heartbeat", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
