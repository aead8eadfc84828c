"""The thermal throttle: sensor readings -> duty cycle between decode steps.

Invariants guarded here: full speed when nothing is wrong; a throttled run
spends exactly the configured fraction of wall time computing; a pause ends
when conditions have been clear for ``resume_after`` seconds, or at once when
the job is asked to stop; ``--max-tok-s`` is never exceeded; no flapping at a
threshold; a broken sensor never stops the job. Sensors are scripted fakes
(``enqueue``), time is a fake clock (nothing really sleeps); the OS parsers are
checked in test_sensors.py.
"""

from __future__ import annotations

import json

import pytest
from support.sensors import FakeRun, write_zone
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.job import sensors as th
from mlx_tier.job.process import keep_awake, lower_priority
from mlx_tier.job.sensors import (
    CRITICAL,
    FAIR,
    NOMINAL,
    SERIOUS,
    Reading,
    Sensor,
    ThermalZoneSensor,
    merge,
)
from mlx_tier.job.throttle import Controller, Throttle, ThrottleConfig


class FakeSensor(Sensor):
    """Returns the enqueued readings one per read; repeats the last one when the queue runs dry."""

    def __init__(self, name="fake", why_unavailable=None):
        self.name, self.why, self.queue, self.last, self.reads = name, why_unavailable, [], Reading(), 0

    def enqueue(self, *readings):
        self.queue.extend(readings)
        return self

    def unavailable_reason(self):
        return self.why

    def read(self):
        self.reads += 1
        if self.queue:
            self.last = self.queue.pop(0)
        if isinstance(self.last, Exception):
            raise self.last
        return self.last


