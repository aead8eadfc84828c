"""Checks of the commands' numeric options before any work: a value that is not a
finite amount, or beyond any machine, is refused with one line (exit 2), so that no
plan or run is made for a typo such as ``--memory-gb 1e30``."""

from __future__ import annotations

import math

from mlx_tier.cli.exits import fail

MOST_GIB = 2.0**20  # 1 PiB: more memory than any one machine has
MOST_GBPS = 1e5  # 100 TB/s: beyond any disk's or memory's bandwidth


def amount(flag: str, value: float | None, unit: str, most: float, zero_ok: bool = False) -> None:
    """Refuse ``value`` of ``flag`` (one line, exit 2) unless it is ``None`` or a finite
    number above 0 (at least 0 with ``zero_ok``) and at most ``most`` ``unit``."""
    if value is None:
        return
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        fail(f"{flag} must be a finite {'number' if zero_ok else 'positive number'} of {unit}"
             f"{' >= 0' if zero_ok else ''}, got {value}")
    if value > most:
        fail(f"{flag} {value:g} is beyond any machine: at most {most:,.0f} {unit}")


def gib(flag: str, value: float | None, zero_ok: bool = False, most: float = MOST_GIB) -> None:
    """:func:`amount` for a memory size in GiB, at most :data:`MOST_GIB` (``math.inf`` where
    the command checks it against this machine's memory next, which says more)."""
    amount(flag, value, "GiB", most, zero_ok)


def gbps(flag: str, value: float | None) -> None:
    """:func:`amount` for a bandwidth in GB/s (at most :data:`MOST_GBPS`)."""
    amount(flag, value, "GB/s", MOST_GBPS)
