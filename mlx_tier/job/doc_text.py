"""Document text from a file: plain text in any common encoding, other formats
through MarkItDown.

- Text files (:data:`TEXT_SUFFIXES`): a byte-order mark decides (UTF-8, UTF-16,
  UTF-32; the mark itself is dropped); else strict UTF-8; else the encoding
  charset-normalizer finds (cp1252, Latin-1, Shift-JIS, …). Only bytes that no
  text encoding explains are refused, as binary.
- PDF, Word, PowerPoint, Excel, HTML, EPUB, Jupyter and Outlook files
  (:data:`CONVERTED_SUFFIXES`): Microsoft's MarkItDown
  (https://github.com/microsoft/markitdown) turns them into Markdown text.
  Its format libraries come with the ``documents`` extra
  (``pip install 'mlx-tier[documents]'``); without them such a file fails
  alone with a message naming the extra.

Converted kinds are bounded (:mod:`mlx_tier.job.convert_limits`): a zip-based
file whose parts would unpack to far more than any normal document is refused
before conversion, and each conversion runs in a child process killed past its
memory or time limit (:mod:`mlx_tier.job.convert_sandbox`); either way that
document fails alone, with the reason.

MarkItDown was chosen over docling on install weight and on needing no model
downloads at run time (docs/documents.md).
"""

from __future__ import annotations

import codecs
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mlx_tier.fsio import open_inside
from mlx_tier.job.convert_limits import ConversionLimits, check_zip, is_zip

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".text", ".rst")
# Suffix -> the MarkItDown converter for it. Only that one is tried: MarkItDown's
# own dispatch falls back to reading a file it failed to convert as plain text.
CONVERTED_SUFFIXES = {
    ".pdf": "PdfConverter", ".docx": "DocxConverter", ".pptx": "PptxConverter", ".xlsx": "XlsxConverter",
    ".xls": "XlsConverter", ".html": "HtmlConverter", ".htm": "HtmlConverter", ".xhtml": "HtmlConverter",
    ".epub": "EpubConverter", ".ipynb": "IpynbConverter", ".msg": "OutlookMsgConverter",
}
SUFFIXES = TEXT_SUFFIXES + tuple(CONVERTED_SUFFIXES)


def reading_route(path: str | Path | None) -> str:
    """How a document's text is read from its file: its MarkItDown converter's name (by
    suffix, :data:`CONVERTED_SUFFIXES`), else ``"text"`` (a text suffix, a listed file of
    another suffix, a JSONL line: ``path`` ``None``). The same bytes read another way are
    another text: ``<p>notes</p>`` in ``a.txt`` is not the text of ``a.html``."""
    if path is None:
        return "text"
    return CONVERTED_SUFFIXES.get(Path(path).suffix.lower(), "text")
# What converting one file may raise and fail that file alone (the caller catches it:
# mlx_tier.job.documents.FileDocument): any Exception, since third-party converters raise
# RuntimeError, ValueError or their own classes; MemoryError is re-raised there, and
# KeyboardInterrupt and SystemExit are not Exceptions, so they still stop the job.
CONVERSION_ERRORS: tuple[type[BaseException], ...] = (Exception,)
EXTRA_HINT = "pip install 'mlx-tier[documents]'"
# Longest BOM first: UTF-32-LE's mark starts with UTF-16-LE's.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"), (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"),
)


@dataclass(frozen=True)
class Converted:
    """A file's text, or why there is none.

    Attributes:
        text: the document's text (``str``), ``None`` when unusable.
        error: why it cannot be summarised, ``None`` when ``text`` is set.
        converter: how the text was obtained: ``text (utf-8)``,
            ``text (cp1252)``, ``markitdown 0.1.3``…; ``None`` when nothing fit.
    """

    text: str | None
    error: str | None = None
    converter: str | None = None