class FakeClock:
    """Monotonic seconds; ``sleep`` advances it and is recorded; ``work`` is a decode step."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds

    def work(self, seconds):
        self.now += seconds


def make(config, *readings, should_stop=lambda: False):
    sensor = FakeSensor().enqueue(*readings)
    clock = FakeClock()
    t = Throttle(config, [sensor], clock=clock, sleep=clock.sleep, should_stop=should_stop)
    t.step()  # the first call starts the clock
    return t, clock, sensor


def decode(t, clock, steps, work=0.1, tokens=1):
    """Run ``steps`` decode steps of ``work`` seconds; returns the seconds slept after each."""
    slept = []
    for _ in range(steps):
        clock.work(work)
        slept.append(t.step(tokens))
    return slept


# ---------------------------------------------------------------- controller, scripted traces


def test_nominal_runs_at_full_speed():
    t, clock, sensor = make(ThrottleConfig(), Reading(thermal_state=NOMINAL, max_temp_c=60.0))
    assert decode(t, clock, 100) == [0.0] * 100
    d = t.as_dict()
    assert d["throttled_seconds"] == d["paused_seconds"] == d["capped_seconds"] == 0
    assert d["tokens"] == 100 and d["elapsed_seconds"] == pytest.approx(10.0)
    assert [e["mode"] for e in d["timeline"]] == ["full"]
    assert sensor.reads == 3  # polled at start, then once per 5 s of the 10 s, not per token
    json.dumps(d)


@pytest.mark.parametrize("state, duty", [(FAIR, 0.75), (SERIOUS, 0.4)])
def test_fair_and_serious_run_at_their_duty_cycle(state, duty):
    t, clock, _ = make(ThrottleConfig(), Reading(thermal_state=state, thermal_source="fake"))
    start = clock.now
    slept = decode(t, clock, 50, work=0.2)
    assert slept[0] == pytest.approx(0.2 * (1 - duty) / duty)
    assert 50 * 0.2 / (clock.now - start) == pytest.approx(duty)  # work / wall time
    assert t.throttled_seconds == pytest.approx(sum(slept))
    assert t.decision.mode == "slow" and t.decision.reason == f"thermal state {th.STATE_NAMES[state]} (fake)"


def test_critical_pauses_until_clear_for_resume_after():
    cfg = ThrottleConfig(poll_seconds=5, resume_after=15)
    # polls every 5 s: start nominal, then critical for 4 polls (20 s), then nominal again
    t, clock, _sensor = make(cfg, Reading(thermal_state=NOMINAL), *[Reading(thermal_state=CRITICAL)] * 4,
                            Reading(thermal_state=NOMINAL))
    clock.work(5.0)  # a step long enough to reach the next poll: critical
    t.step()
    # paused from t=5: critical polls at 5, 10, 15, 20; nominal from 25; resumes once clear 15 s -> t=40
    assert t.paused_seconds == pytest.approx(35.0)
    assert t.decision.mode == "full"
    modes = [(e["t"], e["thermal"], e["mode"]) for e in t.timeline]
    assert modes == [(0.0, "nominal", "full"), (5.0, "critical", "paused"), (25.0, "nominal", "paused"),
                     (40.0, "nominal", "full")]
    assert max(clock.sleeps) <= cfg.stop_check_seconds  # short sleeps: a stop request is seen promptly
    assert decode(t, clock, 3) == [0.0] * 3


def test_above_max_temp_slows_and_clears_below_hysteresis():
    cfg = ThrottleConfig(max_temp=80, temp_hysteresis=3, resume_after=10)
    c = Controller(cfg)
    trace = [(0, 79.0, "full"), (5, 81.0, "slow"), (10, 78.5, "slow"), (15, 76.0, "slow"),
             (20, 76.0, "slow"), (25, 76.0, "full"), (30, 80.0, "full"), (35, 80.5, "slow")]
    for now, temp, mode in trace:
        d = c.decide(Reading(max_temp_c=temp), now)
        assert d.mode == mode, (now, temp)
    assert d.duty == cfg.hot_duty and "80.5 °C, `max_temp` 80" in d.reason


def test_hysteresis_does_not_flap_between_fair_and_nominal():
    c = Controller(ThrottleConfig(resume_after=15))
    states = [FAIR, NOMINAL] * 10 + [NOMINAL] * 4  # flapping every 5 s, then clear
    modes = [c.decide(Reading(thermal_state=s), 5.0 * i).mode for i, s in enumerate(states)]
    assert modes[:20] == ["slow"] * 20  # never back to full while it flaps
    assert modes[20:] == ["slow", "slow", "full", "full"]  # clear from t=95 -> full at t=110


def test_worst_condition_wins_and_all_reasons_are_given():
    c = Controller(ThrottleConfig(max_temp=70))
    d = c.decide(Reading(thermal_state=FAIR, max_temp_c=75.0), 0)
    assert d.duty == 0.5 and "thermal state fair" in d.reason and "`max_temp` 70" in d.reason


def test_on_battery_pauses_only_with_pause_on_battery():
    on_batt = Reading(on_battery=True, battery_percent=80.0)
    assert Controller(ThrottleConfig()).decide(on_batt, 0).mode == "full"
    c = Controller(ThrottleConfig(pause_on_battery=True, resume_after=10))
    assert c.decide(on_batt, 0).paused and "on battery" in c.current.reason
    assert c.decide(Reading(on_battery=False, battery_percent=80.0), 5).paused  # AC back: hold
    assert c.decide(Reading(on_battery=False, battery_percent=80.0), 15).mode == "full"


def test_below_min_battery_pauses_until_charged_past_hysteresis_or_on_ac():
    c = Controller(ThrottleConfig(min_battery=20, battery_hysteresis=5, resume_after=0))
    assert c.decide(Reading(on_battery=True, battery_percent=21.0), 0).mode == "full"
    assert c.decide(Reading(on_battery=True, battery_percent=19.0), 1).paused
    assert c.decide(Reading(on_battery=True, battery_percent=24.0), 2).paused  # latched below 25
    assert c.decide(Reading(on_battery=True, battery_percent=26.0), 3).mode == "full"
    assert c.decide(Reading(on_battery=True, battery_percent=10.0), 4).paused
    assert c.decide(Reading(on_battery=False, battery_percent=10.0), 5).mode == "full"  # plugged in


def test_max_tok_s_cap_sleeps_exactly_enough():
    t, clock, _ = make(ThrottleConfig(max_tok_s=10), Reading())
    assert decode(t, clock, 5, work=0.01) == pytest.approx([0.09] * 5)
    assert decode(t, clock, 3, work=0.01, tokens=4) == pytest.approx([0.39] * 3)  # a batch of 4 per step
    assert decode(t, clock, 2, work=0.5) == [0.0, 0.0]  # slower than the cap: no sleep
    clock.work(60)  # idle (e.g. between documents): this step took 60 s, but no burst follows it
    assert decode(t, clock, 2, work=0.01) == pytest.approx([0.0, 0.09])
    assert t.capped_seconds == pytest.approx(0.09 * 6 + 0.39 * 3)
    assert t.tokens / t.as_dict()["elapsed_seconds"] <= 10
    assert t.timeline and all(c["max_tok_s"] == 10 for c in t.timeline)  # status says the cap, not "nothing"


def test_cap_and_duty_cycle_combine_as_the_slower_of_both():
    t, clock, _ = make(ThrottleConfig(max_tok_s=10), Reading(thermal_state=SERIOUS))
    assert decode(t, clock, 1, work=0.01) == pytest.approx([0.09])  # cap dominates 0.015 of duty
    assert decode(t, clock, 1, work=0.2) == pytest.approx([0.3])  # duty dominates
    assert t.throttled_seconds == pytest.approx(0.015 + 0.3) and t.capped_seconds == pytest.approx(0.075)


def test_stop_request_ends_a_pause_promptly():
    clock_box = {}

    def should_stop():
        return clock_box["clock"].now >= clock_box["stop_at"]

    t, clock, _ = make(ThrottleConfig(), Reading(thermal_state=CRITICAL), should_stop=should_stop)
    clock_box.update(clock=clock, stop_at=clock.now + 3.0)
    clock.work(0.1)
    slept = t.step()
    assert t.decision.paused  # still critical: the caller checks its stop flag and ends the job
    assert 2.9 <= slept <= 3.0 + ThrottleConfig().stop_check_seconds


def test_stop_request_ends_a_duty_sleep():
    t, clock, _ = make(ThrottleConfig(), Reading(thermal_state=SERIOUS), should_stop=lambda: True)
    clock.work(30.0)  # a long prefill would earn a 45 s sleep at duty 0.4
    assert t.step() == 0.0


def test_a_failing_sensor_is_recorded_and_ignored():
    t, clock, _sensor = make(ThrottleConfig(), OSError("pmset vanished"))
    assert decode(t, clock, 3) == [0.0] * 3
    assert t.reading.errors == {"fake": "OSError: pmset vanished"}


def test_timeline_is_bounded():
    states = [Reading(thermal_state=s) for s in [FAIR, SERIOUS] * 20]
    t, clock, _ = make(ThrottleConfig(poll_seconds=1), *states)
    t.max_timeline = 5
    decode(t, clock, 40, work=1.0)
    assert len(t.timeline) == 5 and t.as_dict()["timeline_dropped"] > 0


def test_merge_is_pessimistic():
    r = merge([
        ("a", Reading(thermal_state=FAIR, thermal_source="a", max_temp_c=70.0, on_battery=False, battery_percent=90.0)),
        ("b", Reading(thermal_state=SERIOUS, thermal_source="b", max_temp_c=65.0, gpu_throttle=("sw_power_cap",),
                      details={"b": {"x": 1}})),
        ("c", Reading(on_battery=True, battery_percent=40.0, errors={"c": "boom"})),
    ])
    assert (r.thermal_state, r.thermal_source, r.max_temp_c) == (SERIOUS, "b", 70.0)
    assert (r.on_battery, r.battery_percent, r.gpu_throttle) == (True, 40.0, ("sw_power_cap",))
    assert r.details == {"b": {"x": 1}} and r.errors == {"c": "boom"}
    assert merge([]) == Reading()


@pytest.mark.parametrize("kwargs", [{"max_temp": -5}, {"max_temp": float("nan")}, {"min_battery": 0},
                                    {"min_battery": 150}, {"max_tok_s": 0}, {"poll_seconds": 0},
                                    {"fair_duty": 0}, {"serious_duty": 1.5}, {"resume_after": -1}])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs)).replace("_", ".")):
        ThrottleConfig(**kwargs)


# ---------------------------------------------------------------- process hygiene


class FakeProcess:
    def __init__(self, cmd):
        self.cmd, self.terminated, self.waited = cmd, False, False

    def terminate(self):
        self.terminated = True

    def wait(self, timeout=None):
        self.waited = True


def test_keep_awake_holds_caffeinate_on_macos_only():
    spawned = []

    def spawn(cmd):
        spawned.append(FakeProcess(cmd))
        return spawned[-1]

    with pytest.raises(RuntimeError), keep_awake(spawn=spawn, platform="darwin", pid=4242) as proc:
        assert proc.cmd == ["caffeinate", "-i", "-w", "4242"] and not proc.terminated
        raise RuntimeError("job crashed")
    assert spawned[0].terminated and spawned[0].waited  # released even on error
    with keep_awake(spawn=spawn, platform="linux") as proc:
        assert proc is None
    assert len(spawned) == 1


def test_lower_priority_uses_nice_and_warns_about_background_qos():
    niced, run = [], FakeRun().enqueue("")
    assert lower_priority(10, platform="darwin", renice=niced.append, run=run) is None
    assert niced == [10] and run.commands == []
    warning = lower_priority(5, background_qos=True, platform="darwin", renice=niced.append, run=run, pid=7)
    assert run.commands == [["taskpolicy", "-b", "-p", "7"]] and "~8x" in warning
    assert "macOS-only" in lower_priority(0, background_qos=True, platform="linux", renice=niced.append, run=run)
    assert niced == [10, 5]
    with pytest.raises(ValueError):
        lower_priority(-1, renice=niced.append)


# ---------------------------------------------------------------- `mlx-tier thermal`

runner = CliRunner()


def test_thermal_cli_on_this_machine():
    result = runner.invoke(app, ["thermal", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [s["name"] for s in data["sensors"]] == [s.name for s in th.known_sensors()]
    for s in data["sensors"]:
        assert s["available"] == (s["reading"] is not None) == (s["unavailable_reason"] is None)
    result = runner.invoke(app, ["thermal"])
    assert result.exit_code == 0, result.output
    assert all(s["name"] in result.output for s in data["sensors"])
    if not any(s["available"] for s in data["sensors"]):  # e.g. this VM: says so instead of crashing
        assert "no sensor available on this machine" in result.output
    else:
        assert "throttle input: thermal" in result.output


def test_thermal_cli_shows_values_reasons_and_errors(tmp_path, monkeypatch):
    write_zone(tmp_path, 0, "x86_pkg_temp", 71500, [("passive", 95000)])
    sensors = [ThermalZoneSensor(tmp_path), FakeSensor("gone", why_unavailable="not on this machine"),
               FakeSensor("flaky").enqueue(OSError("device busy"))]
    monkeypatch.setattr(th, "known_sensors", lambda: sensors)
    result = runner.invoke(app, ["thermal"])
    assert result.exit_code == 0, result.output
    assert "hottest_c=71.5" in result.output and "not on this machine" in result.output
    assert "read failed: OSError: device busy" in result.output
    assert "throttle input: thermal nominal (thermal-zones); hottest 71.5 °C" in result.output


def test_limits_no_sensor_can_serve_are_said():
    """A user trial: `--max-temp 70 --pause-on-battery --min-battery 20` were taken without a word
    on a machine with no sensor (`mlx-tier thermal`: none available): none of them could act."""
    from mlx_tier.job.sensors import Reading
    from mlx_tier.job.throttle import ThrottleConfig, unserved

    asked = ThrottleConfig(max_temp=70, pause_on_battery=True, min_battery=20)
    lines = unserved(asked, Reading())
    assert lines == ["`max_temp` 70 °C: no temperature sensor on this machine (mlx-tier thermal lists them); "
                     "it cannot act",
                     "`pause_on_battery` and `min_battery`: no battery sensor on this machine (mlx-tier thermal "
                     "lists them); they cannot act"]
    assert unserved(asked, Reading(max_temp_c=55.0, on_battery=False, battery_percent=80.0)) == []
    assert unserved(ThrottleConfig(min_battery=20), Reading(max_temp_c=40.0)) == [
        "`min_battery`: no battery sensor on this machine (mlx-tier thermal lists them); it cannot act"]
    assert unserved(ThrottleConfig(), Reading()) == []  # nothing asked: nothing to say
    from mlx_tier.job.throttle import Throttle
    assert Throttle(asked, sensors=[]).unserved() == lines  # what the run says, no sensor here
