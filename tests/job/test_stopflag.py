"""The stop signals in one process: a hang-up stops as SIGTERM does unless the job was
started under `nohup` (SIGHUP ignored: it goes on), also while the model loads."""

from __future__ import annotations

import os
import signal
import time

import pytest

import mlx_tier.job.stopflag as stopflag
from mlx_tier.job.stopflag import Interrupted, StopFlag

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")


def wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_hang_up_is_a_first_stop_signal(monkeypatch, hang_ups_default):
    calls = []
    monkeypatch.setattr(stopflag, "hung_up", lambda: calls.append("hung up"))  # no terminal to drop here
    with StopFlag() as stop:
        os.kill(os.getpid(), signal.SIGHUP)
        assert wait_for(lambda: stop.signal == signal.SIGHUP)
        assert wait_for(lambda: len(calls) == 2)  # the handler's and the watchdog's (done with the byte)
    assert signal.getsignal(signal.SIGHUP) is not stop._handle


def test_under_nohup_a_hang_up_stays_ignored(monkeypatch):
    """A review: `nohup mlx-tier run ... &` went on after a logout before SIGHUP was a stop
    signal; the handler replaced the ignored disposition and the job stopped."""
    calls = []
    monkeypatch.setattr(stopflag, "hung_up", lambda: calls.append("hung up"))
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopFlag() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(stopflag.ACK_SECONDS + 0.2)  # the watchdog would have taken it by now
            assert stop.signal is None and calls == []
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


def test_a_hang_up_while_the_model_loads_interrupts_with_its_signal(monkeypatch, hang_ups_default):
    from mlx_tier.cli import run_cmd

    monkeypatch.setattr(stopflag, "hung_up", lambda: None)
    with pytest.raises(Interrupted) as e, run_cmd._sigterm_interrupts():
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(1)  # the handler runs between bytecodes
    assert e.value.signum == signal.SIGHUP
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with run_cmd._sigterm_interrupts():  # under nohup: left ignored
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)