def _binary(text: str) -> bool:
    """Whether decoded text is mostly control characters (a binary file some 8-bit table accepts)."""
    bad = sum(1 for c in text if c < " " and c not in "\t\n\r\f\v" or c == "\x7f")
    return bad > max(2, len(text) // 100)


_SURROGATE = re.compile("[\ud800-\udfff]")


def surrogate_at(text: str) -> int | None:
    """Index of the first lone surrogate in ``text`` (JSON's ``"\\ud800"`` escape gives one:
    not a character, no UTF-8 encodes it, no tokenizer takes it), ``None`` without."""
    found = _SURROGATE.search(text)
    return found.start() if found else None


def decode_text(data: bytes) -> Converted:
    """The text of ``data`` (a text file's bytes) in whatever common encoding it is.

    Order: a byte-order mark (dropped from the text); strict UTF-8; UTF-8 with a
    few stray bytes read as cp1252 (:func:`_mostly_utf8`); the best match of
    charset-normalizer (https://github.com/jawah/charset_normalizer), named by
    Python's codec name (``"utf-8"``, ``"cp1252"``).
    The result is refused as binary when no encoding explains the bytes or the
    text is mostly control characters; ``"empty document"`` when it is blank.
    """
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return _checked(data[len(bom):].decode(encoding), f"text ({encoding}, BOM)")
            except UnicodeDecodeError as e:
                return Converted(None, f"not valid {encoding} text after its byte-order mark (byte {e.start + len(bom)})")
    if b"\x00" not in data:
        try:
            return _checked(data.decode("utf-8"), "text (utf-8)")
        except UnicodeDecodeError:
            mixed = _mostly_utf8(data)
            if mixed is not None:
                return _checked(*mixed)
    from charset_normalizer import from_bytes

    matches = from_bytes(data)
    best = matches.best()
    if best is None:
        return Converted(None, "binary file, not text (no text encoding fits its bytes)")
    # Short Western texts fit many 8-bit tables equally well; among the equally
    # good ones, Windows' Western default (cp1252, a superset of Latin-1's printable
    # range) is the likely one. So is it where read as cp1252 the text is plainly
    # Western (:func:`_western`): charset-normalizer takes "Ć120 for the cafķ" (cp775)
    # over "€120 for the café".
    tied = {enc for m in matches if m.chaos <= best.chaos + 0.01 for enc in m.could_be_from_charset}
    fits = {enc for m in matches for enc in m.could_be_from_charset}
    if best.encoding != "cp1252" and ("cp1252" in tied or ("cp1252" in fits and _western(data))):
        try:
            return _checked(data.decode("cp1252"), "text (cp1252)")
        except UnicodeDecodeError:
            pass
    name = codecs.lookup(best.encoding).name
    if name.startswith(("utf-16", "utf-32")) and not _spaced(str(best)):
        return Converted(None, f"binary file, not text (read as {name} without a byte-order mark, it has no "
                              "spaces or line breaks)")
    return _checked(str(best), f"text ({name})")


# What cp1252 text of a Western European language holds beyond ASCII besides letters:
# cp1252's punctuation (€ ‚ „ … † ‡ ‰ ‹ › ‘ ’ “ ” • – — ™) and Latin-1's signs.
_WESTERN_SIGNS = frozenset("€‚„…†‡‰‹›‘’“”•–—™\xa0¡¢£¤¥¦§¨©ª«¬\xad®¯°±²³´µ¶·¸¹º»¼½¾¿×÷")
_IN_WORDS = frozenset("’·\xad")  # signs that do sit between letters: don’t, Catalan l·l, a soft hyphen
# Three letters beyond ASCII in a row: rare in Western words (größte, créée, ações have two),
# the rule in a Cyrillic, Greek or Hebrew word read as cp1252 (ч and ё read as ÷ and ¸: signs).
_FOREIGN_RUN = re.compile(r"(?:[^\x00-\x7f]){3}")


def _western(data: bytes) -> bool:
    """Whether ``data`` read as cp1252 is plainly Western European text: it decodes, its
    letters are mostly ASCII (at most 1 in 4 beyond: a Cyrillic or Greek text read as
    cp1252 is all accented letters), no three characters beyond ASCII stand in a row (a
    Cyrillic word in an English text), and each other character beyond ASCII is one of
    :data:`_WESTERN_SIGNS`, not inside a word (Polish "wiêcej" read from cp1250 has "³"
    and "¹" between letters)."""
    try:
        text = data.decode("cp1252")
    except UnicodeDecodeError:
        return False
    letters = [c for c in text if c.isalpha()]
    beyond = sum(1 for c in letters if not c.isascii())
    if not beyond and text.isascii() or beyond * 4 > len(letters):
        return False
    if _FOREIGN_RUN.search(text):  # "Ñåâåðíûé": a Cyrillic word in an English text read as cp1252
        return False
    for k, c in enumerate(text):
        if c.isascii() or c.isalpha():
            continue
        inside = 0 < k < len(text) - 1 and text[k - 1].isalpha() and text[k + 1].isalpha()
        if c not in _WESTERN_SIGNS or (inside and c not in _IN_WORDS):
            return False
    return True


# Word and sentence breaks of any script: real text has them, binary bytes read as 2- or
# 4-byte units almost never do (each is one of 65,536 code points or more).
_BREAKS = frozenset(" \t\n\r,.;:!?\u3000\u3001\u3002\uff01\uff0c\uff0e\uff1a\uff1b\uff1f\u060c\u0964")


def _spaced(text: str) -> bool:
    """Whether ``text`` reads as text (UTF-16/32 without a byte-order mark fits almost any
    bytes of even length): all printable ASCII (Latin text in 2-byte units), or a space,
    line break or punctuation mark every 200 characters."""
    if text.isascii() and all(c.isprintable() or c in "\t\n\r" for c in text):
        return True
    return sum(c in _BREAKS for c in text) >= max(1, len(text) // 200)


def _mostly_utf8(data: bytes) -> tuple[str, str] | None:
    """``(text, converter)`` of UTF-8 text with a few bytes that are not UTF-8 (a Windows
    "smart quote", a euro sign or a Latin-1 letter pasted in), each such byte read as
    Windows-1252 (cp1252; U+FFFD where it defines none); ``None`` when the bytes are not
    mostly UTF-8: fewer characters in valid multi-byte sequences than stray bytes (then
    the file is in another encoding, and reading all of it as one 8-bit table would
    garble every letter that UTF-8 wrote right)."""
    text = data.decode("utf-8", errors="surrogateescape")  # each stray byte: a lone surrogate U+DC80..U+DCFF
    stray = sum(1 for c in text if _stray(c))
    valid = sum(1 for c in text if c >= "\x80" and not _stray(c) and not _cp1252_pair(c))
    if valid < max(1, stray):
        return None
    fixed = "".join(bytes([ord(c) - 0xDC00]).decode("cp1252", errors="replace") if _stray(c) else c for c in text)
    return fixed, f"text (utf-8, {stray} byte{'' if stray == 1 else 's'} not UTF-8 read as cp1252)"


def _stray(c: str) -> bool:
    """Whether ``c`` stands for a byte that was not UTF-8 (``surrogateescape``: U+DC80..U+DCFF)."""
    return "\udc80" <= c <= "\udcff"


# Second bytes that make a cp1252 letter (À..ß, à..ÿ: 0xC4 and up) and the punctuation after
# it (“ ” – — ™ nbsp « ° »...) look like one 2-byte UTF-8 character ("CAFÉ”" is C9 94: "ɔ").
_CP1252_PUNCTUATION = frozenset(range(0x80, 0xA1)) | {0xAB, 0xB0, 0xBB}


def _cp1252_pair(c: str) -> bool:
    """Whether the UTF-8 character ``c`` may as well be a cp1252 letter and the punctuation
    after it: no evidence that the text is UTF-8."""
    b = c.encode("utf-8")
    return len(b) == 2 and b[0] >= 0xC4 and b[1] in _CP1252_PUNCTUATION


def _checked(text: str, converter: str) -> Converted:
    if _binary(text):
        return Converted(None, "binary file, not text (mostly control characters)")
    if not text.strip():
        return Converted(None, "empty document", converter)
    return Converted(text, None, converter)


@functools.cache
def _markitdown(kind: str):
    """A MarkItDown that knows only the converter class ``kind`` (no plugins, no fallbacks)."""
    import markitdown.converters
    from markitdown import MarkItDown

    md = MarkItDown(enable_builtins=False, enable_plugins=False)
    md.register_converter(getattr(markitdown.converters, kind)())
    return md


def _markitdown_version() -> str:
    from importlib.metadata import version

    return version("markitdown")


def _escaped(path: Path, inside: Path) -> str | None:
    """Why ``path`` may no longer be read as a file of the folder ``inside``, or ``None``."""
    real = path.resolve()
    if not real.is_relative_to(inside):
        return (f"now a link leading outside the input folder (to {real}); not read "
                "(set `follow_links` to read such links)")
    return None


def open_document(path: Path, inside: Path | None = None) -> int | str:
    """A read-only descriptor of the document file ``path``, or why it cannot be read.

    Args:
        path: the file.
        inside: as for :func:`convert_file`: the real folder it must still lie
            in, opened one folder at a time without following a link; ``None``:
            links are followed.

    Returns:
        the descriptor (the caller closes it), or the reason as text
        (``"cannot read: Permission denied"``, a link now leading outside).
    """
    if inside is not None:
        if (escaped := _escaped(path, inside)) is not None:
            return escaped
        path = path.resolve()  # its real path: no link left to follow (open_inside refuses one)
    try:
        return open_inside(inside, path) if inside is not None else os.open(path, os.O_RDONLY)
    except ValueError:  # resolved through a link swapped in since the check
        return "cannot read: now outside the input folder"
    except OSError as e:
        return f"cannot read: {e.strerror}"


def convert_file(path: Path, inside: Path | None = None, limits: ConversionLimits = ConversionLimits()) -> Converted:
    """The text of the file at ``path``, chosen by its suffix (module doc).

    Args:
        path: the file.
        inside: the real folder the file must lie in (the job's INPUT): a file
            replaced since by a link leading out of it is refused, not read,
            and the file is opened through its resolved path one folder at a
            time without following a link (:func:`mlx_tier.fsio.open_inside`),
            so that nothing outside is read even if a folder is swapped for a
            link meanwhile. ``None``: links are followed (``follow_links``, a
            single file).
        limits: how large and how long a converted kind's conversion may get.

    Returns a :class:`Converted` with ``error`` set (never raises for the
    file's content): unreadable, binary, empty, a link out of ``inside``, a
    converter that failed, too large when unpacked, over the memory or time
    limit, or the ``documents`` extra missing (the message says what to install).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    fd = open_document(path, inside)
    if isinstance(fd, str):
        return Converted(None, fd)
    with os.fdopen(fd, "rb") as f:
        if suffix in CONVERTED_SUFFIXES and os.fstat(f.fileno()).st_size == 0:  # no PDF/Word/... has no bytes
            return Converted(None, "empty document (0 bytes)")
        if suffix not in CONVERTED_SUFFIXES:
            try:
                return decode_text(f.read())
            except OSError as e:
                return Converted(None, f"cannot read: {e.strerror}")
        return _convert_bounded(f, path.name, suffix, limits)


def _convert_bounded(stream: BinaryIO, name: str, suffix: str, limits: ConversionLimits) -> Converted:
    """A converted kind's text within ``limits`` (module doc): the zip check, then
    the conversion in the child process (or here when ``limits.isolate`` is off)."""
    if not _converters_installed():
        return Converted(None, f"{suffix} files need the document converters: {EXTRA_HINT}")
    if is_zip(stream) and (why := check_zip(stream)) is not None:
        return Converted(None, why)
    if not limits.isolate:
        return convert_stream(stream, name, suffix)
    from mlx_tier.job import convert_sandbox

    size = os.fstat(stream.fileno()).st_size
    got = convert_sandbox.convert(stream.fileno(), name, suffix, size, limits)
    return Converted(got.get("text"), got.get("error"), got.get("converter"))


# An Office Open XML file (.docx, .pptx, .xlsx) saved with a password is not a zip
# but an OLE compound file holding the encrypted package (MS-OFFCRYPTO).
_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"
_OOXML = (".docx", ".pptx", ".xlsx")


def _converters_installed() -> bool:
    """Whether MarkItDown is installed (the ``documents`` extra), without importing it."""
    import importlib.util

    return importlib.util.find_spec("markitdown") is not None


def load_converters() -> None:
    """Import MarkItDown and its converters now (the converter process does this
    before its first time limit starts); without the ``documents`` extra, nothing."""
    for kind in dict.fromkeys(CONVERTED_SUFFIXES.values()):
        try:
            _markitdown(kind)
        except ImportError:
            return


def convert_stream(stream: BinaryIO, name: str, suffix: str) -> Converted:
    """The text of a :data:`CONVERTED_SUFFIXES` file, open as ``stream``, through
    MarkItDown, in this process and without limits (errors as :func:`convert_file`;
    ``name`` is the file's name).

    Raises:
        MemoryError: the converter ran out of memory (also when MarkItDown
            wrapped it in its own exception): the caller decides what that stops.
    """
    kind = CONVERTED_SUFFIXES[suffix]
    if suffix in _OOXML and stream.read(len(_OLE_MAGIC)) == _OLE_MAGIC:
        return Converted(None, "password-protected (encrypted): save it without a password to summarise it")
    stream.seek(0)
    try:
        converter = _markitdown(kind)
    except ImportError:
        return Converted(None, f"{suffix} files need the document converters: {EXTRA_HINT}")
    label = f"markitdown {_markitdown_version()} {kind}"
    try:
        from markitdown import StreamInfo

        result = converter.convert_stream(stream, stream_info=StreamInfo(extension=suffix, filename=name))
    except Exception as e:  # noqa: BLE001 - any converter failure fails this document alone
        _reraise_memory_error(e)
        return Converted(None, _failure(e, suffix), label)
    text = result.markdown or ""
    if surrogate_at(text) is not None:  # a notebook's "\ud800" escape: not a character
        text, n = _SURROGATE.subn("\ufffd", text)  # as an HTML parser reads &#xD800;
        label += f", {n} lone surrogate{'' if n == 1 else 's'} read as U+FFFD"
    if not text.strip():
        return Converted(None, "no text found (a scanned PDF needs OCR first)" if suffix == ".pdf"
                         else "empty document", label)
    return Converted(text, None, label)


def _reraise_memory_error(e: Exception) -> None:
    """Raise MemoryError when ``e`` is MarkItDown's wrapping of one (its ``attempts``)."""
    for attempt in getattr(e, "attempts", None) or ():
        info = getattr(attempt, "exc_info", None)
        if info is not None and issubclass(info[0], MemoryError):
            raise MemoryError(str(info[1])) from e


def _failure(e: Exception, suffix: str) -> str:
    """Why converting failed with ``e``, in one line."""
    if type(e).__name__ == "MissingDependencyException":
        return f"{suffix} files need the document converters: {EXTRA_HINT}"
    if isinstance(e, OSError):
        return f"cannot read: {e.strerror or e}"
    lines = str(e).strip().splitlines()  # MarkItDown lists its attempts, one a line
    reason = lines[-1].strip().lstrip("- ") if lines else type(e).__name__
    return f"cannot convert ({type(e).__name__}): {reason}"
