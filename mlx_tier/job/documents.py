"""Job input: documents from a folder (recursive, by suffix), a JSONL file, or
a list of file paths (``mlx-tier run -`` reads it from stdin).

A *document* has a ``name`` (what the user knows it by: its path relative to
INPUT, or its JSONL ``custom_id``/``id`` as text), an ``id`` (the stem of its
output ``OUT_DIR/<id>.md``: the name made file-name safe and unique,
:mod:`mlx_tier.job.naming`) and either its text or the reason it cannot be read.
Text comes from :mod:`mlx_tier.job.doc_text` (any common text encoding; PDF,
Word, PowerPoint, Excel, HTML, EPUB… through MarkItDown).

A folder walk skips what is not a document (:func:`skip_reason`: dot-files
and dot-folders, macOS ``._`` AppleDouble files, editor lock/backup files), the
job's output folder and any other mlx-tier job's
(:func:`~mlx_tier.outdir.layout.is_job_folder`: its summaries are not documents)
and, unless ``follow_links``, links that lead outside the folder.
JSONL lines are either documents, ``{"custom_id" or "id", "text"}``, named by
that key (kept as given, numbers as their literal text, in :attr:`Document.key`
so JSONL output can echo it back), or, in a file of their own, OpenAI Batch API
requests (:mod:`mlx_tier.job.batch_api`): each becomes a document that carries
its :attr:`Document.request` and is run as written, not summarised.
Input-level problems (missing path, nothing to read, malformed JSONL) raise
:class:`InputError`; a single unreadable document (binary, empty, a failed
conversion) is returned with ``error`` set so the rest of the job continues.
"""

from __future__ import annotations

import codecs
import json
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cache, cached_property
from pathlib import Path

from mlx_tier.errors import InputError
from mlx_tier.job.batch_api import BatchRequest, is_request, read_requests
from mlx_tier.job.convert_limits import ConversionLimits
from mlx_tier.job.doc_text import (
    CONVERSION_ERRORS,
    SUFFIXES,
    TEXT_SUFFIXES,
    Converted,
    convert_file,
    decode_text,
    open_document,
    surrogate_at,
)
from mlx_tier.job.naming import MAX_ID_BYTES, assign, fold, safe_id
from mlx_tier.job.provenance import SourceStamp, file_stamp, request_stamp, text_stamp
from mlx_tier.outdir.layout import is_job_folder

__all__ = ["MAX_ID_BYTES", "SUFFIXES", "Document", "FileDocument", "InputError", "by_count", "decode_text",
           "discover", "discover_list", "fails_unread", "link_hint", "safe_id", "skip_note", "skip_reason", "source_field",
           "source_file", "source_hash", "with_default_limit"]


@dataclass(frozen=True)
class Document:
    """One document of a job.

    Attributes:
        id: unique, file-name safe identifier (output ``<id>.md``).
        source: where it came from (path, or ``FILE:LINE`` for JSONL).
        text: the document's text, ``None`` when unreadable.
        error: why it cannot be summarised, ``None`` when readable.
        key: JSONL input only: ``("custom_id", value)`` or ``("id", value)``,
            the value a string as the line gave it (a number as its literal
            text, e.g. ``"1e400"``), for ``summaries.jsonl``; ``None`` for files.
        name: the original identifier (relative path, or the key's value);
            ``id`` is derived from it. Defaults to ``id``.
        converter: how the text was obtained (``text (utf-8)``,
            ``markitdown 0.1.3``…), ``None`` for JSONL text.
        stamp: what its summary is made from (:mod:`mlx_tier.job.provenance`):
            a single document file's bytes; a batch request's url and body; by
            default, its text's.
        request: a batch request line's request, run as written
            (``text`` is then its message contents, to size batches); ``None``
            for a document to summarise.
    """

    id: str
    source: str
    text: str | None = None
    error: str | None = None
    key: tuple[str, str] | None = None
    name: str | None = None
    converter: str | None = None
    stamp: SourceStamp | None = None
    request: BatchRequest | None = None

    def __post_init__(self):
        if self.name is None:
            object.__setattr__(self, "name", self.id)
        if self.stamp is None and self.text is not None:
            object.__setattr__(self, "stamp", text_stamp(self.text))


# Folders that hold no documents of the user's: zip tools' macOS metadata.
_SKIP_FOLDERS = {"__MACOSX"}
_SKIP_SUFFIXES = {".swp", ".swo", ".swx", ".tmp", ".bak", ".crdownload", ".part"}


