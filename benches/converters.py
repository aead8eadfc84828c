"""Which document converter: MarkItDown or docling, on the same small documents.

Question: for the formats `mlx-tier run` reads (PDF, DOCX, PPTX, XLSX, HTML,
EPUB), what text does each library give, how long does it take, and does it
work offline (no model downloads)? Install weight is measured separately
(benches/results/converters/NOTES.md: a scratch venv per library, `du -sh`).

Run it in a venv that has the library (the documents are generated here with
tests/support/docmaker.py, which needs python-pptx and openpyxl):

    python benches/converters.py markitdown
    python benches/converters.py docling

Prints the caliber (machine, library version, load average), then per
document: seconds (first call includes the library's warm-up), characters,
and the text (first 200 characters), or the error.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import docmaker  # noqa: E402 - after the path above

HTML = ("<html><head><title>T</title><script>var tracking = 1;</script><style>p{color:red}</style></head>"
        "<body><nav>Home | About</nav><h1>News</h1><p>Rain in <b>Paris</b> on Monday; 4.81 mm fell.</p>"
        "<table><tr><th>day</th><th>mm</th></tr><tr><td>Mon</td><td>4.81</td></tr></table></body></html>")


def make(folder: Path) -> list[Path]:
    (folder / "news.html").write_text(HTML)
    return [
        docmaker.pdf(folder / "report.pdf", ["Quarterly report", "Revenue grew 4.81 percent in Q3.",
                                             "Costs fell; margins rose."]),
        docmaker.docx(folder / "minutes.docx", ["# Minutes", "The board met on Monday.", "It approved the budget."]),
        docmaker.pptx(folder / "plan.pptx", [("Plan", "Ship in May"), ("Risks", "Supply delays")]),
        docmaker.xlsx(folder / "cities.xlsx", [["city", "population"], ["Oslo", 709000], ["Bergen", 291000]]),
        docmaker.epub(folder / "book.epub", "Book", ["Chapter one: the river.", "Chapter two: the sea."]),
        folder / "news.html",
    ]


def markitdown_convert():
    import markitdown.converters as c
    from markitdown import MarkItDown, StreamInfo

    kinds = {".pdf": c.PdfConverter, ".docx": c.DocxConverter, ".pptx": c.PptxConverter,
             ".xlsx": c.XlsxConverter, ".epub": c.EpubConverter, ".html": c.HtmlConverter}

    def convert(path: Path) -> str:
        md = MarkItDown(enable_builtins=False, enable_plugins=False)
        md.register_converter(kinds[path.suffix]())
        return md.convert_local(str(path), stream_info=StreamInfo(extension=path.suffix)).markdown

    return convert, f"markitdown {version('markitdown')}"


def docling_convert():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # this machine reaches no model hub: say so, don't hang
    from docling.document_converter import DocumentConverter

    converter = DocumentConverter()

    def convert(path: Path) -> str:
        return converter.convert(str(path)).document.export_to_markdown()

    return convert, f"docling {version('docling')}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("library", choices=["markitdown", "docling"])
    args = parser.parse_args()
    convert, name = markitdown_convert() if args.library == "markitdown" else docling_convert()
    print(f"# {name}; {platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.2f}; one run per document, first call includes warm-up")
    with tempfile.TemporaryDirectory() as tmp:
        for path in make(Path(tmp)):
            t0 = time.perf_counter()
            try:
                text, error = convert(path), None
            except Exception as e:  # noqa: BLE001 - report and go on
                text, error = "", f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
            seconds = time.perf_counter() - t0
            shown = error or text[:200].replace("\n", " / ")
            print(f"{path.suffix:6} {seconds:6.2f} s {len(text):5d} chars  {shown}")


if __name__ == "__main__":
    main()
