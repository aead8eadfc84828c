"""Small documents of each kind, built in the test (no binary fixtures committed).

PDF and DOCX/EPUB are written by hand (the smallest valid files: a one-page
PDF with Helvetica text, a DOCX/EPUB zip with the parts readers need);
PPTX and XLSX with python-pptx and openpyxl, the libraries MarkItDown reads them with.
Also decompression bombs: a DOCX whose XML, a PDF whose content stream inflates
to many MiB from a few KB.
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path


def _text_ops(lines: list[str]) -> bytes:
    text = " ".join(f"({s.replace('(', '[').replace(')', ']')}) Tj T*" for s in lines)
    return f"BT /F1 12 Tf 14 TL 72 720 Td {text} ET".encode()


def pdf(path: Path, lines: list[str]) -> Path:
    """A one-page PDF showing ``lines`` (ASCII) in Helvetica; xref offsets computed."""
    return _pdf(path, _text_ops(lines), b"")


def pdf_stream_bomb(path: Path, mib: int, lines: list[str]) -> Path:
    """A valid one-page PDF whose content stream is ``mib`` MiB of spaces, then ``lines``,
    deflated (/FlateDecode): ~1 KB on disk per MiB it inflates to."""
    deflate = zlib.compressobj(9)
    spaces = b" " * 2**20
    body = b"".join(deflate.compress(spaces) for _ in range(mib)) + deflate.compress(_text_ops(lines))
    return _pdf(path, body + deflate.flush(), b" /Filter /FlateDecode")


def _pdf(path: Path, stream: bytes, filters: bytes) -> Path:
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d%s >>\nstream\n" % (len(stream), filters) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    path.write_bytes(bytes(out))
    return path


_W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def _para(p: str) -> str:
    from xml.sax.saxutils import escape

    style = '<w:pPr><w:pStyle w:val="Heading1"/></w:pPr>' if p.startswith("# ") else ""
    return f"<w:p>{style}<w:r><w:t xml:space=\"preserve\">{escape(p.removeprefix('# '))}</w:t></w:r></w:p>"


def docx(path: Path, paragraphs: list[str], repeat: int = 1, compression: int = zipfile.ZIP_STORED) -> Path:
    """A Word document with one paragraph per entry (a heading first when it starts with '# '),
    the whole list ``repeat`` times over; parts stored, or deflated (``zipfile.ZIP_DEFLATED``)
    as Word writes them."""
    body = "".join(map(_para, paragraphs)) * repeat
    ns = _W
    with zipfile.ZipFile(path, "w", compression) as z:
        z.writestr("[Content_Types].xml",
                   '<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
                   '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
                   '<Default Extension="xml" ContentType="application/xml"/>'
                   '<Override PartName="/word/document.xml" ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/></Types>')
        z.writestr("_rels/.rels",
                   '<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
                   '<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/officeDocument" Target="word/document.xml"/></Relationships>')
        z.writestr("word/document.xml",
                   f'<?xml version="1.0" encoding="UTF-8"?><w:document {ns}><w:body>{body}</w:body></w:document>')
    return path


def docx_bomb(path: Path, mib: float) -> Path:
    """A valid Word document whose word/document.xml is ``mib`` MiB of one repeated paragraph,
    deflated: ~3 KB on disk per MiB it unpacks to (a decompression bomb)."""
    para = "Bombs away, again and again."
    return docx(path, [para], repeat=round(mib * 2**20 / len(_para(para))), compression=zipfile.ZIP_DEFLATED)


def pptx(path: Path, slides: list[tuple[str, str]]) -> Path:
    """A slide deck: one (title, body) per slide."""
    from pptx import Presentation

    deck = Presentation()
    for title, body in slides:
        slide = deck.slides.add_slide(deck.slide_layouts[1])
        slide.shapes.title.text = title
        slide.placeholders[1].text = body
    deck.save(path)
    return path


def xlsx(path: Path, rows: list[list]) -> Path:
    """A one-sheet workbook with ``rows``."""
    from openpyxl import Workbook

    book = Workbook()
    for row in rows:
        book.active.append(row)
    book.save(path)
    return path


def epub(path: Path, title: str, chapters: list[str]) -> Path:
    """An EPUB 3 book with one XHTML chapter per entry."""
    items = "".join(f'<item id="c{i}" href="c{i}.xhtml" media-type="application/xhtml+xml"/>' for i in range(len(chapters)))
    spine = "".join(f'<itemref idref="c{i}"/>' for i in range(len(chapters)))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("mimetype", "application/epub+zip", compress_type=zipfile.ZIP_STORED)
        z.writestr("META-INF/container.xml",
                   '<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
                   '<rootfiles><rootfile full-path="content.opf" media-type="application/oebps-package+xml"/></rootfiles></container>')
        z.writestr("content.opf",
                   '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0" unique-identifier="id">'
                   f'<metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:identifier id="id">x</dc:identifier>'
                   f'<dc:title>{title}</dc:title><dc:language>en</dc:language></metadata>'
                   f'<manifest>{items}</manifest><spine>{spine}</spine></package>')
        for i, text in enumerate(chapters):
            z.writestr(f"c{i}.xhtml", '<?xml version="1.0"?><html xmlns="http://www.w3.org/1999/xhtml"><head>'
                       f"<title>c{i}</title></head><body><p>{text}</p></body></html>")
    return path