def skip_reason(name: str) -> str | None:
    """Why a file or folder named ``name`` is not a document, or ``None`` when it may be one.

    Skipped: macOS AppleDouble metadata (``._x``), other dot-files and
    dot-folders (``.DS_Store``, ``.git``, Emacs ``.#x`` locks, Vim ``.x.swp``),
    Office lock files (``~$x.docx``), backups (``x~``, ``x.bak``), Emacs
    autosaves (``#x#``), partial downloads, ``__MACOSX`` folders.
    """
    if name.startswith("._"):
        return "macOS metadata (AppleDouble)"
    if name.startswith("."):
        return "hidden file"
    if name.startswith("~$"):
        return "Office lock file"
    if name.endswith("~") or (name.startswith("#") and name.endswith("#")):
        return "editor backup file"
    if os.path.splitext(name)[1].lower() in _SKIP_SUFFIXES:
        return "temporary or backup file"
    if name in _SKIP_FOLDERS:
        return "macOS metadata folder"
    return None


@dataclass(frozen=True, eq=False)
class FileDocument:
    """A document of a file, converted when first used.

    Same attributes as :class:`Document`; reading ``text``, ``error`` or
    ``converter`` converts the file (:func:`mlx_tier.job.doc_text.convert_file`)
    once and keeps the result. Finding a job's documents therefore converts
    nothing: the job runner triages them by id first and converts only the
    pending ones, each when its turn comes (a rerun never converts the
    documents already done).

    A conversion that raises (a converter library's bug, a broken PDF) fails
    this document alone: ``error`` says why
    (:data:`~mlx_tier.job.doc_text.CONVERSION_ERRORS`; a MemoryError still stops the job).

    Attributes:
        id, source, name: as for :class:`Document` (``source``: the file's path).
        path: the file.
        inside: the real INPUT folder the file must still lie in when it is
            converted (a link planted there after discovery is refused);
            ``None``: not checked (``follow_links``, or a list of paths).
        limits: how large and how long its conversion may get
            (:class:`~mlx_tier.job.convert_limits.ConversionLimits`; over them it fails alone).
        wished: the id its name asks for (:func:`mlx_tier.job.naming.assign`'s wish); its
            ``id`` differs when another name, or a file in OUT_DIR, has it.
    """

    id: str
    source: str
    path: Path
    name: str | None = None
    inside: Path | None = None
    limits: ConversionLimits = ConversionLimits()
    wished: str | None = None  # the id its name asks for, before any other name took it
    key = None  # files have no JSONL key
    request = None  # nor a batch request

    @cached_property
    def stamp(self) -> SourceStamp | None:
        """The file's bytes as its summary is made from them (:func:`mlx_tier.job.provenance.file_stamp`),
        hashed once, before the conversion (a file changed in between is found stale next
        time, never taken as current); ``None`` when it cannot be read."""
        return file_stamp(self.path, self.inside)

    @cached_property
    def _converted(self) -> Converted:
        self.stamp  # noqa: B018 - hashed before converting (see stamp)
        try:
            return convert_file(self.path, inside=self.inside, limits=self.limits)
        except MemoryError:
            raise
        except CONVERSION_ERRORS as e:  # one document's failure must not stop the job
            return Converted(None, f"cannot convert ({type(e).__name__}): {e}")

    @property
    def text(self) -> str | None:
        return self._converted.text

    @property
    def error(self) -> str | None:
        return self._converted.error

    @property
    def converter(self) -> str | None:
        return self._converted.converter

    def size_hint(self, convert: bool = True) -> int:
        """Characters its text may have, erring long; used to size batches.

        A plain-text file (:data:`~mlx_tier.job.doc_text.TEXT_SUFFIXES`): its
        size in bytes, without reading it (an upper bound: no encoding takes
        less than a byte a character). A converted kind (PDF, Word...): its
        bytes are mostly not text (a PDF's can be 10-100x its text), so it is
        converted (once: the result is kept) and its text's length counted;
        with ``convert`` false, 0 (not sized). 0 when unreadable.
        """
        if self.path.suffix.lower() not in TEXT_SUFFIXES:
            return len(self.text or "") if convert else 0
        try:
            return self.path.stat().st_size
        except OSError:
            return 0


SMALL_TEXT_BYTES = 4096  # a plain-text file at most this long is read ahead to see if it is blank


