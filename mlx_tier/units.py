"""Units of memory, defined once; seconds, rates, shares and sizes as people read them."""

import math

KIB = 1024
MIB = 1024**2
GIB = 1024**3


def seconds_text(seconds: float) -> str:
    """``"0.4 s"`` under 10 s (a short run's figures then do not read "over 0 s"), else
    ``"42 s"``."""
    return f"{seconds:.1f} s" if round(seconds, 1) < 10 else f"{seconds:.0f} s"  # 9.96 s is "10 s"


def duration_text(seconds: float) -> str:
    """A duration for people, never rounded to a figure that misleads: ``"0.4 s"`` under
    10 s, ``"42 s"`` under 2 min, ``"2 min 59 s"`` under an hour, else ``"3 h 05 min"``
    (minutes rounded down: an hour's figure is not 1 min short of the next)."""
    if seconds < 10:
        return seconds_text(seconds)
    s = int(round(seconds))
    if s < 120:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def count_text(n: int, noun: str) -> str:
    """``n`` of ``noun`` in words: ``"1 summary"``, ``"2 summaries"``, ``"1,200 documents"``
    (thousands separated; a noun ending in a consonant and ``y`` takes ``ies``)."""
    if n == 1:
        return f"1 {noun}"
    plural = noun[:-1] + "ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else noun + "s"
    return f"{n:,} {plural}"


def tokens_text(n: int) -> str:
    """``"1 token"``, ``"16 tokens"`` (thousands separated: ``"1,200 tokens"``)."""
    return count_text(n, "token")


def significant(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits, for a figure written to JSON: 151.2372 is
    151.2 and 1.2e-9 stays 1.2e-9 (rounding to decimal places would write 0.0)."""
    return float(f"{value:.{digits}g}") if math.isfinite(value) else value


def decimal_text(value: float, decimals: int = 2) -> str:
    """``value`` with ``decimals`` decimals, or two significant digits where those would show
    a positive value as 0: ``"0.57"``, ``"1.2e-12"`` (not "0.00")."""
    if 0 < abs(value) < 0.5 * 10.0**-decimals:
        return f"{value:.2g}"
    return f"{value:.{decimals}f}"


def rate_text(per_hour: float) -> str:
    """A documents/hour figure in whole units, with a decimal below 10: ``"0.7"``, ``"9.4"``,
    ``"212"`` (a prediction of 0.69 is not "1", nor 0.4 "0")."""
    if 0 < per_hour < 0.05:  # a book-length document a day: 0.04, not "0.0"
        return f"{per_hour:.1g}"
    tenths = round(per_hour, 1)  # 9.96 is "10", not "10.0"
    return f"{tenths:.1f}" if tenths < 10 else f"{per_hour:.0f}"


def percent_text(fraction: float, digits: int = 0) -> str:
    """A share in percents with ``digits`` decimals, but never rounded to 0% or 100% when it
    is neither (one decimal more near them): ``"37%"``, ``"99.6%"`` (not "100%"), ``"99.9%"``
    for 0.9996, ``"0.4%"``, ``"<0.1%"``; with ``digits=1``: ``"36.6%"``, ``"99.99%"``."""
    p = fraction * 100
    if p != p:  # NaN: no lookups to share
        return "?"
    step = 10.0**-digits
    if p <= 0 or p >= 100 or step <= p < 100 - step:
        return f"{p:.{digits}f}%"
    d = digits + 1
    if p >= 100 - step:
        return f"{math.floor(p * 10**d) / 10**d:.{d}f}%"
    return f"{p:.{d}f}%" if p >= 0.5 * 10.0**-d else f"<{10.0**-d:.{d}f}%"


def mib_text(nbytes: int) -> str:
    """A size in whole MiB, in KiB below 1 MiB (221,184 bytes are "216 KiB", not "0 MiB")."""
    kib = math.ceil(nbytes / KIB)
    return f"{nbytes / MIB:.0f} MiB" if kib >= 1024 or nbytes == 0 else f"{kib} KiB"
