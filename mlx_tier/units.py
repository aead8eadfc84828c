"""Units of memory, defined once; seconds as people read them."""

KIB = 1024
MIB = 1024**2
GIB = 1024**3


def seconds_text(seconds: float) -> str:
    """``"0.4 s"`` under 10 s (a short run's figures then do not read "over 0 s"), else
    ``"42 s"``."""
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def tokens_text(n: int) -> str:
    """``"1 token"``, ``"16 tokens"`` (thousands separated: ``"1,200 tokens"``)."""
    return f"{n:,} token{'' if n == 1 else 's'}"
