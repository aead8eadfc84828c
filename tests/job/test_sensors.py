"""Sensors: pure parsers of OS outputs, and the probes around them.

Invariant guarded here: each parser turns a recorded output of its tool
(``pmset -g therm``, ``nvidia-smi``, ``/sys/class/thermal``, psutil, NVML)
into the right reading, and a sensor whose source is missing says why
instead of failing. Nothing here needs the hardware it reads, except the
macOS check marked to run only on a Mac.
"""

from __future__ import annotations

import subprocess
import sys
from collections import namedtuple

import pytest
from support.sensors import FakeRun, write_zone

from mlx_tier.job import sensors as th
from mlx_tier.job.sensors import (
    CRITICAL,
    FAIR,
    NOMINAL,
    SERIOUS,
    BatterySensor,
    MacThermalSensor,
    NvidiaSensor,
    TemperatureSensor,
    ThermalZoneSensor,
    parse_nvidia_smi,
    parse_pmset_therm,
    read_thermal_zones,
)

PMSET_APPLE_SILICON = (
    "Note: No thermal warning level has been recorded\n"
    "Note: No performance warning level has been recorded\n"
    "Note: No CPU power status has been recorded\n"
)
PMSET_INTEL = (
    "Note: No thermal warning level has been recorded\n"
    "Note: No performance warning level has been recorded\n"
    "2020-11-24 13:10:40 +0100 CPU Power notify\n"
    "\tCPU_Scheduler_Limit \t= 100\n\tCPU_Available_CPUs \t= 8\n\tCPU_Speed_Limit \t= {limit}\n"
)
# Printed when a level was published (pmset.m: "Thermal Warning Level = %d"); IOPM 5 danger, 10 crisis.
PMSET_WARNING = (
    "2024-06-01 12:00:00 +0200 Thermal Warning Level = {thermal}\n"
    "Note: No performance warning level has been recorded\n"
    "Note: No CPU power status has been recorded\n"
)


@pytest.mark.parametrize("text, state", [
    (PMSET_APPLE_SILICON, NOMINAL),
    (PMSET_INTEL.format(limit=100), NOMINAL),
    (PMSET_INTEL.format(limit=80), FAIR),
    (PMSET_INTEL.format(limit=35), SERIOUS),
    (PMSET_WARNING.format(thermal=0), NOMINAL),
    (PMSET_WARNING.format(thermal=5), SERIOUS),
    (PMSET_WARNING.format(thermal=10), CRITICAL),
    ("Note: No thermal warning level has been recorded\nPerformance Warning Level = 100\n", FAIR),
    ("", None),
])
def test_parse_pmset_therm(text, state):
    assert parse_pmset_therm(text) == state


# `nvidia-smi --query-gpu=temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader,nounits`
SMI_IDLE = "34, 0x0000000000000001\n"
SMI_TWO_GPUS_HOT = "83, 0x0000000000000000\n91, 0x0000000000000060\n"
SMI_NOT_SUPPORTED = "[N/A], [Not Supported]\n"


def test_parse_nvidia_smi_and_reasons():
    assert parse_nvidia_smi(SMI_IDLE) == [(34.0, 0x1)]
    assert parse_nvidia_smi(SMI_TWO_GPUS_HOT) == [(83.0, 0), (91.0, 0x60)]
    assert parse_nvidia_smi(SMI_NOT_SUPPORTED) == [(None, None)]
    assert th.decode_nvidia_reasons(0x60) == ("sw_thermal_slowdown", "hw_thermal_slowdown")
    assert th.decode_nvidia_reasons(0x1004) == ("sw_power_cap", "0x1000")
    assert th.nvidia_state(("gpu_idle", "sw_power_cap")) == NOMINAL
    assert th.nvidia_state(("sw_thermal_slowdown",)) == FAIR
    assert th.nvidia_state(("sw_thermal_slowdown", "hw_thermal_slowdown")) == SERIOUS
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        parse_nvidia_smi("34\n")




def test_thermal_zones_from_a_fake_sysfs_tree(tmp_path):
    root = tmp_path / "thermal"
    write_zone(root, 0, "acpitz", 27800, [("critical", 105000), ("passive", 0)])
    write_zone(root, 1, "x86_pkg_temp", 91000, [("passive", 85000), ("critical", 100000)])
    (write_zone(root, 2, "broken", 1) / "temp").write_text("garbage")
    write_zone(root, 3, "sentinel", -274000)
    (root / "cooling_device0").mkdir()
    zones = read_thermal_zones(root)
    assert [(z.name, z.type, z.temp_c) for z in zones] == [("thermal_zone0", "acpitz", 27.8),
                                                          ("thermal_zone1", "x86_pkg_temp", 91.0)]
    assert zones[0].trips == (("critical", 105.0),) and zones[0].state() == NOMINAL
    assert zones[1].state() == FAIR  # past its passive trip: the kernel is cooling it
    r = ThermalZoneSensor(root).read()
    assert (r.thermal_state, r.max_temp_c, r.thermal_source) == (FAIR, 91.0, "thermal-zones")
    assert r.details["thermal-zones"]["at"] == "thermal_zone1 (x86_pkg_temp)"
    assert ThermalZoneSensor(tmp_path / "none").unavailable_reason().startswith("no ")
    (tmp_path / "empty").mkdir()
    assert "no readable thermal zone" in ThermalZoneSensor(tmp_path / "empty").unavailable_reason()