def fails_unread(doc) -> bool:
    """Whether ``doc`` is seen unusable at little cost, before any model is loaded: a JSONL
    line with no text, a file that cannot be opened or has no bytes, a plain-text file of
    at most :data:`SMALL_TEXT_BYTES` whose bytes are blank or not text. Its ``error`` then
    says why, as its turn would have (only such a document is converted here). Any other
    file is read at its turn (a blank 1 MB file fails then)."""
    if doc.request is not None:
        return False
    if not isinstance(doc, FileDocument):
        return doc.text is None
    return _looks_unusable(doc.path, doc.inside) and doc.error is not None


def _looks_unusable(path: Path, inside: Path | None) -> bool:
    """:func:`fails_unread`'s look at a file's bytes, opened as its conversion opens it."""
    fd = open_document(path, inside)
    if isinstance(fd, str):  # cannot be opened, or a link out of the folder: its conversion says so
        return True
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return True
        if size > SMALL_TEXT_BYTES or path.suffix.lower() not in TEXT_SUFFIXES:
            return False
        try:
            return decode_text(f.read()).text is None
        except OSError:
            return True


def size_hint(doc, convert: bool = True) -> int:
    """Characters a document's text may have, erring long (:meth:`FileDocument.size_hint`:
    ``convert`` false never converts; a :class:`Document`'s own text length)."""
    return doc.size_hint(convert) if isinstance(doc, FileDocument) else len(doc.text or "")


def with_default_limit(docs: list, max_tokens: int) -> list:
    """``docs`` with each batch request that sets no token limit (``max_tokens`` or
    ``max_completion_tokens``) stamped with the run's ``max_tokens`` too
    (:func:`~mlx_tier.job.provenance.request_stamp`): another ``--max-tokens`` changes its
    answer, so a rerun redoes it instead of keeping the old one as current."""
    return [replace(d, stamp=request_stamp(d.request.url, d.request.body, max_tokens))
            if d.request is not None and d.request.plan is not None and d.request.plan.max_tokens is None else d
            for d in docs]


def source_file(doc) -> str | None:
    """The file ``doc`` is read from, as an absolute path (links kept: an INPUT given as a link
    later pointed elsewhere names the same document): a JSONL line's is its JSONL file;
    ``None`` for a batch request (its answer is a line of ``output.jsonl``, no output file).

    What a summary's journal record keeps of its source (:func:`source_field`): the same
    output name reached from another file is told apart from the same file reached again
    (:func:`mlx_tier.job.rerun.refuse_other_files`)."""
    if doc.request is not None:
        return None
    return os.path.abspath(doc.source.rpartition(":")[0] if doc.key is not None else doc.source)


def source_hash(doc) -> str | None:
    """The sha256 of ``doc``'s source as its summary is made from it (its stamp,
    :mod:`mlx_tier.job.provenance`); ``None`` when unknown (an unreadable file)."""
    stamp = getattr(doc, "stamp", None)
    return stamp.sha256 if stamp is not None else None


def source_field(doc) -> dict[str, str]:
    """``{"source": source_file(doc)}`` for the document's journal records; ``{}`` when it has no file."""
    path = source_file(doc)
    return {"source": path} if path is not None else {}


def _from_files(root: Path, files: list[Path], previous: dict[str, str] | None = None,
                absolute_names: bool = False, inside: Path | None = None,
                limits: ConversionLimits = ConversionLimits()) -> list[FileDocument]:
    """Documents for ``files`` (all under ``root``), named by their paths relative to
    ``root`` (``absolute_names``: by their absolute paths, for lists whose common
    folder changes from run to run; ids still come from the relative paths).
    ``inside``, ``limits``: as for :class:`FileDocument`."""
    rel = [p.relative_to(root) for p in files]
    names = [p.as_posix() for p in files] if absolute_names else [r.as_posix() for r in rel]
    stems = [safe_id(str(r.with_suffix(""))) for r in rel]
    counts: dict[str, int] = {}
    for s in stems:
        counts[fold(s)] = counts.get(fold(s), 0) + 1
    # The output name drops the suffix, except where two files would share it (a.txt, a.md).
    wished = [s if counts[fold(s)] == 1 else safe_id(str(r)) for s, r in zip(stems, rel)]
    ids = assign(names, wished, previous)
    return [FileDocument(doc_id, str(p), p, name=name, inside=inside, limits=limits, wished=w)
            for p, doc_id, name, w in zip(files, ids, names, wished)]


