"""Units of memory, defined once; seconds as people read them."""

KIB = 1024
MIB = 1024**2
GIB = 1024**3


def seconds_text(seconds: float) -> str:
    """``"0.4 s"`` under 10 s (a short run's figures then do not read "over 0 s"), else
    ``"42 s"``."""
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


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


def rate_text(per_hour: float) -> str:
    """A documents/hour figure in whole units, with a decimal below 10: ``"0.7"``, ``"9.4"``,
    ``"212"`` (a prediction of 0.69 is not "1", nor 0.4 "0")."""
    tenths = round(per_hour, 1)  # 9.96 is "10", not "10.0"
    return f"{tenths:.1f}" if tenths < 10 else f"{per_hour:.0f}"
