"""Process hygiene for long jobs: keep a Mac awake, lower CPU priority.

Known traps (docs/architecture.md, "Thermal-aware throttle"): macOS background QoS
(``taskpolicy -b``) was reported to throttle Metal decode ~8x, so
:func:`lower_priority` uses ``nice`` unless asked otherwise; Macs sleep
mid-run unless an assertion is held (:func:`keep_awake`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

from mlx_tier import defaults
from mlx_tier.job.sensors import run_text


@contextlib.contextmanager
def keep_awake(spawn: Callable[[list[str]], subprocess.Popen] = subprocess.Popen, platform: str = sys.platform,
               pid: int | None = None) -> Iterator[subprocess.Popen | None]:
    """Hold a macOS no-idle-sleep assertion while the block runs (``caffeinate -i -w <pid>``).

    ``-w`` ties the assertion to this process, so it ends even if we crash. On
    other platforms, or without ``caffeinate``, a no-op yielding None.
    """
    proc = None
    if platform == "darwin":
        try:
            proc = spawn(["caffeinate", "-i", "-w", str(pid or os.getpid())])
        except OSError:
            proc = None
    try:
        yield proc
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


# The one default for a job's CPU priority decrement (JobConfig and the CLI).
DEFAULT_NICE = defaults.DEFAULT_NICE

BACKGROUND_QOS_WARNING = (
    "background QoS (taskpolicy -b) was reported to slow Metal decode ~8x; "
    "use it only if the Mac must stay responsive and the job may take much longer"
)


def lower_priority(nice: int = 10, background_qos: bool = False, *, platform: str = sys.platform,
                   renice: Callable[[int], int] = os.nice, run: Callable[[list[str]], object] = run_text,
                   pid: int | None = None) -> str | None:
    """Lower this process's CPU priority by ``nice`` (``os.nice`` increment, 0 = unchanged).

    With ``background_qos`` on macOS also ``taskpolicy -b -p <pid>`` (darwin
    background QoS: lowest CPU, I/O and GPU priority). Returns a warning text
    (the ~8x Metal slowdown, or that the option does nothing off macOS), else None.

    Raises:
        ValueError: ``nice`` negative (raising priority needs root; not our business).
        subprocess.CalledProcessError: ``taskpolicy`` failed.
    """
    if nice < 0:
        raise ValueError(f"nice must be >= 0, got {nice}")
    if nice:
        renice(nice)
    if not background_qos:
        return None
    if platform != "darwin":
        return "background QoS is macOS-only; ignored here (nice applied)"
    run(["taskpolicy", "-b", "-p", str(pid or os.getpid())])
    return BACKGROUND_QOS_WARNING
