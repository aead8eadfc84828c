"""Output names: distinct documents always get distinct ``OUT_DIR/<id>.md`` files.

A document's *name* is what the user knows it by (a file's path relative to
INPUT, a JSONL line's ``custom_id``/``id`` as text). Its *id* is the stem of
its output file: the name made safe for every current filesystem (letters of
any script kept, path separators and other punctuation replaced), then made
unique against **every** id already assigned, compared the way a
case-insensitive, normalising disk (APFS, NTFS) compares them. A name that
comes out unchanged (``a_b.txt`` -> ``a_b.txt``, or ``a_b`` without its suffix)
wins its id over names that had to change (``a b.txt``); the rest get
``-2``, ``-3``… suffixes, each checked against all ids taken so far.

Resume keeps the mapping: ids an earlier run recorded for a name in the
journal are reserved first (:func:`assign`'s ``previous``).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

# Longest id kept as is: its output name (<id>.md, and the .<id>.md.XXXXXXXX.tmp
# written first) must stay under the usual 255-byte file-name limit.
MAX_ID_BYTES = 200
# A run of anything but letters, digits (any script), "_", "." and "-" becomes one "_".
_UNSAFE = re.compile(r"[^\w.-]+")


def fold(name: str) -> str:
    """The collision key of an id: how a case-insensitive, Unicode-normalising disk sees it."""
    return unicodedata.normalize("NFC", name).casefold()


def _cut(s: str) -> str:
    """``s`` cut to :data:`MAX_ID_BYTES` UTF-8 bytes, ending with a hash of the whole when cut."""
    if len(s.encode("utf-8")) <= MAX_ID_BYTES:
        return s
    digest = hashlib.sha256(s.encode("utf-8")).hexdigest()[:12]
    return s.encode("utf-8")[: MAX_ID_BYTES - 13].decode("utf-8", "ignore") + "_" + digest


def safe_id(raw: str) -> str:
    """A file-name-safe form of ``raw``: letters and digits of any script, ``.``, ``_``
    and ``-`` kept; ``/`` and ``\\`` become ``__``; anything else ``_``; leading and
    trailing dots and underscores dropped (no hidden files, no ``..``); ``doc`` when
    nothing is left. Longer than :data:`MAX_ID_BYTES` bytes: cut, with a hash of the
    whole appended. Not injective: :func:`assign` makes ids unique.

    Examples: ``a/b c?.txt`` -> ``a__b_c_.txt``; ``会议纪要`` stays; ``..`` -> ``doc``.
    """
    s = unicodedata.normalize("NFC", raw).replace("/", "__").replace("\\", "__")
    s = _UNSAFE.sub("_", s).strip("._") or "doc"
    return _cut(s)


def _suffixed(base: str, n: int) -> str:
    """``base-n``, ``base`` shortened to keep it within :data:`MAX_ID_BYTES` bytes."""
    tail = f"-{n}"
    return base.encode("utf-8")[: MAX_ID_BYTES - len(tail)].decode("utf-8", "ignore") + tail


def assign(names: list[str], wished: list[str] | None = None, previous: dict[str, str] | None = None) -> list[str]:
    """Unique ids for ``names`` (one per name, in order).

    Args:
        names: the documents' names, all distinct.
        wished: the id each would like (default: :func:`safe_id` of its name).
        previous: ``name -> id`` recorded by earlier runs (the journal): kept
            as they were, and never given to another name.

    Returns:
        ids, pairwise distinct under :func:`fold`.
    """
    wished = list(wished) if wished is not None else [safe_id(n) for n in names]
    previous = previous or {}
    reserved = {fold(v) for v in previous.values()}
    ids: list[str | None] = [None] * len(names)
    taken: set[str] = set()
    for i, name in enumerate(names):  # 1: what earlier runs assigned
        old = previous.get(name)
        if old is not None and fold(old) not in taken:
            ids[i] = old
            taken.add(fold(old))
    # 2: names that come out unchanged (a file's name less its suffix too) claim their id first.
    order = sorted(range(len(names)), key=lambda i: not names[i].startswith(wished[i]))
    for i in order:
        if ids[i] is None and fold(wished[i]) not in taken and fold(wished[i]) not in reserved:
            ids[i] = wished[i]
            taken.add(fold(wished[i]))
    for i in range(len(names)):  # 3: the rest get the first free suffix
        n = 2
        while ids[i] is None:
            candidate = _suffixed(wished[i], n)
            if fold(candidate) not in taken and fold(candidate) not in reserved:
                ids[i] = candidate
                taken.add(fold(candidate))
            n += 1
    return ids  # type: ignore[return-value]
