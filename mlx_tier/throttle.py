"""Thermal-aware throttle: sensors -> a pure controller -> sleeps between decode steps.

Three layers, mechanism apart from policy:

* **Sensors** (one small class each, optional, detected at run time) turn an OS
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
2 serious, 3 critical. Known traps (DESIGN.md, issue 5): macOS background QoS
(``taskpolicy -b``) was reported to throttle Metal decode ~8x, so
:func:`lower_priority` uses ``nice`` unless asked otherwise; Macs sleep mid-run
unless an assertion is held (:func:`keep_awake`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

NOMINAL, FAIR, SERIOUS, CRITICAL = 0, 1, 2, 3
STATE_NAMES = ("nominal", "fair", "serious", "critical")
PLAUSIBLE_C = (-40.0, 150.0)  # sensors report sentinels (-274, 255, 0 for unused) outside this
SUBPROCESS_TIMEOUT_S = 5.0
# psutil has these only where the OS supports them (no temperatures on macOS or Windows).
PSUTIL_BATTERY = getattr(psutil, "sensors_battery", None)
PSUTIL_TEMPERATURES = getattr(psutil, "sensors_temperatures", None)


def state_name(state: int | None) -> str:
    """``"nominal"`` … ``"critical"``, or ``"unknown"`` for None."""
    return "unknown" if state is None else STATE_NAMES[state]


# --------------------------------------------------------------------------- readings


@dataclass(frozen=True)
class Reading:
    """One sample of the machine's condition; None means no sensor said.

    Attributes:
        thermal_state: 0 nominal .. 3 critical (worst over the sensors), or None.
        thermal_source: name of the sensor that gave ``thermal_state``.
        max_temp_c: hottest plausible temperature over all sensors, °C.
        on_battery: True on battery, False on AC, None without a battery sensor.
        battery_percent: charge, 0..100.
        gpu_throttle: active NVIDIA clock-event reasons, e.g. ``("sw_thermal_slowdown",)``.
        details: per-sensor values for display (sensor name -> {field: value}).
        errors: sensor name -> error text, for sensors whose read failed.
    """

    thermal_state: int | None = None
    thermal_source: str | None = None
    max_temp_c: float | None = None
    on_battery: bool | None = None
    battery_percent: float | None = None
    gpu_throttle: tuple[str, ...] = ()
    details: Mapping[str, dict] = field(default_factory=dict)
    errors: Mapping[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["thermal"] = state_name(self.thermal_state)
        d["gpu_throttle"] = list(self.gpu_throttle)
        return d

    def summary(self) -> str:
        """One line: thermal state, hottest temperature, power, GPU reasons."""
        parts = [f"thermal {state_name(self.thermal_state)}" + (f" ({self.thermal_source})" if self.thermal_source else "")]
        if self.max_temp_c is not None:
            parts.append(f"hottest {self.max_temp_c:.1f} °C")
        if self.on_battery is not None or self.battery_percent is not None:
            power = {True: "on battery", False: "on AC", None: "power source unknown"}[self.on_battery]
            pct = f" {self.battery_percent:.0f}%" if self.battery_percent is not None else ""
            parts.append(power + pct)
        if self.gpu_throttle:
            parts.append("GPU clock reasons: " + ", ".join(self.gpu_throttle))
        return "; ".join(parts)


def merge(readings: Iterable[tuple[str, Reading]]) -> Reading:
    """Combine per-sensor readings, pessimistically.

    Worst thermal state, hottest temperature, on battery if any sensor says so,
    lowest battery percent, union of GPU reasons; details and errors side by side.
    """
    state, source, temp, batt, pct = None, None, None, None, None
    reasons: list[str] = []
    details: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for name, r in readings:
        if r.thermal_state is not None and (state is None or r.thermal_state > state):
            state, source = r.thermal_state, r.thermal_source or name
        if r.max_temp_c is not None:
            temp = r.max_temp_c if temp is None else max(temp, r.max_temp_c)
        if r.on_battery is not None:
            batt = r.on_battery or bool(batt)
        if r.battery_percent is not None:
            pct = r.battery_percent if pct is None else min(pct, r.battery_percent)
        reasons += [x for x in r.gpu_throttle if x not in reasons]
        details.update(r.details)
        errors.update(r.errors)
    return Reading(state, source, temp, batt, pct, tuple(reasons), details, errors)


# --------------------------------------------------------------------------- pure parsers


def parse_pmset_therm(text: str) -> int | None:
    """Thermal state 0..3 from ``pmset -g therm`` output, or None if it says nothing usable.

    pmset prints (Apple's pmset source, PowerManagement ``pmset.m``) either
    ``Note: No thermal warning level has been recorded`` or
    ``Thermal Warning Level = N`` (IOPM levels: 0 normal, 5 danger, 10 crisis),
    the same pair for ``Performance Warning Level`` (non-zero: performance is
    being limited), and on Intel Macs a ``CPU Power notify`` block with
    ``CPU_Speed_Limit = P`` (percent of full speed). Mapping: crisis -> critical;
    danger -> serious; any other warning, or a speed limit below 100 -> fair
    (below 50 -> serious).
    """
    state = None
    if re.search(r"No thermal warning level has been recorded", text):
        state = NOMINAL
    for m in re.finditer(r"Thermal Warning Level\s*=\s*(\d+)", text):
        level = int(m.group(1))
        s = CRITICAL if level >= 10 else SERIOUS if level >= 5 else FAIR if level > 0 else NOMINAL
        state = max(state or 0, s)
    for m in re.finditer(r"Performance Warning Level\s*=\s*(\d+)", text):
        state = max(state or 0, FAIR if int(m.group(1)) > 0 else NOMINAL)
    for m in re.finditer(r"CPU_Speed_Limit\s*=\s*(\d+)", text):
        limit = int(m.group(1))
        state = max(state or 0, NOMINAL if limit >= 100 else FAIR if limit >= 50 else SERIOUS)
    return state


# NVML clock-event ("throttle") reason bits, nvml.h nvmlClocksEventReason*; names as nvidia-smi's fields.
NVIDIA_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}
# Which reasons mean heat. Power caps and idle are reported but do not slow us down.
NVIDIA_REASON_STATE = {"sw_thermal_slowdown": FAIR, "hw_slowdown": FAIR, "hw_thermal_slowdown": SERIOUS}


def decode_nvidia_reasons(mask: int) -> tuple[str, ...]:
    """Names of the set bits of an NVML clock-event reason mask (unknown bits as hex)."""
    names = [name for bit, name in NVIDIA_REASONS.items() if mask & bit]
    rest = mask & ~sum(NVIDIA_REASONS)
    return tuple(names + ([hex(rest)] if rest else []))


def nvidia_state(reasons: Iterable[str]) -> int:
    """Thermal state implied by NVIDIA clock-event reasons (NOMINAL when none is thermal)."""
    return max((NVIDIA_REASON_STATE.get(r, NOMINAL) for r in reasons), default=NOMINAL)


def parse_nvidia_smi(text: str) -> list[tuple[float | None, int | None]]:
    """Parse ``nvidia-smi --query-gpu=temperature.gpu,clocks_throttle_reasons.active
    --format=csv,noheader,nounits``: one ``(temperature °C, reason mask)`` per GPU line.

    A field nvidia-smi cannot give (``[N/A]``, ``[Not Supported]``) becomes None.

    Raises:
        ValueError: a line that is not two comma-separated fields.
    """
    gpus = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2:
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        temp, mask = fields
        gpus.append((
            float(temp) if re.fullmatch(r"-?\d+(\.\d+)?", temp) else None,
            int(mask, 16) if re.fullmatch(r"0x[0-9a-fA-F]+", mask) else None,
        ))
    return gpus


@dataclass(frozen=True)
class ThermalZone:
    """One ``/sys/class/thermal/thermal_zoneN``: temperature and trip points in °C."""

    name: str  # thermal_zoneN
    type: str  # e.g. x86_pkg_temp, acpitz
    temp_c: float
    trips: tuple[tuple[str, float], ...]  # (trip type: passive/active/hot/critical, °C)

    def state(self) -> int:
        """Critical trip reached -> critical; hot -> serious; passive (kernel cooling) -> fair."""
        level = {"passive": FAIR, "hot": SERIOUS, "critical": CRITICAL}
        return max((level.get(kind, NOMINAL) for kind, t in self.trips if self.temp_c >= t), default=NOMINAL)


def read_thermal_zones(root: Path) -> list[ThermalZone]:
    """Every readable zone under ``root`` (normally ``/sys/class/thermal``).

    Values are millidegrees Celsius (Linux sysfs-class-thermal ABI). Zones whose
    temperature is unreadable or implausible, and trips <= 0 °C, are skipped.
    """
    zones = []
    for zone in sorted(root.glob("thermal_zone*")):
        try:
            temp = int((zone / "temp").read_text().strip()) / 1000
            kind = (zone / "type").read_text().strip()
        except (OSError, ValueError):
            continue
        if not PLAUSIBLE_C[0] < temp < PLAUSIBLE_C[1]:
            continue
        trips = []
        for tp in sorted(zone.glob("trip_point_*_temp")):
            try:
                t = int(tp.read_text().strip()) / 1000
                trip_kind = tp.with_name(tp.name.replace("_temp", "_type")).read_text().strip()
            except (OSError, ValueError):
                continue
            if t > 0:
                trips.append((trip_kind, t))
        zones.append(ThermalZone(zone.name, kind, temp, tuple(trips)))
    return zones


def limits_state(current: float, high: float | None, critical: float | None) -> int:
    """Thermal state from a psutil temperature entry: at its critical limit -> critical, at its high limit -> serious."""
    if critical and critical > 0 and current >= critical:
        return CRITICAL
    if high and high > 0 and current >= high:
        return SERIOUS
    return NOMINAL


# --------------------------------------------------------------------------- OS wrappers


def run_text(cmd: list[str]) -> str:
    """stdout of ``cmd`` (UTF-8).

    Raises:
        OSError: the program is missing; subprocess.CalledProcessError / TimeoutExpired.
    """
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=SUBPROCESS_TIMEOUT_S).stdout


@functools.lru_cache(maxsize=1)
def _objc_thermal_state_call() -> Callable[[], int]:
    libobjc = ctypes.util.find_library("objc") or "/usr/lib/libobjc.A.dylib"
    objc = ctypes.CDLL(libobjc)
    ctypes.CDLL("/System/Library/Frameworks/Foundation.framework/Foundation")  # registers NSProcessInfo
    objc.objc_getClass.restype = ctypes.c_void_p
    objc.objc_getClass.argtypes = [ctypes.c_char_p]
    objc.sel_registerName.restype = ctypes.c_void_p
    objc.sel_registerName.argtypes = [ctypes.c_char_p]
    # objc_msgSend must be called through a prototype of the exact signature (arm64 ABI).
    addr = ctypes.cast(objc.objc_msgSend, ctypes.c_void_p).value
    send_id = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(addr)
    send_long = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)(addr)  # NSInteger
    cls = objc.objc_getClass(b"NSProcessInfo")
    if not cls:
        raise OSError("NSProcessInfo class not found")
    process_info, thermal_state = objc.sel_registerName(b"processInfo"), objc.sel_registerName(b"thermalState")
    return lambda: int(send_long(send_id(cls, process_info), thermal_state))


def ns_thermal_state() -> int:
    """``[[NSProcessInfo processInfo] thermalState]`` (macOS 10.10.3+): 0 nominal .. 3 critical.

    Raises:
        OSError: not macOS, or the Objective-C runtime / Foundation cannot be loaded.
        ValueError: a value outside 0..3.
    """
    state = _objc_thermal_state_call()()
    if not 0 <= state <= 3:
        raise ValueError(f"NSProcessInfo.thermalState returned {state}")
    return state


# --------------------------------------------------------------------------- sensors


class Sensor:
    """A source of :class:`Reading`. Subclasses set ``name`` and implement
    ``unavailable_reason()`` (None when usable, else why not) and ``read()``."""

    name = "sensor"

    def unavailable_reason(self) -> str | None:
        raise NotImplementedError

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def read(self) -> Reading:
        raise NotImplementedError


class MacThermalSensor(Sensor):
    """macOS thermal state: NSProcessInfo via ctypes, falling back to ``pmset -g therm``."""

    name = "macos-thermal"

    def __init__(self, platform: str = sys.platform, ns_state: Callable[[], int] = ns_thermal_state,
                 run: Callable[[list[str]], str] = run_text) -> None:
        self.platform, self.ns_state, self.run = platform, ns_state, run

    def unavailable_reason(self) -> str | None:
        return None if self.platform == "darwin" else "macOS only"

    def read(self) -> Reading:
        try:
            state, source = self.ns_state(), "NSProcessInfo"
        except (OSError, ValueError, AttributeError):
            state, source = parse_pmset_therm(self.run(["pmset", "-g", "therm"])), "pmset -g therm"
        return Reading(thermal_state=state, thermal_source=self.name if state is not None else None,
                       details={self.name: {"state": state_name(state), "source": source}})


class BatterySensor(Sensor):
    """Battery charge and AC/battery power via ``psutil.sensors_battery``."""

    name = "battery"

    def __init__(self, battery: Callable[[], object] | None = PSUTIL_BATTERY) -> None:
        self.battery = battery

    def unavailable_reason(self) -> str | None:
        if self.battery is None:
            return "psutil has no battery support on this OS"
        if self.battery() is None:
            return "no battery found (desktop, server or VM)"
        return None

    def read(self) -> Reading:
        b = self.battery()
        if b is None:
            return Reading()
        plugged = b.power_plugged  # None when the OS cannot tell
        on_battery = None if plugged is None else not plugged
        return Reading(on_battery=on_battery, battery_percent=float(b.percent),
                       details={self.name: {"percent": round(float(b.percent), 1),
                                            "power": {True: "battery", False: "AC", None: "unknown"}[on_battery]}})


class TemperatureSensor(Sensor):
    """Hardware temperatures via ``psutil.sensors_temperatures`` (Linux hwmon, else thermal zones)."""

    name = "temperatures"

    def __init__(self, temperatures: Callable[[], dict] | None = PSUTIL_TEMPERATURES) -> None:
        self.temperatures = temperatures

    def unavailable_reason(self) -> str | None:
        if self.temperatures is None:
            return "psutil has no temperature support on this OS"
        if not self.temperatures():
            return "no temperature sensors (nothing under /sys/class/hwmon or /sys/class/thermal; usual in VMs)"
        return None

    def read(self) -> Reading:
        hottest, where, state = None, None, NOMINAL
        for chip, entries in self.temperatures().items():
            for e in entries:
                if not PLAUSIBLE_C[0] < e.current < PLAUSIBLE_C[1]:
                    continue
                if hottest is None or e.current > hottest:
                    hottest, where = e.current, f"{chip}/{e.label or chip}"
                state = max(state, limits_state(e.current, e.high, e.critical))
        if hottest is None:
            return Reading(details={self.name: {"sensors": "none plausible"}})
        return Reading(thermal_state=state, thermal_source=self.name, max_temp_c=hottest,
                       details={self.name: {"hottest_c": round(hottest, 1), "at": where, "state": state_name(state)}})


class ThermalZoneSensor(Sensor):
    """Linux thermal zones read directly: temperatures and trip points (see :func:`read_thermal_zones`)."""

    name = "thermal-zones"

    def __init__(self, root: Path = Path("/sys/class/thermal")) -> None:
        self.root = root

    def unavailable_reason(self) -> str | None:
        if not self.root.is_dir():
            return f"no {self.root} (not Linux)"
        if not read_thermal_zones(self.root):
            return f"no readable thermal zone under {self.root} (usual in VMs and containers)"
        return None

    def read(self) -> Reading:
        zones = read_thermal_zones(self.root)
        if not zones:
            return Reading()
        hot = max(zones, key=lambda z: z.temp_c)
        state = max(z.state() for z in zones)
        return Reading(thermal_state=state, thermal_source=self.name, max_temp_c=hot.temp_c,
                       details={self.name: {"zones": len(zones), "hottest_c": round(hot.temp_c, 1),
                                            "at": f"{hot.name} ({hot.type})", "state": state_name(state)}})


def _import_nvml():
    try:
        import pynvml  # the `nvidia-ml-py` package (extra `nvidia`)
    except ImportError:
        return None
    return pynvml


class NvidiaSensor(Sensor):
    """NVIDIA GPU temperature and clock-event reasons: NVML (``nvidia-ml-py``) if importable, else ``nvidia-smi``."""

    name = "nvidia"
    SMI_FIELDS = ("clocks_throttle_reasons.active", "clocks_event_reasons.active")  # older / newer drivers

    def __init__(self, nvml=None, smi: str | None = None, run: Callable[[list[str]], str] = run_text,
                 detect: bool = True) -> None:
        """``nvml``: a pynvml-like module (default: import it); ``smi``: path of nvidia-smi
        (default: found on PATH). ``detect=False`` uses exactly what is given (tests)."""
        self.nvml = nvml if nvml is not None or not detect else _import_nvml()
        self.smi = smi if smi is not None or not detect else shutil.which("nvidia-smi")
        self.run = run
        self._nvml_ready: bool | None = None
        self._nvml_error = ""
        self._smi_field = self.SMI_FIELDS[0]

    def _nvml_ok(self) -> bool:
        if self._nvml_ready is None:
            try:
                self.nvml.nvmlInit()
                self._nvml_ready = self.nvml.nvmlDeviceGetCount() > 0
                self._nvml_error = "" if self._nvml_ready else "no GPU"
            except Exception as e:  # noqa: BLE001 - pynvml's NVMLError (no driver, no GPU): use nvidia-smi
                self._nvml_ready, self._nvml_error = False, str(e) or type(e).__name__
        return self._nvml_ready

    def unavailable_reason(self) -> str | None:
        if self.nvml is not None and self._nvml_ok():
            return None
        if self.smi:
            return None
        if self.nvml is not None:
            return f"NVML: {self._nvml_error}; nvidia-smi is not on PATH"
        return "no NVIDIA driver tools: neither nvidia-ml-py (NVML) nor nvidia-smi found"

    def _gpus_nvml(self) -> list[tuple[float | None, int | None]]:
        nv = self.nvml
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            gpus.append((float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)), int(reasons(h))))
        return gpus

    def _gpus_smi(self) -> list[tuple[float | None, int | None]]:
        fields = [self._smi_field] + [f for f in self.SMI_FIELDS if f != self._smi_field]
        for i, name in enumerate(fields):
            try:
                text = self.run([self.smi, f"--query-gpu=temperature.gpu,{name}", "--format=csv,noheader,nounits"])
            except subprocess.CalledProcessError:  # this driver does not know the field's name
                if i == len(fields) - 1:
                    raise
                continue
            self._smi_field = name
            return parse_nvidia_smi(text)
        return []

    def read(self) -> Reading:
        via_nvml = self.nvml is not None and self._nvml_ok()
        gpus = self._gpus_nvml() if via_nvml else self._gpus_smi()
        temps = [t for t, _ in gpus if t is not None]
        reasons: list[str] = []
        for _, mask in gpus:
            reasons += [r for r in decode_nvidia_reasons(mask or 0) if r not in reasons]
        state = nvidia_state(reasons)
        return Reading(thermal_state=state, thermal_source=self.name, max_temp_c=max(temps, default=None),
                       gpu_throttle=tuple(reasons),
                       details={self.name: {"gpus": len(gpus), "temps_c": temps, "reasons": reasons,
                                            "source": "NVML" if via_nvml else "nvidia-smi"}})


def known_sensors() -> list[Sensor]:
    """One instance of every sensor kind, available here or not (for ``mlx-tier thermal``)."""
    return [MacThermalSensor(), BatterySensor(), TemperatureSensor(), ThermalZoneSensor(), NvidiaSensor()]


def default_sensors() -> list[Sensor]:
    """The sensors this machine has (probing runs each once: ~ms, plus NVML/nvidia-smi start-up if present)."""
    return [s for s in known_sensors() if s.available()]


def read_sensor(sensor: Sensor) -> Reading:
    """``sensor.read()``; a failure becomes ``Reading.errors[name]`` instead of an exception.

    Sensors are optional: one that breaks mid-run (driver reload, pmset missing)
    must not stop an overnight job, so any exception is recorded, not raised.
    """
    try:
        return sensor.read()
    except Exception as e:  # noqa: BLE001 - see docstring
        return Reading(errors={sensor.name: f"{type(e).__name__}: {e}"})


def read_all(sensors: Iterable[Sensor]) -> Reading:
    """Read every sensor and :func:`merge` the results."""
    return merge((s.name, read_sensor(s)) for s in sensors)


@dataclass(frozen=True)
class SensorStatus:
    """What ``mlx-tier thermal`` shows for one sensor."""

    name: str
    available: bool
    reason: str | None  # why unavailable
    reading: Reading | None  # None when unavailable

    def as_dict(self) -> dict:
        return {"name": self.name, "available": self.available, "unavailable_reason": self.reason,
                "reading": self.reading.as_dict() if self.reading else None}


def survey(sensors: Iterable[Sensor] | None = None) -> list[SensorStatus]:
    """Probe and read every sensor (default: :func:`known_sensors`)."""
    out = []
    for s in known_sensors() if sensors is None else sensors:
        try:
            why = s.unavailable_reason()
        except Exception as e:  # noqa: BLE001 - a probe that breaks means unavailable, with its reason
            why = f"probe failed: {type(e).__name__}: {e}"
        out.append(SensorStatus(s.name, why is None, why, read_sensor(s) if why is None else None))
    return out


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
        """Raises ValueError (with the option's name) on a value out of range."""
        if self.max_temp is not None and not (math.isfinite(self.max_temp) and 0 < self.max_temp < PLAUSIBLE_C[1]):
            raise ValueError(f"--max-temp must be between 0 and {PLAUSIBLE_C[1]:.0f} °C, got {self.max_temp}")
        if self.min_battery is not None and not 0 < self.min_battery <= 100:
            raise ValueError(f"--min-battery must be a percentage in (0, 100], got {self.min_battery}")
        if self.max_tok_s is not None and not (math.isfinite(self.max_tok_s) and self.max_tok_s > 0):
            raise ValueError(f"--max-tok-s must be a positive number, got {self.max_tok_s}")
        for name in ("fair_duty", "serious_duty", "hot_duty"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("poll_seconds", "stop_check_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("temp_hysteresis", "battery_hysteresis", "resume_after"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


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
            limits.append((c.hot_duty, f"{t}, --max-temp {c.max_temp:g} °C"))
        if c.pause_on_battery and r.on_battery:
            limits.append((0.0, "on battery (--pause-on-battery)"))
        if c.min_battery is not None:
            if r.on_battery is False:
                self._low_battery = False  # charging
            elif r.battery_percent is not None:
                floor = c.min_battery + c.battery_hysteresis if self._low_battery else c.min_battery
                self._low_battery = r.battery_percent < floor
            if self._low_battery:
                pct = f"{r.battery_percent:.0f}%" if r.battery_percent is not None else "unknown"
                limits.append((0.0, f"battery {pct}, --min-battery {c.min_battery:g}%"))
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
        """For report.json / ``status``: time throttled, paused and capped (s), the timeline of
        ``{"t": s since first step, "thermal", "mode", "duty", "reason"}`` changes, the last reading."""
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


# --------------------------------------------------------------------------- process hygiene


@contextlib.contextmanager
def keep_awake(spawn: Callable[[list[str]], subprocess.Popen] = subprocess.Popen, platform: str = sys.platform,
               pid: int | None = None) -> Iterator[subprocess.Popen | None]:
    """Hold a macOS no-idle-sleep assertion while the block runs (``caffeinate -i -w <pid>``).

    ``-w`` ties the assertion to this process, so it ends even if we crash. On
    other platforms, or without ``caffeinate``, a no-op yielding None.
    """
    proc = None
    if platform == "darwin":
        try:
            proc = spawn(["caffeinate", "-i", "-w", str(pid or os.getpid())])
        except OSError:
            proc = None
    try:
        yield proc
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


BACKGROUND_QOS_WARNING = (
    "background QoS (taskpolicy -b) was reported to slow Metal decode ~8x; "
    "use it only if the Mac must stay responsive and the job may take much longer"
)


def lower_priority(nice: int = 10, background_qos: bool = False, *, platform: str = sys.platform,
                   renice: Callable[[int], int] = os.nice, run: Callable[[list[str]], object] = run_text,
                   pid: int | None = None) -> str | None:
    """Lower this process's CPU priority by ``nice`` (``os.nice`` increment, 0 = unchanged).

    With ``background_qos`` on macOS also ``taskpolicy -b -p <pid>`` (darwin
    background QoS: lowest CPU, I/O and GPU priority). Returns a warning text
    (the ~8x Metal slowdown, or that the option does nothing off macOS), else None.

    Raises:
        ValueError: ``nice`` negative (raising priority needs root; not our business).
        subprocess.CalledProcessError: ``taskpolicy`` failed.
    """
    if nice < 0:
        raise ValueError(f"nice must be >= 0, got {nice}")
    if nice:
        renice(nice)
    if not background_qos:
        return None
    if platform != "darwin":
        return "background QoS is macOS-only; ignored here (nice applied)"
    run(["taskpolicy", "-b", "-p", str(pid or os.getpid())])
    return BACKGROUND_QOS_WARNING
