"""Stops within seconds, in a real process: a first SIGINT/SIGTERM acts at the next
step boundary (steps are bounded in time, so a slow prompt does not delay it), and
a second signal stops at once even inside a long MLX call, where Python cannot run
its handler (the signals are counted where they arrive, by a watchdog thread).

A first signal is also taken by a watchdog thread when the main thread is deep in
a long step, and the summaries being written get a few seconds, not minutes; the
progress file keeps being rewritten during a long step.

Timings are asserted loosely (15-20 s) for a shared 2-core machine; without the
fixes the stops take tens of seconds to minutes here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.output import command_after

DRIVER = Path(__file__).parents[1] / "support" / "slow_run.py"
WORDS = "the river floods every spring and the farmers plant after it recedes".split()
pytestmark = pytest.mark.slow


def start(tmp_path, model, kind, *extra, long: bool = True):
    docs = tmp_path / "docs"
    docs.mkdir()
    if long:
        (docs / "long.txt").write_text(" ".join(WORDS[i % len(WORDS)] for i in range(1200)) + ".")
    (docs / "short.txt").write_text("Bees carry pollen between flowers, which helps fruit to form.")
    out = tmp_path / "out"
    env = {**os.environ, "SLOW_KIND": kind, "SLOW_MARKER": str(tmp_path / "long-call-started")}
    proc = subprocess.Popen([sys.executable, str(DRIVER), "run", str(docs), "--out", str(out), "--model", str(model),
                             "--max-tokens", "4", "--batch-size", "1", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out


def wait_for(proc, condition, timeout=240):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"never happened; output:\n{proc.communicate()[0]}")
        time.sleep(0.1)


def finish(proc, timeout=15):
    """Exit code, output and seconds taken to exit."""
    t0 = time.monotonic()
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {timeout} s after the signal:\n{proc.communicate()[0]}")
    return proc.returncode, output, time.monotonic() - t0


def reading(out: Path) -> bool:
    try:
        return json.loads((out / "progress.json").read_text()).get("reading") is not None
    except (OSError, ValueError):
        return False


@pytest.mark.parametrize("schedule", ["throughput", "paced"])
def test_first_signal_stops_at_the_next_step_while_a_long_prompt_is_read(tmp_path, tiny_moe, schedule):
    """25 prompt tokens/s: one 512-token prompt step would take 20 s. The paced schedule's
    steps are paced to ~4 s; the throughput schedule's pool steps to ~4 s a layer (the probes
    plan pools of up to 2,048 tokens: 41 s a layer of this 2-layer model), and a stop is
    taken between layers. The prompt being read shows in the progress file from the run's
    first step on (it once showed only after a step that left the prompt unfinished)."""
    proc, out = start(tmp_path, tiny_moe, "sleep", "--schedule", schedule)
    wait_for(proc, lambda: reading(out))
    proc.send_signal(signal.SIGINT)
    code, output, seconds = finish(proc)
    assert code == 130, output
    assert "stopping:" in output and command_after(output, "Resume with:").startswith("mlx-tier run ")
    lines = output.splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("stopping:"))
    last = next(i for i in range(first, len(lines)) if lines[i].endswith("stop at once)"))
    assert all(len(x) <= 80 for x in lines[first:last + 1]), lines[first:last + 1]  # wrapped between words
    assert seconds < 15
    report = json.loads((out / "report.json").read_text())
    assert report["totals"]["pending"] >= 1  # the document being read is left for the next run


def test_second_signal_stops_at_once_inside_a_long_mlx_call(tmp_path, tiny_moe):
    proc, out = start(tmp_path, tiny_moe, "mlx")
    wait_for(proc, lambda: (tmp_path / "long-call-started").exists())
    time.sleep(0.5)  # well inside mx.eval
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # two quick signals: Python alone would run its handler once, after the call
    proc.send_signal(signal.SIGTERM)
    code, output, seconds = finish(proc)
    assert code == 143, output
    assert "stopped at once (SIGTERM); finished summaries are kept." in " ".join(output.split())
    assert command_after(output, "Resume with:").startswith("mlx-tier run ")
    assert seconds < 15
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def progress(out: Path) -> dict:
    try:
        return json.loads((out / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_first_signal_leaves_slow_summaries_for_the_next_run_within_seconds(tmp_path, tiny_moe):
    """Summaries being written at 2 s a token would take minutes to finish: after the grace
    they are left pending and the run ends, exit 143, the resume line printed."""
    proc, out = start(tmp_path, tiny_moe, "decode", "--max-tokens", "40", long=False)
    wait_for(proc, lambda: bool(progress(out).get("writing")))
    proc.send_signal(signal.SIGTERM)
    code, output, seconds = finish(proc, timeout=30)
    assert code == 143, output
    assert "stopping:" in output and command_after(output, "Resume with:").startswith("mlx-tier run ")
    assert seconds < 20
    report = json.loads((out / "report.json").read_text())
    assert report["totals"]["pending"] >= 1 and report["totals"]["done"] == 0


def test_during_a_long_step_progress_is_rewritten_and_a_first_signal_is_taken(tmp_path, tiny_moe):
    """Deep inside one MLX call (minutes): progress.json still changes every few seconds,
    and a first SIGTERM shows in it as stopping within seconds; a second one ends the run."""
    proc, out = start(tmp_path, tiny_moe, "mlx")
    wait_for(proc, lambda: (tmp_path / "long-call-started").exists())
    wait_for(proc, lambda: progress(out).get("busy_seconds", 0) > 0, timeout=30)
    beat = progress(out)
    assert beat["rss_bytes"] > 0 and beat["memory_available"] > 0 and beat["stopping"] is False
    proc.send_signal(signal.SIGTERM)
    wait_for(proc, lambda: progress(out).get("stopping") is True, timeout=15)
    proc.send_signal(signal.SIGTERM)
    code, output, _ = finish(proc)
    assert code == 143 and "stopping:" in output, output


def test_a_hang_up_stops_as_sigterm_does_and_writes_its_report(tmp_path, tiny_moe, hang_ups_default):
    """A trial: closing the terminal (SIGHUP) killed the run where it stood, with no report;
    and once it is closed every write to it fails (EIO), so a run that went on would end at
    its first message. It now stops as for SIGTERM, its output to the null device."""
    import pty

    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    (docs / "long.txt").write_text(" ".join(WORDS[i % len(WORDS)] for i in range(1200)) + ".")
    (docs / "short.txt").write_text("Bees carry pollen between flowers, which helps fruit to form.")
    env = {**os.environ, "SLOW_KIND": "sleep", "SLOW_MARKER": str(tmp_path / "long-call-started")}
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(DRIVER), "run", str(docs), "--out", str(out), "--model",
                             str(tiny_moe), "--max-tokens", "4", "--batch-size", "1"],
                            env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    try:
        wait_for(proc, lambda: reading(out))
        os.close(master)  # the terminal is gone: a write to it now fails
        master = None
        proc.send_signal(signal.SIGHUP)
        code = proc.wait(timeout=20)
    finally:
        if master is not None:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert code == 129
    report = json.loads((out / "report.json").read_text())
    assert report["totals"]["pending"] >= 1 and report["totals"]["interrupted"] is True, report["totals"]
    assert "ended" not in report["runs"][-1]  # its own record, not one the next run rebuilds