def _walk(root: Path, exclude: Path | None, follow_links: bool,
          skipped: Counter | None = None) -> list[Path]:
    """Files under ``root`` with a document suffix, in sorted order (module doc for what is skipped).

    ``skipped``, when given, counts the files and folders left out by why (:func:`skip_note`).
    """
    real_root, files, seen = root.resolve(), [], set()
    skipped = Counter() if skipped is None else skipped
    # With links followed, a folder of INPUT is walked by its own path, never by a link's
    # (which one came first would otherwise name its documents, by directory order).
    inside = _walked_folders(root, exclude) if follow_links else set()
    walked = cache(lambda: _walked_folders(root, exclude))  # without: once a link into INPUT asks
    for folder, dirs, names in os.walk(root, followlinks=follow_links):
        here = Path(folder)
        if follow_links:  # a link cycle would walk forever
            real = here.resolve()
            if real in seen:
                dirs[:] = []
                continue
            seen.add(real)
        why = {d: _folder_skip(here / d, exclude) or (_linked_inside(here / d, inside) if follow_links
                                                     else _folder_link(here / d, real_root, walked)) for d in dirs}
        skipped.update(w for w in why.values() if w is not None)
        dirs[:] = [d for d in dirs if why[d] is None]
        for name in names:
            why = _file_skip(here / name, exclude, follow_links, real_root)
            if why is None:
                files.append(here / name)
            else:
                skipped[why] += 1
    return _once_each(sorted(files), skipped)


def _walked_folders(root: Path, exclude: Path | None) -> set[Path]:
    """The real paths of the folders under ``root`` a walk that follows no link enters (hidden,
    metadata and output folders left out, as :func:`_folder_skip` leaves them): a link to
    one of them is redundant; a link to any other folder is the way to its files."""
    out = set()
    for folder, dirs, _ in os.walk(root):
        here = Path(folder)
        out.add(here.resolve())
        dirs[:] = [d for d in dirs if _folder_skip(here / d, exclude) is None]
    return out


def _folder_link(p: Path, real_root: Path, walked: Callable[[], set[Path]]) -> str | None:
    """Why the folder link ``p`` is not walked when links are not followed (``os.walk`` would
    pass it by without a word): its folder is read by its own path, is one the walk skips
    (hidden, say: ``walked()``, the real paths of the folders walked), or lies out of INPUT."""
    if not p.is_symlink():
        return None
    real = p.resolve()
    if not real.is_relative_to(real_root):
        return "link to a folder out of INPUT"
    return "link to a folder in INPUT" if real in walked() else "link to a skipped folder in INPUT"


def link_hint(skipped: Counter) -> str | None:
    """What reads the links a walk left out that lead to files it did not read (out of INPUT,
    or into a folder it skips: :func:`_walk`'s ``skipped``), or ``None``."""
    out = skipped.get("link out of INPUT") or skipped.get("link to a folder out of INPUT")
    if out and skipped.get("link to a skipped folder in INPUT"):
        return "links out of INPUT and to skipped folders: --follow-links reads them"
    if out:
        return "links out of INPUT are not read: --follow-links reads them"
    if skipped.get("link to a skipped folder in INPUT"):
        return "links to skipped folders are not read: --follow-links reads them"
    return None


def _linked_inside(p: Path, inside: set[Path]) -> str | None:
    """``"link to a folder in INPUT"`` for a link to a folder walked by its own path."""
    return "link to a folder in INPUT" if p.is_symlink() and p.resolve() in inside else None


def _once_each(files: list[Path], skipped: Counter) -> list[Path]:
    """``files`` with each file once: a link to a document also found by its own path (or by
    another link) is left out, counted in ``skipped``; the path that is no link wins, else
    the first in sorted order."""
    best: dict[Path, Path] = {}
    for p in files:
        real = p.resolve()
        if real not in best or (best[real].is_symlink() and not p.is_symlink()):
            best[real] = p
    kept = set(best.values())
    for p in files:
        if p not in kept:
            skipped["link to a document read by its own path"] += 1
    return [p for p in files if p in kept]


# Why a folder is not searched (:func:`_folder_skip`); every other reason counted is a file's.
_FOLDER_REASONS = ("hidden folder", "metadata folder", "output folder", "mlx-tier output folder",
                   "link to a folder in INPUT", "link to a skipped folder in INPUT", "link to a folder out of INPUT")


