"""How large and how long one document's conversion may get, and the check made before it.

Converting a PDF, Word, PowerPoint, Excel or EPUB file unpacks it: a zip
member or a PDF stream inflates up to ~1000x (deflate's limit), so a file of a
few hundred KB can become gigabytes of XML whose parsing takes minutes and
gigabytes of memory (a decompression bomb). Two bounds keep such a file from
taking the job down; over either, that document fails alone with the reason.

- Before: a zip-based file (DOCX, PPTX, XLSX, EPUB, any converted file that
  is a zip) is refused from its central directory alone (:func:`check_zip`)
  when one member unpacks to more than :data:`MAX_RATIO` times its packed size
  and more than :data:`RATIO_FLOOR`, or all members together to more than
  :data:`MAX_UNPACKED`, or it has more than :data:`MAX_MEMBERS` members.
- During: every conversion runs in a child process killed past
  :attr:`ConversionLimits.memory_mb` of memory or
  :meth:`ConversionLimits.seconds_for` (:mod:`mlx_tier.job.convert_sandbox`);
  that bounds PDF streams, HTML and whatever the check above lets through.

Owns the limits and the check before conversion; not the process
(:mod:`mlx_tier.job.convert_sandbox`) nor the conversion (:mod:`mlx_tier.job.doc_text`).
The numbers behind each limit: docs/documents.md ("Limits").
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from typing import BinaryIO

# A member that unpacks to more than MAX_RATIO x its packed size, once past
# RATIO_FLOOR unpacked, is a bomb: the parts of normal documents deflate 2-10x
# (prose and spreadsheet XML), small repetitive ones up to ~30x; a 20,000-row
# table of one repeated cell, 227x at 4.9 MiB, is the most repetitive normal
# content tried; deflate tops out near 1032x, the bomb reported was 330x
# (20 MiB from 62 KB). Below the floor, whatever the ratio, the limits of the
# child process bound the conversion (Word XML costs ~7-10 s and ~55-75 MiB per
# MiB on a loaded 2-core machine: 8 MiB stays under the memory limit and is
# stopped by the time limit).
MAX_RATIO = 100
RATIO_FLOOR = 8 * 2**20
# All members together: more than any document we would summarise (a
# 100,000-row spreadsheet unpacks to 21 MiB); the memory limit would stop its
# conversion anyway, this says why before spending minutes on it.
MAX_UNPACKED = 512 * 2**20
# A central directory of millions of empty members is another bomb (each is
# parsed); an EPUB of 300 chapters has ~300 members, a 200-slide deck ~440.
MAX_MEMBERS = 20_000

# The child process: memory (resident, MiB) and time (seconds, plus seconds per
# MB of the file: large files of real content take longer, a bomb is small).
# The process holds ~215 MiB before any document; normal documents of every kind
# peaked at 215-295 MiB and took 0.2-30 s on a loaded 2-core machine (a
# 10,000-row spreadsheet of 333 KB: 30 s, 294 MiB; a 300-page Word file: 8 s).
# A 100,000-row spreadsheet (3.3 MB: 279 s, 1,066 MiB) is over both: such a
# file needs the limits raised. Measured: docs/documents.md ("Limits").
DEFAULT_MEMORY_MB = 1024
DEFAULT_SECONDS = 60.0
DEFAULT_SECONDS_PER_MB = 60.0

_ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class ConversionLimits:
    """What one document's conversion may use (module doc for why these sizes).

    Attributes:
        memory_mb: the converter process's resident memory, MiB (its code
            included); over it the process is killed and the document fails.
        seconds: wall time a conversion may take, plus ``seconds_per_mb`` for
            each MB (10^6 bytes) of the file.
        seconds_per_mb: see ``seconds``.
        isolate: convert in the child process (``False``: in this process,
            with no memory or time limit; the check of zip files still runs).

    Raises:
        ValueError: a limit that is not positive.
    """

    memory_mb: int = DEFAULT_MEMORY_MB
    seconds: float = DEFAULT_SECONDS
    seconds_per_mb: float = DEFAULT_SECONDS_PER_MB
    isolate: bool = True

    def __post_init__(self):
        if self.memory_mb <= 0 or self.seconds <= 0 or self.seconds_per_mb < 0:
            raise ValueError(f"conversion limits must be positive, got {self}")

    def seconds_for(self, size: int) -> float:
        """The time limit for a file of ``size`` bytes, seconds."""
        return self.seconds + self.seconds_per_mb * size / 1e6


def size_text(n: float) -> str:
    """``n`` bytes in words: ``62 KB``, ``20 MiB``, ``1.5 GiB`` (binary units past a MiB)."""
    if n < 2**20:
        return f"{n / 1000:.0f} KB" if n >= 1000 else f"{n:.0f} bytes"
    if n < 2**30:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 2**30:.1f} GiB"


def is_zip(stream: BinaryIO) -> bool:
    """Whether ``stream`` (seekable, left at its start) holds a zip archive."""
    head = stream.read(len(_ZIP_MAGIC))
    stream.seek(0)
    return head == _ZIP_MAGIC


def check_zip(stream: BinaryIO) -> str | None:
    """Why the zip archive in ``stream`` must not be unpacked, or ``None``.

    Reads only the central directory (the sizes each member declares, which
    :mod:`zipfile` also holds the output to); ``stream`` is left at its start.
    ``None`` too when it is not a readable zip: the converter then says why.
    """
    try:
        with zipfile.ZipFile(stream) as z:
            members = [m for m in z.infolist() if not m.is_dir()]
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        members = None
    stream.seek(0)
    if members is None:
        return None
    if len(members) > MAX_MEMBERS:
        return f"too many parts: {len(members):,} in one archive (limit {MAX_MEMBERS:,})"
    for m in members:
        if m.file_size > RATIO_FLOOR and m.file_size > MAX_RATIO * max(m.compress_size, 1):
            return (f"too large when unpacked: {m.filename} is {size_text(m.file_size)} from "
                    f"{size_text(m.compress_size)} (limit {MAX_RATIO}x its packed size past {size_text(RATIO_FLOOR)})")
    unpacked = sum(m.file_size for m in members)
    if unpacked > MAX_UNPACKED:
        packed = sum(m.compress_size for m in members)
        return f"too large when unpacked: {size_text(unpacked)} from {size_text(packed)} (limit {size_text(MAX_UNPACKED)})"
    return None
