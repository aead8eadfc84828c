"""What do normal documents unpack to and cost to convert, what do bombs cost, and what
does converting in a child process add per document?

Question: the limits in mlx_tier/job/convert_limits.py (the zip check before
conversion; memory and time of the converter process) must sit above every
normal document and below what a decompression bomb needs. For documents of
each kind at several sizes (made with tests/support/docmaker.py; DOCX and
EPUB deflated as Word and e-book tools write them) this prints what the check
sees (members, unpacked MiB, the largest member ratio), then seconds and the
converter process's peak resident memory (VmHWM, Linux) converting it in a
fresh process; then bombs under the default limits; then the cost of the
child process: its start, and one small DOCX converted in this process vs
through the warm worker (median of 9).

    python benches/conversion_limits.py [--big] [--skip-bombs]

``--big`` adds a 100,000-row spreadsheet (minutes). Prints the caliber first.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import docmaker  # noqa: E402

from mlx_tier.job import convert_sandbox  # noqa: E402
from mlx_tier.job.convert_limits import ConversionLimits  # noqa: E402
from mlx_tier.job.doc_text import convert_file  # noqa: E402

WORDS = ("river flood spring bank water report council budget revenue growth percent market quarter analysis "
         "the of and a to in is that for it as with was on be by this are from or at an have not they which").split()


def sentence(i: int, n: int = 40) -> str:
    """Sentence ``i``: ``n`` words drawn from WORDS (seeded by ``i``), as varied as prose deflates."""
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def normal_documents(folder: Path, big: bool) -> list[Path]:
    docs = []
    for pages in (1, 30, 300):
        paras = [f"# Chapter {p}" if i == 0 else sentence(p * 10 + i) for p in range(pages) for i in range(7)]
        docs.append(docmaker.docx(folder / f"word-{pages}p.docx", paras, compression=zipfile.ZIP_DEFLATED))
        docs.append(docmaker.epub(folder / f"book-{pages}ch.epub", "Book", [sentence(c) * 6 for c in range(pages)]))
    for slides in (5, 50, 200):
        docs.append(docmaker.pptx(folder / f"deck-{slides}.pptx", [(f"Slide {i}", sentence(i)) for i in range(slides)]))
    for rows in (100, 10_000) + ((100_000,) if big else ()):
        docs.append(docmaker.xlsx(folder / f"sheet-{rows}.xlsx", [[i, i * 0.37, WORDS[i % 40], sentence(i, 5)]
                                                                     for i in range(rows)]))
    docs.append(docmaker.pdf(folder / "page.pdf", [sentence(i, 10) for i in range(45)]))
    html = "<html><body>" + "".join(f"<h2>Part {i}</h2><p>{sentence(i, 80)}</p>" for i in range(3000)) + "</body></html>"
    (folder / "page.html").write_text(html)
    docs.append(folder / "page.html")
    return docs


def bombs(folder: Path) -> list[Path]:
    return [docmaker.docx_bomb(folder / "bomb-20MiB.docx", 20),
            docmaker.docx_bomb(folder / "bomb-6MiB.docx", 6),  # under the check's floor: the time limit's
            docmaker.pdf_stream_bomb(folder / "bomb-512MiB.pdf", 512, ["hello"])]


def zip_facts(path: Path) -> str:
    if not zipfile.is_zipfile(path):
        return f"{'':>5s} {'':>9s} {'':>7s}"
    with zipfile.ZipFile(path) as z:
        ms = [m for m in z.infolist() if not m.is_dir()]
    ratio = max(m.file_size / max(m.compress_size, 1) for m in ms)
    return f"{len(ms):5d} {sum(m.file_size for m in ms) / 2**20:9.2f} {ratio:7.1f}"


def peak_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")) / 1024


def convert_fresh(path: Path, limits: ConversionLimits) -> tuple[float, float, object]:
    """(seconds, worker peak MiB, Converted) on a fresh worker, started before the clock."""
    worker = convert_sandbox._WORKER
    worker.stop()
    worker._ensure_started()
    pid = worker._proc.pid
    t = time.perf_counter()
    got = convert_file(path, limits=limits)
    seconds = time.perf_counter() - t
    return seconds, peak_mib(pid), got


def table(paths: list[Path], limits: ConversionLimits) -> None:
    print(f"{'file':22s} {'KB':>8s} {'parts':>5s} {'unpacked':>9s} {'ratio':>7s} {'s':>7s} {'peak MiB':>8s}  result")
    for p in paths:
        seconds, peak, got = convert_fresh(p, limits)
        result = f"{len(got.text):,} chars" if got.text else got.error
        shown = f"{peak:8.0f}" if peak == peak else f"{'killed':>8s}"
        print(f"{p.name:22s} {p.stat().st_size / 1000:8.1f} {zip_facts(p)} {seconds:7.2f} {shown}  {result}", flush=True)


def overhead(folder: Path) -> None:
    doc = docmaker.docx(folder / "small.docx", [sentence(i) for i in range(20)], compression=zipfile.ZIP_DEFLATED)
    worker = convert_sandbox._WORKER
    starts = []
    for _ in range(3):
        worker.stop()
        t = time.perf_counter()
        worker._ensure_started()
        starts.append(time.perf_counter() - t)
    convert_file(doc, limits=ConversionLimits(isolate=False))  # this process's converters imported

    def median(limits: ConversionLimits) -> float:
        runs = []
        for _ in range(9):
            t = time.perf_counter()
            convert_file(doc, limits=limits)
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)

    here, there = median(ConversionLimits(isolate=False)), median(ConversionLimits())
    print(f"\nworker start (imports the converters): median of 3 {statistics.median(starts):.2f} s "
          f"({', '.join(f'{s:.2f}' for s in starts)})")
    print(f"small DOCX ({doc.stat().st_size / 1000:.1f} KB), median of 9: in this process {1000 * here:.1f} ms, "
          f"through the warm worker {1000 * there:.1f} ms (+{1000 * (there - here):.1f} ms per document)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", action="store_true", help="also a 100,000-row spreadsheet (minutes)")
    ap.add_argument("--skip-bombs", action="store_true")
    args = ap.parse_args()
    from importlib.metadata import version

    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    limits = ConversionLimits()
    print(f"caliber: {platform.platform()}, {os.cpu_count()} CPUs, load average {', '.join(f'{x:.1f}' for x in load)};"
          f" Python {platform.python_version()}, markitdown {version('markitdown')}; limits {limits};"
          " one run each (warm page cache); ratio = largest member's unpacked / packed size")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        table(normal_documents(folder, args.big), ConversionLimits(memory_mb=8192, seconds=3600))
        if not args.skip_bombs:
            print("\nbombs, default limits:")
            table(bombs(folder), limits)
        overhead(folder)
    convert_sandbox._WORKER.stop()


if __name__ == "__main__":
    main()