def _folder_skip(p: Path, exclude: Path | None) -> str | None:
    """Why the folder ``p`` is not searched (one of :data:`_FOLDER_REASONS`), or ``None`` when it is."""
    hidden, metadata, output, other_job = _FOLDER_REASONS[:4]
    if skip_reason(p.name) is not None:
        return hidden if p.name.startswith(".") else metadata
    if exclude is not None and p.resolve().is_relative_to(exclude):
        return output
    return other_job if is_job_folder(p) else None  # another job's summaries, not documents


def _file_skip(p: Path, exclude: Path | None, follow_links: bool, real_root: Path) -> str | None:
    """Why the file ``p`` found in a folder is not read (a suffix stands for "not a kind
    mlx-tier reads"), or ``None`` when it is a document."""
    why = skip_reason(p.name)
    if why is not None or p.suffix.lower() not in SUFFIXES:
        return why or p.suffix.lower() or "no suffix"
    target = p.resolve()
    if exclude is not None and target.is_relative_to(exclude):
        return "in the output folder"
    if not follow_links and p.is_symlink() and not target.is_relative_to(real_root):
        return "link out of INPUT"  # not read unless asked (--follow-links)
    return None if p.is_file() else "not a regular file"


def by_count(skipped: Mapping[str, int]) -> dict[str, int]:
    """``skipped`` (reason or suffix -> count) most frequent first; ties by name, not walk order."""
    return dict(sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0])))


def skip_note(skipped: Counter, width: int = 80) -> str:
    """``skipped`` (reason or suffix -> count, :func:`_walk`) in one line of at most ``width``
    characters: how many files and folders, then the reasons, most frequent first, as many
    as fit, the rest as ``other``: e.g. ``"skipped 6 files, 1 folder: no suffix 2, .csv 1,
    hidden folder 1, other 3"``; ``"the folder is empty"`` when none."""
    if not skipped:
        return "the folder is empty"
    folders = sum(n for why, n in skipped.items() if why in _FOLDER_REASONS)
    files = sum(skipped.values()) - folders
    head = "skipped " + ", ".join(f"{n} {kind}{'s' if n > 1 else ''}"
                                  for n, kind in ((files, "file"), (folders, "folder")) if n)
    ranked = list(by_count(skipped).items())
    for shown in range(len(ranked), 0, -1):
        rest = sum(n for _, n in ranked[shown:])
        reasons = [f"{why} {n}" for why, n in ranked[:shown]] + ([f"other {rest}"] if rest else [])
        line = f"{head}: {', '.join(reasons)}"
        if len(line) <= width:
            return line
    return head


def _from_folder(root: Path, exclude: Path | None, follow_links: bool, previous: dict[str, str] | None,
                 limits: ConversionLimits, skipped: Counter) -> list[FileDocument]:
    files = _walk(root, exclude, follow_links, skipped)
    if not files:
        hint = link_hint(skipped)
        raise InputError(f"{root}: no documents found: {skip_note(skipped)}; "
                         + (f"{hint}, and " if hint else "") + "mlx-tier run --help lists the kinds it reads")
    return _from_files(root, files, previous, inside=None if follow_links else root.resolve(), limits=limits)


