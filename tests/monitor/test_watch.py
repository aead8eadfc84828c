"""The job's page shows what the job's files say, and never writes them.

Guarded here: the numbers shown equal the journal's; each chart has one point
per document record that carries a sample; a journal line appended while the
page is open shows up within the poll interval (plus a stated render slack);
the static report.html and the live page render in a real browser (the
system's headless Chromium, driven by Selenium) with no console error, and fit
a phone-width window; the watch server leaves OUT_DIR exactly as it found it.
Browser tests skip, saying why, only where no Chromium is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.jobs import WORDS, small_moe  # noqa: F401 - fixtures
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.messages import retry_command
from mlx_tier.monitor.page import render_page
from mlx_tier.monitor.server import WatchConfig, is_loopback, make_server, url_of
from mlx_tier.monitor.view import build_view, samples
from mlx_tier.outdir.journal import JobInfo, Journal

runner = CliRunner()
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage")
RENDER_SLACK_S = 3.0  # time allowed beyond the poll interval: a render on a loaded 2-core machine
needs_browser = pytest.mark.skipif(
    not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
    reason="no Chromium: install the Debian packages chromium and chromium-driver (.ci/run does)",
)


def run_small_job(root: Path, model: Path, n: int = 5) -> Path:
    """A finished job: ``n`` documents done and one (an empty file) failed."""
    from mlx_tier.job.run import JobConfig, run_job
    from mlx_tier.job.scheduler import GenerationConfig

    docs, out = root / "docs", root / "out"
    docs.mkdir()
    for i in range(n):
        (docs / f"doc{i:02d}.txt").write_text(" ".join(WORDS[(i + k) % len(WORDS)] for k in range(8)) + ".")
    (docs / "empty.txt").write_text("")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("mlx_tier.job.model_setup.FALLBACK_CONTEXT", 256)  # the tiny checkpoint states none
        run_job(JobConfig(input=docs, out_dir=out, model=model, generation=GenerationConfig(max_tokens=16),
                          command=f"mlx-tier run {docs} --out {out}"))
    return out


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, small_moe) -> Path:  # noqa: F811 - the shared fixture
    return run_small_job(tmp_path_factory.mktemp("job"), small_moe)


@pytest.fixture()
def job_copy(job_dir, tmp_path) -> Path:
    """A copy of the finished job that a test may append to."""
    return Path(shutil.copytree(job_dir, tmp_path / "out"))


def journal_counts(out: Path) -> dict:
    latest = Journal(out).records()
    return {s: sum(r.get("status") == s for r in latest.values()) for s in ("done", "failed")}


def snapshot(folder: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


@pytest.fixture()
def serve():
    """Start watch servers in threads; stop them at the end of the test."""
    servers = []

    def start(out: Path, interval_s: float = 2.0) -> str:
        server = make_server(WatchConfig(out, port=0, interval_s=interval_s))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return url_of(server)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- what the view says


def test_samples_give_rates_between_documents_and_restart_with_each_run():
    entries = [
        {"event": "start", "ids": ["a", "b", "c"]},
        {"id": "a", "status": "done", "time": 10.0,
         "sample": {"decode_tok_s": 5.0, "tokens": 10, "hits": 6, "misses": 2, "bytes_read": 2000}},
        {"event": "thermal", "time": 11.0, "duty": 0.5},
        {"id": "b", "status": "done", "time": 20.0,
         "sample": {"decode_tok_s": 4.0, "tokens": 30, "hits": 9, "misses": 3, "bytes_read": 6000}},
        {"id": "old", "status": "done", "time": 21.0},  # a record of an older version: no sample, no point
        {"event": "start", "ids": ["a", "b", "c"]},
        {"id": "c", "status": "failed", "time": 40.0,
         "sample": {"decode_tok_s": 0.0, "tokens": 0, "hits": 0, "misses": 0, "bytes_read": 0}},
    ]
    got = samples(entries)
    assert [(s["id"], s["run"]) for s in got] == [("a", 0), ("b", 0), ("c", 1)]
    assert got[0]["hit_rate"] == 6 / 8 and got[0]["bytes_per_token"] == 200.0
    assert got[1]["hit_rate"] == 3 / 4 and got[1]["bytes_per_token"] == 4000 / 20
    assert got[2]["hit_rate"] is None and got[2]["bytes_per_token"] is None  # counters restarted, nothing new
    assert got[2]["decode_tok_s"] is None  # no decode step measured yet: no point, not a 0 tok/s point


def test_a_distributed_runs_samples_take_each_ranks_counters_apart():
    """A review: the ranks' journals merge in time order and each rank counts its own hits and
    bytes, so a sample's difference from another rank's read negative or above 1."""
    def rec(i, pid, hits, misses, tokens, read):
        return {"id": i, "status": "done", "time": 1.0, "sample": {"decode_tok_s": 2.0, "tokens": tokens, "hits": hits,
                                                                    "misses": misses, "bytes_read": read, "pid": pid}}

    got = samples([{"event": "start"}, rec("a", 11, 90, 10, 10, 1000), rec("b", 22, 5, 5, 10, 5000),
                   rec("c", 11, 120, 20, 20, 1500), rec("d", 22, 25, 5, 20, 6000)])
    assert [g["hit_rate"] for g in got] == [0.9, 0.5, 0.75, 1.0]
    assert [g["bytes_per_token"] for g in got] == [100.0, 500.0, 50.0, 100.0]


def test_retry_command_adds_the_flag_before_a_stdin_list():
    assert retry_command("mlx-tier run docs --out o") == "mlx-tier run docs --out o --retry-failed"
    assert retry_command("mlx-tier run - --out o < o/inputs.txt") == "mlx-tier run - --out o --retry-failed < o/inputs.txt"
    assert retry_command("mlx-tier run d --out o --retry-failed") == "mlx-tier run d --out o --retry-failed"
    assert "--retry-failed" in retry_command(None)


def test_view_numbers_equal_the_journal(job_dir):
    view = build_view(job_dir)
    counts = journal_counts(job_dir)
    assert counts == {"done": 5, "failed": 1}
    s = view["status"]
    assert (s["done"], s["failed"], s["pending"], s["total"]) == (5, 1, 0, 6)
    with_sample = [r for r in Journal(job_dir).entries() if "sample" in r]
    assert len(view["samples"]) == len(with_sample) == 5  # empty.txt failed as read, before the model: no counters
    by_id = {d["id"]: d for d in view["documents"]}
    assert by_id["doc03"]["summary"] == (job_dir / "doc03.md").read_text().rstrip("\n")
    assert by_id["empty"]["status"] == "failed" and by_id["empty"]["error"]
    assert by_id["empty"]["source"].endswith("empty.txt")  # the source name from report.json
    assert view["retry_command"].endswith(" --retry-failed")
    use = view["expert_use"]  # [L, E] from report.json: 2 layers x 8 experts, top-2 per routed token
    assert len(use) == 2 and len(use[0]) == 8 and sum(use[0]) == sum(use[1]) > 0


def test_report_html_is_written_at_the_end_of_a_run_and_loads_nothing(job_dir):
    page = (job_dir / "report.html").read_text()
    assert 'id="n-state" data-value="finished"' in page  # written once the run no longer holds the folder
    for doc_id in ("doc00", "doc04"):
        assert (job_dir / f"{doc_id}.md").read_text().strip().split("\n")[0][:30] in page.replace("&#x27;", "'")
    for remote in ('src="http', "src='http", 'href="http', "url(http", "@import", "<script"):
        assert remote not in page
    assert page.count('class="dot') > 0


def test_summary_text_is_shown_as_text_never_as_markup(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    journal = Journal(out)
    journal.append({"event": "start", "ids": ["x", "y"], "todo": ["x", "y"], "started": time.time(), "pid": 1,
                    "input": "in"})
    (out / "x.md").write_text("<script>alert(1)</script> & <b>bold</b>\n")
    journal.append({"id": "x", "status": "done", "output": "x.md"})
    journal.append({"id": "y", "status": "done", "output": "../outside.md"})  # never read outside OUT_DIR
    (tmp_path / "outside.md").write_text("secret")
    page = render_page(build_view(out))
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;b&gt;" in page
    assert "secret" not in page


def test_watch_server_serves_state_and_writes_nothing(job_copy, serve):
    before = snapshot(job_copy)
    url = serve(job_copy)
    state = json.loads(urllib.request.urlopen(url + "api/state").read())
    assert state["view"]["status"]["done"] == 5 and "<main" not in state["html"] and 'id="n-done"' in state["html"]
    again = json.loads(urllib.request.urlopen(url + "api/state?since=" + state["version"]).read())
    assert again == {"version": state["version"], "unchanged": True}
    page = urllib.request.urlopen(url).read().decode()
    assert "api/state" in page and 'id="main"' in page
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url + "journal.jsonl")  # no file serving: only the page and its state
    assert e.value.code == 404
    rebound = urllib.request.Request(url, headers={"Host": "attacker.example:80"})  # DNS rebinding
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(rebound)
    assert e.value.code == 403
    assert snapshot(job_copy) == before


def test_many_clients_at_once_are_all_answered(job_copy, serve):
    from concurrent.futures import ThreadPoolExecutor

    url = serve(job_copy)

    def get(_):
        return urllib.request.urlopen(url + "api/state", timeout=60).status

    with ThreadPoolExecutor(64) as pool:
        assert list(pool.map(get, range(200))) == [200] * 200


def test_an_idle_half_sent_connection_is_closed_and_a_leaving_client_is_quiet(job_copy, serve, monkeypatch,
                                                                             capfd):
    import socket

    from mlx_tier.monitor import server as server_mod

    monkeypatch.setattr(server_mod, "IDLE_TIMEOUT_S", 0.5)
    url = serve(job_copy)
    host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
    idle = socket.create_connection((host, port))
    idle.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1")  # never finished
    idle.settimeout(10)
    assert idle.recv(100) == b""  # the server hung up on it
    for _ in range(5):  # clients that leave before the answer
        c = socket.create_connection((host, port))
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        c.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        c.close()
    assert urllib.request.urlopen(url + "api/state", timeout=30).status == 200
    assert "Traceback" not in capfd.readouterr().err


def test_a_file_name_that_is_not_utf8_is_shown_and_served(tmp_path, small_moe, serve):  # noqa: F811
    """``caf\\xe9 menu.txt`` (Latin-1 bytes on disk) reaches Python as a lone surrogate:
    the page shows it as Python prints it, the server answers, report.html is UTF-8."""
    from mlx_tier.job.run import JobConfig, run_job
    from mlx_tier.job.scheduler import GenerationConfig

    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    (docs / os.fsdecode(b"caf\xe9 menu.txt")).write_text("river flood spring farmer plant seed.")
    (docs / "plain.txt").write_text("bee pollen flower fruit library book.")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("mlx_tier.job.model_setup.FALLBACK_CONTEXT", 256)
        run_job(JobConfig(input=docs, out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=8)))
    assert "caf\\xe9 menu.txt" in (out / "report.html").read_bytes().decode("utf-8")  # strict: valid UTF-8
    url = serve(out)
    assert "caf\\xe9 menu.txt" in urllib.request.urlopen(url).read().decode("utf-8")
    assert "caf\\xe9 menu.txt" in json.loads(urllib.request.urlopen(url + "api/state").read())["html"]
    r = runner.invoke(app, ["status", str(out), "--html"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                            ("127.0.0.2", True), ("0.0.0.0", False), ("192.168.1.5", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("header, name", [("127.0.0.1:8737", "127.0.0.1"), ("localhost", "localhost"),
                                          ("[::1]:8737", "::1"), ("evil.example:80", "evil.example")])
def test_host_header_name(header, name):
    from mlx_tier.monitor.server import _host_name

    assert _host_name(header) == name


def test_watch_cli_refuses_a_folder_that_is_no_job(tmp_path):
    r = runner.invoke(app, ["watch", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "no such folder" in r.output
    r = runner.invoke(app, ["watch", str(tmp_path)])
    assert r.exit_code == 2 and "not an mlx-tier output folder" in r.output


def test_watch_cli_port_in_use_is_one_clear_error(job_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = runner.invoke(app, ["watch", str(job_dir), "--port", str(taken.getsockname()[1])])
    assert r.exit_code == 2 and "pick another with --port" in r.output


@pytest.mark.parametrize("host", ["nonexistent.invalid", "192.0.2.1"])  # no such name; an address not this machine's
def test_watch_cli_names_a_host_it_cannot_bind_not_the_port(job_dir, host):
    """A user trial: `watch --host nonexistent.invalid` said "pick another with --port"."""
    r = runner.invoke(app, ["watch", str(job_dir), "--host", host, "--port", "0"])
    words = " ".join(r.output.split())
    assert r.exit_code == 2 and f"{host} is not an address of this machine; give another with --host" in words, r.output
    assert "--port" not in words


def test_watch_cli_warns_when_bound_beyond_loopback(job_dir):
    proc = subprocess.Popen([sys.executable, "-m", "mlx_tier.cli.main", "watch", str(job_dir), "--port", "0",
                             "--host", "0.0.0.0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"watching {job_dir} at http://0.0.0.0:"), line
        port = int(line.split(":")[-1].split("/")[0])
        assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state").read())["view"]
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "anyone who can reach this machine" in stderr


def test_status_html_writes_the_page(job_copy):
    (job_copy / "report.html").unlink()
    r = runner.invoke(app, ["status", str(job_copy), "--html"])
    assert r.exit_code == 0, r.output
    assert 'id="n-done" data-value="5"' in (job_copy / "report.html").read_text()


# --------------------------------------------------------------------------- in a real browser


@pytest.fixture()
def browser():
    """Headless Chromium from the system (Selenium + the matching chromedriver), console log on."""
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip("no Chromium: install the Debian packages chromium and chromium-driver (.ci/run does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument("--window-size=1100,1400")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


# Read in one script call: the live page may swap its body between a find and a read.
def shown(driver, key: str) -> str:
    return driver.execute_script(f"return document.getElementById('n-{key}').textContent")


def count(driver, selector: str) -> int:
    return driver.execute_script(f"return document.querySelectorAll('{selector}').length")


def dots(driver, chart: str) -> int:
    return count(driver, f"#chart-{chart} circle.dot")


def console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def check_page_matches_journal(driver, out: Path) -> None:
    counts, view = journal_counts(out), build_view(out)
    assert shown(driver, "done") == str(counts["done"]) and shown(driver, "failed") == str(counts["failed"])
    assert shown(driver, "pending") == str(view["status"]["pending"])
    points = view["samples"]
    assert dots(driver, "tok-s") == sum(p["decode_tok_s"] is not None for p in points) > 0
    assert dots(driver, "hit-rate") == sum(p["hit_rate"] is not None for p in points) > 0
    assert dots(driver, "bytes-per-token") == sum(p["bytes_per_token"] is not None for p in points)
    assert dots(driver, "memory") == sum(p["rss_bytes"] is not None for p in points) > 0
    assert dots(driver, "thermal") == len(view["thermal"])
    assert dots(driver, "throttle-time") == sum("throttled_seconds" in r for r in Journal(out).entries()) > 0
    assert count(driver, "#documents details.doc") == len(view["documents"])


@pytest.mark.browser
def test_live_page_shows_the_journal_and_follows_it(job_copy, serve, browser):
    interval = 1.0
    browser.get(serve(job_copy, interval_s=interval))
    check_page_matches_journal(browser, job_copy)
    before = dots(browser, "tok-s")
    # A new journal line, as a retry would append it: the failed document is now done.
    (job_copy / "empty.md").write_text("Nothing in it.\n")
    last = [r for r in Journal(job_copy).entries() if "sample" in r][-1]["sample"]
    run = JobInfo.last(list(Journal(job_copy).entries())).run  # the run that set out to do it writes it
    Journal(job_copy).append({"id": "empty", "status": "done", "output": "empty.md", "output_tokens": 4, "run": run,
                              "sample": {**last, "tokens": last["tokens"] + 4, "decode_tok_s": 7.5}})
    t0 = time.monotonic()
    while shown(browser, "done") != "6" and time.monotonic() - t0 < interval + RENDER_SLACK_S:
        time.sleep(0.05)
    assert shown(browser, "done") == "6", f"not shown after {interval + RENDER_SLACK_S} s"
    assert shown(browser, "failed") == "0" and dots(browser, "tok-s") == before + 1
    check_page_matches_journal(browser, job_copy)
    assert "Nothing in it." in browser.execute_script("return document.getElementById('documents').textContent")
    assert console_errors(browser) == []


@pytest.mark.browser
def test_report_html_renders_from_the_file_system_without_errors(job_dir, browser):
    browser.get((job_dir / "report.html").as_uri())
    check_page_matches_journal(browser, job_dir)
    assert "--retry-failed" in browser.find_element("id", "retry-command").text
    browser.find_element("css selector", "#documents details.doc summary").click()  # read a summary in place
    assert browser.find_element("css selector", "#documents pre.summary").is_displayed()
    browser.set_window_size(390, 844)  # a phone: one column, nothing wider than the screen
    width = browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], width
    assert console_errors(browser) == []


@pytest.mark.slow
@pytest.mark.browser
def test_live_page_of_a_real_demo_run(demo_model, tmp_path, serve, browser):
    """The same checks on a short real run of the SmolLM2 demo MoE (two one-line documents)."""
    from mlx_tier.engine.load import TierConfig
    from mlx_tier.job.run import JobConfig, run_job
    from mlx_tier.job.scheduler import GenerationConfig

    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    (docs / "bees.txt").write_text("Bees carry pollen from flower to flower, so fruit trees set fruit.")
    (docs / "river.txt").write_text("The river flooded in spring and the farmers planted late.")
    run_job(JobConfig(input=docs, out_dir=out, model=demo_model, generation=GenerationConfig(max_tokens=8),
                      tier=TierConfig(cache_gb=0.1, kernel="auto")))
    browser.get(serve(out, interval_s=1.0))
    check_page_matches_journal(browser, out)
    assert shown(browser, "done") == "2"
    assert count(browser, "#expert-use tr") == 1 + 30  # header + the demo's 30 layers
    assert console_errors(browser) == []


def test_summary_behind_a_planted_link_is_never_served(tmp_path):
    from mlx_tier.monitor.view import _summary_text

    secret = tmp_path / "secret.txt"
    secret.write_text("not for the page")
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.md").symlink_to(secret)
    (out / "b.md").write_text("a real summary\n")
    assert _summary_text(out, {"id": "a", "output": "a.md"}) is None
    assert _summary_text(out, {"id": "b", "output": "b.md"}) == "a real summary"


def test_the_page_changes_when_the_runs_progress_file_does(tmp_path):
    """A user trial: the live page stood still for up to 30 s between documents (the prompt
    being read, the ETA) though progress.json moved every few seconds: its version followed
    the journal and report.json only."""
    from mlx_tier.monitor.server import files_version

    (tmp_path / "journal.jsonl").write_text('{"event": "start", "ids": [], "todo": []}\n')
    (tmp_path / "progress.json").write_text('{"reading": ["a", 10, 700]}')
    before = files_version(tmp_path, now=0.0)
    assert files_version(tmp_path, now=0.0) == before
    (tmp_path / "progress.json").write_text('{"reading": ["a", 300, 700], "eta_seconds": 20}')
    assert files_version(tmp_path, now=0.0) != before
    ranks = files_version(tmp_path, now=0.0)
    (tmp_path / "progress-1.json").write_text('{"reading": ["b", 5, 90]}')  # a rank's
    assert files_version(tmp_path, now=0.0) != ranks


def test_a_summary_longer_than_the_page_shows_is_said_cut(tmp_path):
    """A review: the page cut a summary at 20,000 characters with no mark: its last sentences
    simply vanished. It says where it cut and which file holds the whole summary."""
    from mlx_tier.monitor.view import SUMMARY_CHARS, _summary_text

    out = tmp_path / "out"
    out.mkdir()
    long = "".join(f"Sentence {k} of the summary. " for k in range(1000)).strip()
    assert len(long) > SUMMARY_CHARS
    (out / "a.md").write_text(long + "\n")
    (out / "b.md").write_text("é" * SUMMARY_CHARS + "\n")  # exactly as long, in two-byte characters: whole
    (out / "c.md").write_text("🙂" * (SUMMARY_CHARS + 1))  # four-byte characters, one too many
    shown = _summary_text(out, {"id": "a", "output": "a.md"})
    assert shown.startswith(long[:SUMMARY_CHARS]) and "cut" in shown and "a.md" in shown
    assert _summary_text(out, {"id": "b", "output": "b.md"}) == "é" * SUMMARY_CHARS
    assert "cut" in _summary_text(out, {"id": "c", "output": "c.md"})


def test_the_page_gives_durations_as_the_terminal_does():
    """A review: the page rounded 0.4 s to "0 s" and 179 s to "2 min"."""
    from mlx_tier.monitor.page import fmt_seconds

    assert [fmt_seconds(s) for s in (None, 0.4, 9.96, 42.4, 179, 3599.6, 3600, 11_100)] == \
        ["unknown", "0.4 s", "10 s", "42 s", "2 min 59 s", "1 h 00 min", "1 h 00 min", "3 h 05 min"]


def test_the_page_reads_the_journal_once(tmp_path, monkeypatch):
    """A review: the page read the journal twice (its status, then its documents), so while a run
    wrote, its "Done" count and its list of documents could disagree."""
    from mlx_tier.monitor.view import build_view
    from mlx_tier.outdir.journal import JobInfo, Journal

    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input="docs", ids=["a", "b"], todo=["a", "b"], started=1.0, pid=7).write(Journal(out))
    Journal(out).append({"id": "a", "status": "done", "output": "a.md", "output_tokens": 3})
    reads = []
    real = Journal.entries
    monkeypatch.setattr(Journal, "entries", lambda self: reads.append(1) or real(self))
    view = build_view(out)
    assert len(reads) == 1 and view["status"]["done"] == 1 and view["status"]["pid"] == 7
