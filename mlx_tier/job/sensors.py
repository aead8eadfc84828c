"""Thermal and power sensors for the throttle: each optional, detected at run time.

One small class per OS interface, each turning it into a :class:`Reading`:
macOS thermal state (``NSProcessInfo`` through the Objective-C runtime, else
``pmset -g therm``), battery and AC (``psutil.sensors_battery``), Linux
temperatures (``psutil.sensors_temperatures``) and thermal zones
(``/sys/class/thermal``), NVIDIA temperature and clock-event ("throttle")
reasons (NVML via ``nvidia-ml-py`` if installed, else ``nvidia-smi``). Output
parsing is pure functions; the OS calls are thin wrappers around them. The
controller that turns readings into a duty cycle is :mod:`mlx_tier.job.throttle`.

Thermal states follow ``NSProcessInfoThermalState``: 0 nominal, 1 fair,
2 serious, 3 critical.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
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
