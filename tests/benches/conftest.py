"""Loading a script of benches/ as a module, for the tests of its logic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[2] / "benches"


@pytest.fixture(scope="module")
def load_bench():
    """``load(filename, name)``: benches/``filename`` imported as module ``name`` (registered
    in ``sys.modules``: dataclasses look their module up there), with benches/ on
    ``sys.path`` for its own imports; both undone after the test module."""
    loaded: list[str] = []
    sys.path.insert(0, str(BENCHES))

    def load(filename: str, name: str):
        spec = importlib.util.spec_from_file_location(name, BENCHES / filename)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loaded.append(name)
        spec.loader.exec_module(module)
        return module

    try:
        yield load
    finally:
        for name in loaded:
            sys.modules.pop(name, None)
        sys.path.remove(str(BENCHES))