def discover_list(lines: list[str] | tuple[str, ...], exclude: Path | None = None, source: str = "stdin",
                  previous: dict[str, str] | None = None, limits: ConversionLimits = ConversionLimits(),
                  skipped: Counter | None = None) -> list[FileDocument]:
    """Documents for a list of file paths (converted when first used, :class:`FileDocument`), one per entry (``mlx-tier run -`` reads them from stdin).

    Any suffix is taken (the caller chose the file): known formats are
    converted, others read as text; a binary one fails alone, as in a folder.
    Blank entries, non-documents (:func:`skip_reason`: AppleDouble, lock and
    backup files a ``find`` lists) and files inside ``exclude`` (the job's
    output folder, so that ``find . -name '*.md'`` does not feed earlier
    summaries back in) are skipped. Ids come from each path relative
    to the files' common folder, made unique as for a folder.

    Args:
        lines: file paths (relative to the working directory, or absolute).
        exclude: the job's output folder.
        source: how errors name the list (``stdin:3: ...``).
        previous, limits, skipped: as for :func:`discover`.

    Raises:
        InputError: a path is missing or a folder, the same file is listed
            twice, a file lies in an output folder that is not yet a job's (the
            user's own folder), or the list is empty or names only files left
            out (said with their reasons).
    """
    files, seen, left_out = [], {}, Counter()
    excluded = Path(exclude).resolve() if exclude is not None else None
    own = excluded is not None and is_job_folder(excluded)  # a job's folder: what it holds are its outputs
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        path = Path(line.strip()).resolve()
        if path.is_dir():
            raise InputError(f"{source}:{n}: {line.strip()} is a folder; list files (or pass the folder as INPUT)")
        if not path.is_file():
            raise InputError(f"{source}:{n}: {line.strip()}: no such file")
        if path in seen:
            first, given = seen[path]
            if Path(given).absolute() == Path(line.strip()).absolute():
                raise InputError(f"{source}:{n}: {line.strip()} is listed twice (first on line {first})")
            raise InputError(f"{source}:{n}: {line.strip()} is the same file as {given} on line {first} "
                             "(a link or another path to it: listed twice)")
        seen[path] = (n, line.strip())
        if excluded is not None and path.is_relative_to(excluded) and not own:
            raise InputError(f"{source}:{n}: {line.strip()} is inside the output folder {exclude}, which is no "
                             "mlx-tier job's: its summaries and reports would mix with your documents (choose "
                             "another folder)")
        why = skip_reason(path.name) or (
            "in the output folder" if excluded is not None and path.is_relative_to(excluded) else None)
        if why is None:
            files.append(path)
        else:
            left_out[why] += 1
    if skipped is not None:
        skipped.update(left_out)
    if not files:  # every path a list named left out: say why, not "none given"
        raise InputError(f"{source}: no documents: {skip_note(left_out)}" if left_out else f"{source}: no file paths given")
    root = Path(os.path.commonpath([p.parent for p in files]))
    # Named by absolute path: a later list with another common folder must not
    # take an earlier run's output for a different file of the same relative name.
    return _from_files(root, files, previous, absolute_names=True, inside=root, limits=limits)


def _jsonl_lines(path: Path) -> list[str]:
    """The lines of a JSONL file: UTF-8 (a leading BOM dropped), split on ``\\n`` only
    (JSON strings may hold U+2028 and other characters ``str.splitlines`` splits at)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None


def _jsonl_record(obj: object, line: str, where: str) -> tuple[str, str, str]:
    """``(key name, key value as text, document text)`` of one parsed JSONL document line.

    Raises:
        InputError: no usable id or text.
    """
    name = "custom_id" if isinstance(obj, dict) and "custom_id" in obj else "id"
    if not isinstance(obj, dict) or name not in obj or "text" not in obj:
        raise InputError(f'{where}: each line needs an object with "custom_id" (or "id") and "text" '
                         '(or, in a file of its own, an OpenAI batch request)')
    text = obj["text"]
    if not isinstance(text, str):
        raise InputError(f'{where}: "text" must be a string')
    value = obj[name]
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise InputError(f'{where}: "{name}" must be a string or a number')
    if not isinstance(value, str):  # a number: keep its literal text (1e400 is not "inf")
        value = json.loads(line, parse_int=str, parse_float=str, parse_constant=str)[name]
    if (k := surrogate_at(value)) is not None:
        raise InputError(f'{where}: "{name}" is not valid Unicode (a lone surrogate, {value[k]!r}, at character '
                         f'{k + 1}): it names the summary\'s file')
    return name, value, text


def _text_error(text: str) -> str | None:
    """Why a JSONL line's ``text`` cannot be summarised (it fails alone), ``None`` when it can."""
    if not text.strip():
        return "empty text"
    k = surrogate_at(text)
    return None if k is None else f"text not valid Unicode: a lone surrogate ({text[k]!r}) at character {k + 1}"


def _parsed(path: Path) -> list[tuple[int, str, object]]:
    """``(line number, line, parsed JSON)`` of each non-blank line of a JSONL file.

    Raises:
        InputError: unreadable, not UTF-8, a malformed line, or no line at all.
    """
    parsed = []
    for n, line in enumerate(_jsonl_lines(path), 1):
        if not line.strip():
            continue
        try:
            parsed.append((n, line, json.loads(line)))
        except json.JSONDecodeError as e:
            # e.msg alone ends "... starting at": the place is in colno
            raise InputError(f"{path}:{n}: malformed JSON at column {e.colno} ({e.msg.removesuffix(' at')})") from None
    if not parsed:
        raise InputError(f"{path}: no documents (empty JSONL file)")
    return parsed


