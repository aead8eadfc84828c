"""Job input: documents from a folder (recursive ``.txt``/``.md``), a JSONL file,
or a list of file paths (``mlx-tier run -`` reads it from stdin).

A *document* has an ``id`` (safe as a file name: the summary goes to
``OUT_DIR/<id>.md``) and either its text or the reason it cannot be read.
JSONL lines name themselves with ``custom_id`` (OpenAI batch style) or ``id``;
the value is kept exactly as given in :attr:`Document.key` so JSONL output
can echo it back.
Input-level problems (missing path, nothing to read, malformed JSONL) raise
:class:`InputError`; a single unreadable document (binary, non-UTF-8, empty)
is returned with ``error`` set so the rest of the job continues.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

SUFFIXES = (".txt", ".md")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Document:
    """One document of a job.

    Attributes:
        id: unique, file-name safe identifier.
        source: where it came from (path, or ``FILE:LINE`` for JSONL).
        text: the document's text, ``None`` when unreadable.
        error: why it cannot be summarised, ``None`` when readable.
        key: JSONL input only: ``("custom_id", value)`` or ``("id", value)``,
            the value exactly as the line gave it (string or number), for
            ``summaries.jsonl``; ``None`` for files.
    """

    id: str
    source: str
    text: str | None = None
    error: str | None = None
    key: tuple[str, str | int | float] | None = None


# Longest id kept as is: its output name (<id>.md, and the .<id>.md.XXXXXXXX.tmp
# written first) must stay under the usual 255-byte file-name limit.
MAX_ID_BYTES = 200


def safe_id(raw: str) -> str:
    """A file-name-safe form of ``raw`` (``a/b c.txt`` -> ``a__b_c.txt``); one longer
    than :data:`MAX_ID_BYTES` is cut and ends with a hash of the whole (still unique)."""
    s = raw.replace("/", "__").replace("\\", "__")
    s = _UNSAFE.sub("_", s).strip("._") or "doc"
    if len(s.encode("utf-8")) > MAX_ID_BYTES:
        import hashlib

        digest = hashlib.sha256(s.encode("utf-8")).hexdigest()[:12]
        s = s.encode("utf-8")[: MAX_ID_BYTES - 13].decode("utf-8", "ignore") + "_" + digest
    return s


def decode_text(data: bytes) -> tuple[str | None, str | None]:
    """``(text, None)`` for usable UTF-8 text, else ``(None, reason)``."""
    if b"\x00" in data:
        return None, "binary file (contains NUL bytes), not text"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (invalid byte at offset {e.start})"
    if not text.strip():
        return None, "empty document"
    return text, None


def _unique(ids: list[str]) -> list[str]:
    """Make ids unique even on case-insensitive disks (``a``, ``A`` -> ``a``, ``A-2``)."""
    seen: dict[str, int] = {}
    out = []
    for i in ids:
        key = i.casefold()
        seen[key] = seen.get(key, 0) + 1
        out.append(i if seen[key] == 1 else f"{i}-{seen[key]}")
    return out


def _read_document(path: Path, doc_id: str) -> Document:
    try:
        text, error = decode_text(path.read_bytes())
    except OSError as e:
        text, error = None, f"cannot read: {e.strerror}"
    return Document(doc_id, str(path), text, error)


def _from_files(root: Path, files: list[Path]) -> list[Document]:
    """Documents for ``files`` (all under ``root``), ids from their paths relative to ``root``."""
    stems = [safe_id(str(p.relative_to(root).with_suffix(""))) for p in files]
    folded = [s.casefold() for s in stems]
    # Keep the suffix only where two files would share an id (a.txt, a.md).
    ids = _unique([stem if folded.count(stem.casefold()) == 1 else safe_id(str(p.relative_to(root)))
                   for p, stem in zip(files, stems)])
    return [_read_document(p, doc_id) for p, doc_id in zip(files, ids)]


def _from_folder(root: Path, exclude: Path | None = None) -> list[Document]:
    files = sorted(
        p for p in root.rglob("*")
        if p.is_file() and p.suffix.lower() in SUFFIXES and not (exclude is not None and p.resolve().is_relative_to(exclude))
    )
    if not files:
        raise InputError(f"{root}: no .txt or .md files found")
    return _from_files(root, files)


def discover_list(lines: list[str] | tuple[str, ...], exclude: Path | None = None, source: str = "stdin") -> list[Document]:
    """Documents for a list of file paths, one per entry (``mlx-tier run -`` reads them from stdin).

    Any file is taken (the caller chose it); binary or non-UTF-8 ones fail
    alone, as in a folder. Blank entries are skipped; files inside ``exclude``
    (the job's output folder) are skipped, so that ``find . -name '*.md'``
    does not feed earlier summaries back in. Ids come from each path relative
    to the files' common folder, made unique as for a folder.

    Args:
        lines: file paths (relative to the working directory, or absolute).
        exclude: the job's output folder.
        source: how errors name the list (``stdin:3: ...``).

    Raises:
        InputError: a path is missing or a folder, the same file is listed
            twice, or the list is empty.
    """
    files, seen = [], {}
    excluded = Path(exclude).resolve() if exclude is not None else None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        path = Path(line.strip()).resolve()
        if path.is_dir():
            raise InputError(f"{source}:{n}: {line.strip()} is a folder; list files (or pass the folder as INPUT)")
        if not path.is_file():
            raise InputError(f"{source}:{n}: {line.strip()}: no such file")
        if path in seen:
            raise InputError(f"{source}:{n}: {line.strip()} is listed twice (first on line {seen[path]})")
        seen[path] = n
        if excluded is None or not path.is_relative_to(excluded):
            files.append(path)
    if not files:
        raise InputError(f"{source}: no file paths given")
    root = Path(os.path.commonpath([p.parent for p in files]))
    return _from_files(root, files)


def _from_jsonl(path: Path) -> list[Document]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None
    docs, seen = [], {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: malformed JSON ({e.msg})") from None
        name = "custom_id" if isinstance(obj, dict) and "custom_id" in obj else "id"
        if not isinstance(obj, dict) or "text" not in obj or name not in obj:
            raise InputError(f'{path}:{n}: each line needs an object with "custom_id" (or "id") and "text"')
        if not isinstance(obj["text"], str):
            raise InputError(f'{path}:{n}: "text" must be a string')
        if not isinstance(obj[name], (str, int, float)) or isinstance(obj[name], bool):
            raise InputError(f'{path}:{n}: "{name}" must be a string or a number')
        doc_id = safe_id(str(obj[name]))
        folded = doc_id.casefold()  # output file names must differ on case-insensitive disks too
        if folded in seen:
            raise InputError(f"{path}:{n}: duplicate {name} {obj[name]!r} (first on line {seen[folded]})")
        seen[folded] = n
        text = obj["text"] if obj["text"].strip() else None
        docs.append(Document(doc_id, f"{path}:{n}", text, None if text else "empty document", (name, obj[name])))
    if not docs:
        raise InputError(f"{path}: no documents (empty JSONL file)")
    return docs


def discover(path: Path, exclude: Path | None = None) -> list[Document]:
    """All documents of a job input.

    Args:
        path: a folder (recursive ``.txt``/``.md``) or a ``.jsonl`` file with
            one ``{"custom_id": ..., "text": ...}`` (or ``"id"``) object per line.
        exclude: a folder inside ``path`` to skip (the job's output folder).

    Raises:
        InputError: path missing, nothing to read, malformed/duplicate JSONL line.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    if path.is_dir():
        return _from_folder(path, Path(exclude).resolve() if exclude is not None else None)
    if path.suffix.lower() == ".jsonl":
        return _from_jsonl(path)
    if path.suffix.lower() in SUFFIXES:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror})") from None
        text, error = decode_text(data)
        if error:
            raise InputError(f"{path}: {error}")
        return [Document(safe_id(path.stem), str(path), text)]
    raise InputError(f"{path}: expected a folder of .txt/.md files or a .jsonl file")
