"""Thermal-aware throttle: sensors -> a pure controller -> sleeps between decode steps.

Three layers, mechanism apart from policy:

* **Sensors** (:mod:`mlx_tier.job.sensors`; one small class each, optional, detected at run time) turn an OS
  interface into a :class:`Reading`: macOS thermal state (``NSProcessInfo``
  through the Objective-C runtime, else ``pmset -g therm``), battery and AC
  (``psutil.sensors_battery``), Linux temperatures (``psutil.sensors_temperatures``)
  and thermal zones (``/sys/class/thermal``), NVIDIA temperature and clock-event
  ("throttle") reasons (NVML via ``nvidia-ml-py`` if installed, else
  ``nvidia-smi``). Output parsing is pure functions; the OS calls are thin
  wrappers around them.
* **Controller** (:class:`Controller`): readings -> :class:`Decision` (a duty
  cycle in (0, 1], or a pause), with hysteresis so it does not flap. No I/O.
* **Throttle** (:class:`Throttle`): the job runner calls ``step(tokens)`` after
  each decode step. It polls the sensors at most every ``poll_seconds`` and
  sleeps *between* steps, never inside a forward pass: mlx-lm's generator
  queues step n+1 before yielding token n, so a sleep in the token callback
  lets that step finish and only delays queueing the next one.

Thermal states follow ``NSProcessInfoThermalState``: 0 nominal, 1 fair,
2 serious, 3 critical. Process hygiene (keeping a Mac awake, lowering
priority) lives in :mod:`mlx_tier.job.process`.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from mlx_tier.errors import ConfigError
from mlx_tier.job.sensors import (
    CRITICAL,
    FAIR,
    NOMINAL,
    PLAUSIBLE_C,
    SERIOUS,
    Reading,
    Sensor,
    default_sensors,
    read_all,
    state_name,
)

# --------------------------------------------------------------------------- controller


@dataclass(frozen=True)
class ThrottleConfig:
    """Throttle policy. Defaults: follow the OS thermal state only; every other limit off.

    Attributes:
        max_temp: °C; above it run at ``hot_duty`` until it falls ``temp_hysteresis`` below. None = off.
        pause_on_battery: pause while the machine runs on battery.
        min_battery: percent; pause on battery below it, until ``battery_hysteresis`` above or on AC. None = off.
        max_tok_s: hard cap on tokens per second (decode steps x tokens per step). None = off.
        poll_seconds: read the sensors at most this often.
        fair_duty, serious_duty, hot_duty: fraction of wall time spent computing in those conditions.
        temp_hysteresis: °C below ``max_temp`` to clear it.
        battery_hysteresis: percent above ``min_battery`` to clear it.
        resume_after: seconds a less restrictive decision must hold before the throttle speeds up
            (slowing down is immediate), so it does not flap at a boundary.
        stop_check_seconds: longest single sleep, so a stop request is seen promptly.
    """

    max_temp: float | None = None
    pause_on_battery: bool = False
    min_battery: float | None = None
    max_tok_s: float | None = None
    poll_seconds: float = 5.0
    fair_duty: float = 0.75
    serious_duty: float = 0.4
    hot_duty: float = 0.5
    temp_hysteresis: float = 3.0
    battery_hysteresis: float = 5.0
    resume_after: float = 15.0
    stop_check_seconds: float = 0.25

    def __post_init__(self) -> None:
        """Raises :class:`~mlx_tier.errors.ConfigError` (a ValueError; ``field``: the
        setting, named `like_this` in the message) on a value out of range."""
        if self.max_temp is not None and not (math.isfinite(self.max_temp) and 0 < self.max_temp < PLAUSIBLE_C[1]):
            raise ConfigError(f"`max_temp` must be between 0 and {PLAUSIBLE_C[1]:.0f} °C, got {self.max_temp}",
                              "max_temp")
        if self.min_battery is not None and not 0 < self.min_battery <= 100:
            raise ConfigError(f"`min_battery` must be a percentage in (0, 100], got {self.min_battery}", "min_battery")
        if self.max_tok_s is not None and not (math.isfinite(self.max_tok_s) and self.max_tok_s > 0):
            raise ConfigError(f"`max_tok_s` must be a positive number, got {self.max_tok_s}", "max_tok_s")
        for name in ("fair_duty", "serious_duty", "hot_duty"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("poll_seconds", "stop_check_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("temp_hysteresis", "battery_hysteresis", "resume_after"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def unserved(config: ThrottleConfig, reading: Reading) -> list[str]:
    """One line for each limit of ``config`` that no sensor of ``reading`` (every sensor
    read once) can serve: ``max_temp`` without a temperature, ``pause_on_battery`` or
    ``min_battery`` without a battery; ``[]`` when each can act. Setting names in
    backquotes (the CLI shows them as flags)."""
    out = []
    if config.max_temp is not None and reading.max_temp_c is None:
        out.append(f"`max_temp` {config.max_temp:g} °C: no temperature sensor on this machine "
                   "(mlx-tier thermal lists them); it cannot act")
    asked = [name for name, on in (("`pause_on_battery`", config.pause_on_battery),
                                   ("`min_battery`", config.min_battery is not None)) if on]
    if asked and reading.on_battery is None and reading.battery_percent is None:
        out.append(f"{' and '.join(asked)}: no battery sensor on this machine (mlx-tier thermal lists them); "
                   f"{'they' if len(asked) > 1 else 'it'} cannot act")
    return out


@dataclass(frozen=True)
class Decision:
    """What the runner does between decode steps.

    ``duty`` is the fraction of wall time spent computing, in (0, 1]; 0.0 means
    paused. ``reason`` says why, e.g. ``"thermal state serious (nvidia)"``.
    """

    duty: float
    reason: str

    @property
    def paused(self) -> bool:
        return self.duty == 0.0

    @property
    def mode(self) -> str:
        return "paused" if self.paused else "full" if self.duty >= 1.0 else "slow"


FULL_SPEED = Decision(1.0, "nominal")


class Controller:
    """Readings -> :class:`Decision`. No I/O; ``now`` (seconds, any monotonic origin) comes from the caller.

    Each condition proposes a duty: thermal state fair/serious -> ``fair_duty``/
    ``serious_duty``, critical -> pause; hotter than ``max_temp`` -> ``hot_duty``;
    on battery with ``pause_on_battery``, or below ``min_battery`` -> pause. The
    lowest wins. Hysteresis: ``max_temp`` and ``min_battery`` clear only past a
    margin; a slower decision applies at once, a faster one only after it has
    been proposed continuously for ``resume_after`` seconds.
    """

    def __init__(self, config: ThrottleConfig) -> None:
        self.config = config
        self.current = FULL_SPEED
        self._hot = False
        self._low_battery = False
        self._relax_since: float | None = None

    def proposal(self, r: Reading) -> Decision:
        """The decision for this reading alone (updates the temperature and battery latches)."""
        c = self.config
        limits: list[tuple[float, str]] = []
        if r.thermal_state is not None and r.thermal_state > NOMINAL:
            duty = {FAIR: c.fair_duty, SERIOUS: c.serious_duty, CRITICAL: 0.0}[r.thermal_state]
            src = f" ({r.thermal_source})" if r.thermal_source else ""
            limits.append((duty, f"thermal state {state_name(r.thermal_state)}{src}"))
        if c.max_temp is not None and r.max_temp_c is not None:
            self._hot = r.max_temp_c > (c.max_temp - c.temp_hysteresis if self._hot else c.max_temp)
        if self._hot:
            t = f"{r.max_temp_c:.1f} °C" if r.max_temp_c is not None else "temperature unknown"
            limits.append((c.hot_duty, f"{t}, `max_temp` {c.max_temp:g} °C"))
        if c.pause_on_battery and r.on_battery:
            limits.append((0.0, "on battery (`pause_on_battery`)"))
        if c.min_battery is not None:
            if r.on_battery is False:
                self._low_battery = False  # charging
            elif r.battery_percent is not None:
                floor = c.min_battery + c.battery_hysteresis if self._low_battery else c.min_battery
                self._low_battery = r.battery_percent < floor
            if self._low_battery:
                pct = f"{r.battery_percent:.0f}%" if r.battery_percent is not None else "unknown"
                limits.append((0.0, f"battery {pct}, `min_battery` {c.min_battery:g}%"))
        if not limits:
            return FULL_SPEED
        duty = min(d for d, _ in limits)
        return Decision(duty, "; ".join(why for _, why in sorted(limits)))

    def decide(self, reading: Reading, now: float) -> Decision:
        """The decision to apply from ``now`` on (see the class docstring for hysteresis)."""
        p = self.proposal(reading)
        if p.duty <= self.current.duty:
            self.current, self._relax_since = p, None
        else:
            if self._relax_since is None:
                self._relax_since = now
            if now - self._relax_since >= self.config.resume_after:
                self.current, self._relax_since = p, None
        return self.current


# --------------------------------------------------------------------------- throttle


class Throttle:
    """Applies a :class:`Controller` between decode steps; counts what it cost.

    Usage (the job runner)::

        throttle = Throttle(ThrottleConfig(max_temp=85), should_stop=lambda: stop.signal is not None)
        for each decode step producing n tokens:   # e.g. in stream_generate's loop
            throttle.step(n)
        report["throttle"] = throttle.as_dict()

    ``step`` measures the wall time since the previous ``step`` returned (the
    first call only starts the clock) as the step's work time ``t``, then:
    duty ``d`` < 1 -> sleep ``t * (1 - d) / d`` (so work / wall = d); paused ->
    sleep-poll until the controller resumes or ``should_stop()``; ``max_tok_s``
    -> pace so no interval runs faster than the cap (virtual-time pacing:
    each token costs ``1 / max_tok_s`` s). Sleeps are cut into
    ``stop_check_seconds`` pieces and end early once ``should_stop()`` is true.
    Sensors are read at most every ``poll_seconds``; nothing allocates per token.
    """

    def __init__(self, config: ThrottleConfig, sensors: Iterable[Sensor] | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 should_stop: Callable[[], bool] = lambda: False, max_timeline: int = 1000) -> None:
        """``sensors`` default to :func:`default_sensors` (probed now). ``clock``/``sleep`` in seconds."""
        self.config = config
        self.sensors = default_sensors() if sensors is None else list(sensors)
        self.controller = Controller(config)
        self.clock, self.sleep, self.should_stop = clock, sleep, should_stop
        self.decision = FULL_SPEED
        self.reading: Reading | None = None
        self.timeline: list[dict] = []
        self.max_timeline = max_timeline
        self.timeline_dropped = 0
        self.throttled_seconds = 0.0  # duty-cycle sleeps (heat)
        self.paused_seconds = 0.0
        self.capped_seconds = 0.0  # --max-tok-s sleeps
        self.tokens = 0
        self._start: float | None = None
        self._last_end = 0.0  # when the previous step() returned
        self._last_poll = -math.inf
        self._pace = 0.0  # virtual time by which the tokens so far may have been produced (max_tok_s)

    def unserved(self) -> list[str]:
        """:func:`unserved` for this throttle's limits, its sensors read once (only when a
        limit that needs one is set)."""
        c = self.config
        if c.max_temp is None and not c.pause_on_battery and c.min_battery is None:
            return []
        return unserved(c, read_all(self.sensors))

    def step(self, tokens: int = 1) -> float:
        """Call after each decode step that produced ``tokens`` tokens; returns seconds slept."""
        now = self.clock()
        if self._start is None:
            self._start = self._last_end = self._pace = now
            self._poll(now)
            return 0.0
        work = now - self._last_end
        self.tokens += tokens
        if now - self._last_poll >= self.config.poll_seconds:
            self._poll(now)
        if self.decision.paused:
            self._hold_pause()
        elif self.decision.duty < 1.0:
            d = self.decision.duty
            self.throttled_seconds += self._sleep_for(work * (1.0 - d) / d)
        if self.config.max_tok_s is not None:
            self._pace = max(self._pace, self._last_end) + tokens / self.config.max_tok_s
            self.capped_seconds += self._sleep_for(self._pace - self.clock())
        end = self.clock()
        slept, self._last_end = end - now, end
        return slept

    def _poll(self, now: float) -> None:
        self.reading = read_all(self.sensors)
        self._last_poll = now
        decision = self.controller.decide(self.reading, now)
        thermal = state_name(self.reading.thermal_state)
        last = self.timeline[-1] if self.timeline else None
        if last is None or (last["thermal"], last["duty"], last["reason"]) != (thermal, decision.duty, decision.reason):
            entry = {"t": round(now - self._start, 3), "thermal": thermal, "mode": decision.mode,
                     "duty": decision.duty, "reason": decision.reason}
            if self.config.max_tok_s is not None:  # the hard cap applies beside the state
                entry["max_tok_s"] = self.config.max_tok_s
            if len(self.timeline) < self.max_timeline:
                self.timeline.append(entry)
            else:
                self.timeline_dropped += 1
        self.decision = decision

    def _sleep_for(self, seconds: float) -> float:
        """Sleep up to ``seconds`` in short pieces, stopping early on ``should_stop()``; returns time slept."""
        start = self.clock()
        end = start + seconds
        while not self.should_stop():
            left = end - self.clock()
            if left <= 0:
                break
            self.sleep(min(left, self.config.stop_check_seconds))
        return max(0.0, self.clock() - start)

    def _hold_pause(self) -> None:
        start = self.clock()
        while self.decision.paused and not self.should_stop():
            until_poll = self._last_poll + self.config.poll_seconds - self.clock()
            self.sleep(max(0.0, min(until_poll, self.config.stop_check_seconds)))
            now = self.clock()
            if now - self._last_poll >= self.config.poll_seconds:
                self._poll(now)
        self.paused_seconds += self.clock() - start

    def as_dict(self) -> dict:
        """For report.json / ``status``: time throttled, paused and capped (s), ``tokens``
        decoded under it (a final stop token included: decoded, though no summary holds it),
        the timeline of ``{"t": s since first step, "thermal", "mode", "duty", "reason"}``
        changes, the last reading."""
        elapsed = (self._last_end - self._start) if self._start is not None else 0.0
        return {
            "sensors": [s.name for s in self.sensors],
            "config": asdict(self.config),
            "elapsed_seconds": round(elapsed, 3),
            "throttled_seconds": round(self.throttled_seconds, 3),
            "paused_seconds": round(self.paused_seconds, 3),
            "capped_seconds": round(self.capped_seconds, 3),
            "tokens": self.tokens,
            "decision": {"mode": self.decision.mode, "duty": self.decision.duty, "reason": self.decision.reason},
            "timeline": list(self.timeline),
            "timeline_dropped": self.timeline_dropped,
            "last_reading": self.reading.as_dict() if self.reading else None,
        }