shwtemp = namedtuple("shwtemp", "label current high critical")  # psutil's shape
sbattery = namedtuple("sbattery", "percent secsleft power_plugged")


def test_psutil_temperatures_and_battery():
    temps = {"coretemp": [shwtemp("Package id 0", 101.0, 100.0, 100.0), shwtemp("Core 0", 60.0, None, None)],
             "nvme": [shwtemp("Composite", 255.0, None, None)]}  # an implausible sentinel is skipped
    r = TemperatureSensor(lambda: temps).read()
    assert (r.thermal_state, r.max_temp_c) == (CRITICAL, 101.0)
    assert r.details["temperatures"]["at"] == "coretemp/Package id 0"
    assert TemperatureSensor(dict).unavailable_reason().startswith("no temperature sensors")
    assert TemperatureSensor(None).unavailable_reason() == "psutil has no temperature support on this OS"
    r = BatterySensor(lambda: sbattery(42.5, 3600, False)).read()
    assert (r.on_battery, r.battery_percent) == (True, 42.5)
    assert BatterySensor(lambda: sbattery(42.5, 3600, None)).read().on_battery is None
    assert BatterySensor(lambda: None).unavailable_reason() == "no battery found (desktop, server or VM)"


class FakeNVML:
    """The part of pynvml the sensor uses, for two GPUs."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, temps, masks, fail_init=False):
        self.temps, self.masks, self.fail_init = temps, masks, fail_init

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self):
        return len(self.temps)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self.temps[h]

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):  # older pynvml name
        return self.masks[h]




def test_nvidia_via_nvml_and_via_nvidia_smi():
    s = NvidiaSensor(nvml=FakeNVML([70, 88], [0x1, 0x40]), detect=False)
    assert s.available()
    r = s.read()
    assert (r.thermal_state, r.max_temp_c, r.gpu_throttle) == (SERIOUS, 88.0, ("gpu_idle", "hw_thermal_slowdown"))
    assert r.details["nvidia"]["source"] == "NVML"

    # NVML broken, nvidia-smi present; a newer driver refuses the old field name once
    run = FakeRun().enqueue(subprocess.CalledProcessError(2, "nvidia-smi"), SMI_TWO_GPUS_HOT, SMI_IDLE)
    s = NvidiaSensor(nvml=FakeNVML([], [], fail_init=True), smi="/usr/bin/nvidia-smi", run=run, detect=False)
    assert s.available()
    r = s.read()
    assert (r.thermal_state, r.max_temp_c, r.details["nvidia"]["source"]) == (SERIOUS, 91.0, "nvidia-smi")
    assert s.read().thermal_state == NOMINAL
    fields = [c[1] for c in run.commands]
    assert fields == ["--query-gpu=temperature.gpu,clocks_throttle_reasons.active",
                      "--query-gpu=temperature.gpu,clocks_event_reasons.active",
                      "--query-gpu=temperature.gpu,clocks_event_reasons.active"]  # remembered
    assert "neither nvidia-ml-py" in NvidiaSensor(nvml=None, smi=None, detect=False).unavailable_reason()
    no_driver = NvidiaSensor(nvml=FakeNVML([], [], fail_init=True), smi=None, detect=False)
    assert no_driver.unavailable_reason() == "NVML: NVML Shared Library Not Found; nvidia-smi is not on PATH"


def test_macos_sensor_falls_back_to_pmset():
    def no_objc():
        raise OSError("no libobjc")

    run = FakeRun().enqueue(PMSET_WARNING.format(thermal=5))
    s = MacThermalSensor(platform="darwin", ns_state=no_objc, run=run)
    assert s.available()
    r = s.read()
    assert (r.thermal_state, r.details["macos-thermal"]["source"]) == (SERIOUS, "pmset -g therm")
    assert run.commands == [["pmset", "-g", "therm"]]
    r = MacThermalSensor(platform="darwin", ns_state=lambda: FAIR).read()
    assert (r.thermal_state, r.details["macos-thermal"]["source"]) == (FAIR, "NSProcessInfo")
    assert MacThermalSensor(platform="linux").unavailable_reason() == "macOS only"


@pytest.mark.skipif(sys.platform != "darwin", reason="calls NSProcessInfo through the Objective-C runtime: macOS only")
def test_ns_thermal_state_on_a_real_mac():
    assert th.ns_thermal_state() in (NOMINAL, FAIR, SERIOUS, CRITICAL)
