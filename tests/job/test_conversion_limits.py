"""Converting a document is bounded: a zip-based file that would unpack to far more
than any normal document is refused before converting, and every conversion runs in
a child process killed past its memory or time limit. Either way that document fails
alone with the reason; the job goes on, and the next conversion gets a fresh process.
"""

import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import pytest
from support import docmaker
from support.jobs import _short_context, make_docs, small_moe  # noqa: F401 - fixtures

from mlx_tier.job import convert_limits, convert_sandbox
from mlx_tier.job.convert_limits import ConversionLimits, check_zip
from mlx_tier.job.doc_text import convert_file
from mlx_tier.job.run import JobConfig, run_job
from mlx_tier.job.scheduler import GenerationConfig
from mlx_tier.outdir.journal import Journal

MEMORY = "too large to convert: needed more than 300 MiB of memory (limit `convert_memory_mb`)"


def _check(path):
    with open(path, "rb") as f:
        return check_zip(f)


def _slow_docx(path):
    """~4 MiB of Word XML: under the check's floor, ~30 s to convert here."""
    return docmaker.docx(path, ["Slow going, line by line, page by page."], repeat=40_000,
                         compression=zipfile.ZIP_DEFLATED)


def test_a_docx_bomb_is_refused_before_converting(tmp_path, monkeypatch):
    bomb = docmaker.docx_bomb(tmp_path / "bomb.docx", 20)
    assert bomb.stat().st_size < 100_000  # 20 MiB of XML from a file under 100 KB
    monkeypatch.setattr(convert_sandbox, "convert", lambda *a: pytest.fail("converted a bomb"))
    got = convert_file(bomb)
    assert got.text is None
    assert got.error.startswith("too large when unpacked: word/document.xml is 20 MiB from ")
    assert got.error.endswith("KB (limit 100x its packed size past 8 MiB)")


def test_normal_zip_documents_of_every_kind_pass_the_check(tmp_path):
    words = "River flood spring farmer report council budget revenue growth market quarter. " * 8
    files = [
        docmaker.docx(tmp_path / "a.docx", [f"# Part {i}" if i % 7 == 0 else words for i in range(2000)],
                      compression=zipfile.ZIP_DEFLATED),
        docmaker.pptx(tmp_path / "b.pptx", [(f"Slide {i}", words) for i in range(60)]),
        docmaker.xlsx(tmp_path / "c.xlsx", [[i, i * 0.5, "river", None, "x"] for i in range(5_000)]),
        docmaker.epub(tmp_path / "d.epub", "Book", [words * 5] * 300),
    ]
    for f in files:
        assert _check(f) is None, f.name


def test_the_check_refuses_too_many_parts_and_too_much_in_all(tmp_path, monkeypatch):
    book = docmaker.epub(tmp_path / "book.epub", "Book", ["one", "two", "three"])  # 6 members
    monkeypatch.setattr(convert_limits, "MAX_MEMBERS", 5)
    assert _check(book) == "too many parts: 6 in one archive (limit 5)"
    big = docmaker.docx(tmp_path / "big.docx", ["Stored, not deflated."], repeat=40_000)  # ratio 1
    monkeypatch.setattr(convert_limits, "MAX_UNPACKED", 2**20)
    assert _check(big) == "too large when unpacked: 3 MiB from 3 MiB (limit 1 MiB)"
    (tmp_path / "not.docx").write_bytes(b"plain words, not a zip")
    (tmp_path / "cut.docx").write_bytes(big.read_bytes()[:5000])  # the central directory is cut off
    assert _check(tmp_path / "not.docx") is None and _check(tmp_path / "cut.docx") is None  # the converter says why


def test_normal_documents_of_every_kind_convert_in_one_process(tmp_path):
    files = {
        "a.pdf": docmaker.pdf(tmp_path / "a.pdf", ["Quarterly river report."]),
        "b.docx": docmaker.docx(tmp_path / "b.docx", ["# River", "Flood in spring."], compression=zipfile.ZIP_DEFLATED),
        "c.pptx": docmaker.pptx(tmp_path / "c.pptx", [("River", "Flood in spring.")]),
        "d.xlsx": docmaker.xlsx(tmp_path / "d.xlsx", [["river", 4.81]]),
        "e.epub": docmaker.epub(tmp_path / "e.epub", "Book", ["River flood in spring."]),
    }
    (tmp_path / "f.html").write_text("<html><body><p>River flood.</p></body></html>")
    files["f.html"] = tmp_path / "f.html"
    convert_file(files["a.pdf"])  # the worker is running from here on
    starts = convert_sandbox._WORKER.starts
    for name, path in files.items():
        got = convert_file(path)
        assert got.error is None and "river" in got.text.lower(), (name, got)
    assert convert_sandbox._WORKER.starts == starts  # one process served them all


