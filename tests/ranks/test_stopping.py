"""Ctrl-C on a run over ranks: mlx.launch is started with SIGINT ignored when every rank
is on this machine (the ranks get the terminal's Ctrl-C themselves), so it keeps
forwarding their output and returns only after their supervisors recorded how they
ended; the supervisor starts its worker with SIGINT's default, not the ignored
disposition it may have inherited.

Interrupted itself, mlx.launch could return before a rank's supervisor wrote
``exit-<k>.json`` (python/cpython#90882: a KeyboardInterrupt inside
``Thread.is_alive`` marks a running thread stopped), and the report said
"no word from its supervisor" for a rank that stopped cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from mlx_tier.ranks.launcher import Launch, all_local, start_launcher

# Writes to argv[1] how the process found SIGINT at start: "ignored", "default" (Python's
# KeyboardInterrupt handler, installed when SIGINT was SIG_DFL at exec) or "other".
_SIGINT_AT_START = ("import signal, sys; h = signal.getsignal(signal.SIGINT); open(sys.argv[1], 'w').write("
                    "'ignored' if h == signal.SIG_IGN else 'default' if h is signal.default_int_handler else 'other')")


def test_mlx_launch_starts_with_sigint_ignored_only_when_every_rank_is_local(tmp_path):
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as `mlx-tier run` has it
    try:
        for local, expected in [(True, "ignored"), (False, "default")]:
            answer = tmp_path / f"local-{local}"
            proc = start_launcher([sys.executable, "-c", _SIGINT_AT_START, str(answer)], local)
            assert proc.wait(timeout=120) == 0
            assert answer.read_text() == expected
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the launcher's Ctrl-C is back
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_supervisor_started_with_sigint_ignored_starts_its_worker_with_the_default(tmp_path):
    plan, answer = tmp_path / "plan.json", tmp_path / "answer"
    plan.write_text("{}\n")
    worker = [sys.executable, "-c", _SIGINT_AT_START, str(answer)]
    script = ("import signal, sys; from pathlib import Path; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              f"from mlx_tier.ranks.worker import supervise; sys.exit(supervise(Path({str(plan)!r}), {worker!r}))")
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MLX_RANK": "1"})
    assert got.returncode == 0, got.stdout + got.stderr
    assert answer.read_text() == "default"
    end = json.loads((tmp_path / "exit-1.json").read_text())
    assert end["rank"] == 1 and end["returncode"] == 0 and end["signal"] is None


def test_ranks_are_local_with_ranks_or_a_hosts_file_of_loopback_only(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    assert all_local(Launch(ranks=3)) and all_local(Launch(hosts=hosts))
    hosts.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]))
    assert not all_local(Launch(hosts=Path(hosts)))
    hosts.write_text(json.dumps({"backend": "mpi", "hosts": [{"ssh": "127.0.0.1"}] * 2}))  # mpirun starts them
    assert not all_local(Launch(hosts=hosts))


class _Launch:
    """mlx.launch as _wait sees it: ``presses`` Ctrl-Cs arrive while it waits."""

    def __init__(self, presses: int) -> None:
        self.presses, self.terminated = presses, 0

    def wait(self):
        if self.presses:
            self.presses -= 1
            raise KeyboardInterrupt
        return 0

    def terminate(self):
        self.terminated += 1


class _Messages:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)


def test_a_second_ctrl_c_ends_mlx_launch_only_for_ranks_it_alone_can_stop():
    from mlx_tier.ranks.launcher import _wait

    for local, presses, terminated in [(True, 1, 0), (True, 2, 0), (True, 3, 1), (False, 1, 0), (False, 2, 1)]:
        proc, messages = _Launch(presses), _Messages()
        assert _wait(proc, messages, local) == signal.SIGINT
        assert proc.terminated == terminated, (local, presses)
        assert "finish the summaries being written" in messages.lines[0]
    assert _wait(_Launch(0), _Messages(), True) is None
