"""Units of memory, defined once."""

KIB = 1024
MIB = 1024**2
GIB = 1024**3