def test_a_pdf_stream_bomb_fails_alone_past_the_memory_limit(tmp_path):
    bomb = docmaker.pdf_stream_bomb(tmp_path / "bomb.pdf", 128, ["hello"])  # 128 MiB from ~130 KB
    limits = ConversionLimits(memory_mb=300)
    got = convert_file(bomb, limits=limits)
    assert got.text is None and got.error == MEMORY
    small = docmaker.pdf_stream_bomb(tmp_path / "small.pdf", 4, ["River flood."])  # a normal amount of spaces
    assert convert_file(small, limits=limits).text.strip() == "River flood."  # a fresh worker


def test_a_conversion_past_its_time_limit_fails_alone(tmp_path):
    slow = _slow_docx(tmp_path / "slow.docx")
    assert _check(slow) is None  # the check lets it through: the time limit stops it
    convert_file(docmaker.docx(tmp_path / "warm.docx", ["Warm up."]))  # start the worker first
    t = time.monotonic()
    got = convert_file(slow, limits=ConversionLimits(seconds=1, seconds_per_mb=0))
    assert got.text is None and got.error == "conversion took longer than 1 s (limit `convert_seconds`)"
    assert time.monotonic() - t < 15  # not the ~30 s the conversion takes
    assert "Warm up." in convert_file(tmp_path / "warm.docx").text


def test_the_time_limit_grows_with_the_file():
    limits = ConversionLimits(seconds=60, seconds_per_mb=30)
    assert limits.seconds_for(0) == 60 and limits.seconds_for(2_000_000) == 120
    with pytest.raises(ValueError, match="positive"):
        ConversionLimits(memory_mb=0)


def test_a_killed_worker_is_replaced_and_ctrl_c_does_not_reach_it(tmp_path):
    doc = docmaker.docx(tmp_path / "a.docx", ["Still here."])
    assert "Still here." in convert_file(doc).text
    worker = convert_sandbox._WORKER._proc.pid
    assert os.getsid(worker) != os.getsid(0)  # a session of its own: the terminal's SIGINT is the job's
    os.kill(worker, signal.SIGKILL)
    assert "Still here." in convert_file(doc).text  # an idle worker found dead: the document is not failed


def test_the_worker_stops_converting_when_the_job_dies(tmp_path):
    """The job's process killed mid-conversion: its converter process exits too."""
    slow = _slow_docx(tmp_path / "slow.docx")
    script = ("import sys, threading, time; from pathlib import Path\n"
              "from mlx_tier.job import convert_sandbox; from mlx_tier.job.doc_text import convert_file\n"
              "threading.Thread(target=convert_file, args=(Path(sys.argv[1]),), daemon=True).start()\n"
              "w = convert_sandbox._WORKER\n"
              "while w._sock is None or w._sock.gettimeout() != convert_sandbox.POLL_SECONDS: time.sleep(0.05)\n"
              "print(w._proc.pid, flush=True); time.sleep(600)\n")  # printed once the request is in flight
    job = subprocess.Popen([sys.executable, "-c", script, str(slow)], stdout=subprocess.PIPE, text=True)
    worker = int(job.stdout.readline())
    time.sleep(1)
    assert _alive(worker)  # converting (~30 s of work)
    job.kill()
    job.wait()
    deadline = time.monotonic() + 20
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_job_with_bombs_among_good_documents_finishes_the_good_ones(tmp_path, small_moe):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 2)
    docmaker.docx_bomb(docs / "bomb.docx", 20)
    docmaker.pdf_stream_bomb(docs / "stream.pdf", 128, ["hello"])
    config = JobConfig(input=docs, out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=4),
                       conversion=ConversionLimits(memory_mb=300))
    report = run_job(config)
    states = {r.id: r.status for r in report.results}
    assert states == {"doc00": "done", "doc01": "done", "bomb": "failed", "stream": "failed"}
    records = Journal(out).records()
    assert records["bomb"]["error"].startswith("too large when unpacked: word/document.xml is 20 MiB")
    assert records["stream"]["error"] == MEMORY
    reported = {d["id"]: d for d in json.loads((out / "report.json").read_text())["documents"]}
    assert reported["stream"]["error"] == MEMORY and (out / "doc00.md").is_file()


def test_the_reasons_name_their_flags_on_the_command_line():
    from mlx_tier.cli.render import as_flags

    assert as_flags(MEMORY).endswith("(limit --convert-memory-mb)")
    assert as_flags("(limit `convert_seconds`)") == "(limit --convert-seconds)"
