"""Scripted sensors: fake thermal zones and a fake nvidia-smi."""

from __future__ import annotations


def write_zone(root, n, kind, milli_c, trips=()):
    z = root / f"thermal_zone{n}"
    z.mkdir(parents=True)
    (z / "type").write_text(kind + "\n")
    (z / "temp").write_text(f"{milli_c}\n")
    for i, (trip_kind, trip_milli) in enumerate(trips):
        (z / f"trip_point_{i}_type").write_text(trip_kind + "\n")
        (z / f"trip_point_{i}_temp").write_text(f"{trip_milli}\n")
    return z


class FakeRun:
    """Scripted subprocess: ``enqueue`` stdout strings or exceptions; records the commands."""

    def __init__(self):
        self.queue, self.commands = [], []

    def enqueue(self, *results):
        self.queue.extend(results)
        return self

    def __call__(self, cmd):
        self.commands.append(cmd)
        result = self.queue.pop(0)
        if isinstance(result, Exception):
            raise result
        return result