def _from_jsonl(path: Path, previous: dict[str, str] | None) -> list[Document]:
    parsed = _parsed(path)
    requests = [n for n, _, obj in parsed if is_request(obj)]
    if requests and len(requests) < len(parsed):
        n = next(n for n, _, obj in parsed if not is_request(obj))
        raise InputError(f"{path}:{n}: not an OpenAI batch request, in a file of them (line {requests[0]} is "
                         "one); give documents to summarise and batch requests as separate inputs")
    if requests:
        return _from_requests(path, parsed, previous)
    records, seen = [], {}
    for n, line, obj in parsed:
        name, value, text = _jsonl_record(obj, line, f"{path}:{n}")
        if value in seen:
            raise InputError(f"{path}:{n}: duplicate {name} {value!r} (first on line {seen[value]})")
        seen[value] = n
        records.append((n, name, value, text))
    ids = assign([value for _, _, value, _ in records], previous=previous)
    return [  # a blank line stamped too: fixed later, its failure is seen to be of other text and retried
        Document(doc_id, f"{path}:{n}", None if _text_error(text) else text, _text_error(text),
                 (name, value), name=value, stamp=text_stamp(text))
        for doc_id, (n, name, value, text) in zip(ids, records)
    ]


def _from_requests(path: Path, parsed: list, previous: dict[str, str] | None) -> list[Document]:
    """One document per batch request line (:func:`mlx_tier.job.batch_api.read_requests`),
    stamped with its whole request (:func:`mlx_tier.job.provenance.request_stamp`: a
    changed option is a changed request, redone on the next run)."""
    requests = read_requests([(n, obj) for n, _, obj in parsed], str(path))
    ids = assign([r.custom_id for r in requests], previous=previous)
    return [Document(doc_id, f"{path}:{r.line}", r.text, key=("custom_id", r.custom_id), name=r.custom_id,
                     stamp=request_stamp(r.url, r.body), request=r) for doc_id, r in zip(ids, requests)]


def discover(path: Path, exclude: Path | None = None, follow_links: bool = False,
             previous: dict[str, str] | None = None, limits: ConversionLimits = ConversionLimits(),
             skipped: Counter | None = None) -> list[Document | FileDocument]:
    """All documents of a job input; files of a folder are converted when first
    used (:class:`FileDocument`), a single document file at once (its failure is
    the input's: :class:`InputError`).

    Args:
        path: a folder (recursive, files with a suffix in :data:`SUFFIXES`;
            non-documents skipped, :func:`skip_reason`), a ``.jsonl`` file with
            one ``{"custom_id": ..., "text": ...}`` (or ``"id"``) per line, or one
            OpenAI batch request per line (:mod:`mlx_tier.job.batch_api`), or one
            document file.
        exclude: a folder inside ``path`` to skip (the job's output folder).
        follow_links: read links in the folder that lead outside it (default: skipped).
        previous: ``name -> id`` an earlier run of the job recorded (its
            journal): each name keeps its id (:func:`mlx_tier.job.naming.assign`).
        limits: how large and how long each file's conversion may get
            (:class:`~mlx_tier.job.convert_limits.ConversionLimits`).
        skipped: when given, a folder's files and folders left out are counted
            into it, by reason or suffix (:func:`skip_note` says them).

    Raises:
        InputError: path missing, nothing to read, malformed/duplicate JSONL line,
            a batch request file that fails the Batch API's checks.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    if path.is_dir():
        return _from_folder(path, Path(exclude).resolve() if exclude is not None else None, follow_links, previous,
                            limits, Counter() if skipped is None else skipped)
    if path.suffix.lower() == ".jsonl":
        return _from_jsonl(path, previous)
    if path.suffix.lower() in SUFFIXES:
        # named as a folder's file: the id an earlier run gave its name, and never one taken
        doc_id = assign([path.name], [safe_id(path.stem)], previous)[0]
        got = FileDocument(doc_id, str(path), path, name=path.name, limits=limits)  # a raise: an error
        if got.error:
            raise InputError(f"{path}: {got.error}")
        return [Document(got.id, got.source, got.text, name=got.name, converter=got.converter, stamp=got.stamp)]
    raise InputError(f"{path}: expected a folder of documents, a document file or a .jsonl file")
