"""The CPU kernel's 4-bit row loops, forced either way.

On an x86 CPU with AVX-512 VNNI, or AVX2 (the same loops, vpdpbusd emulated), the
kernel runs 4-bit rows on integer dot products; elsewhere (Arm) on the float32
loops. Tests that take the ``row_loops`` fixture run once per kind of loop, so a
pass on an x86 machine also checks what an Arm machine runs; on a CPU with neither
the ``vnni`` case is skipped with its reason.
"""

from __future__ import annotations

import pytest

from mlx_tier.kernels import cpu_vnni, simd


@pytest.fixture(params=["float32", "vnni"])
def row_loops(request, monkeypatch) -> str:
    """``"float32"`` or ``"vnni"``: the row loops the CPU kernel uses in this test."""
    if request.param == "vnni" and not simd.AVAILABLE:
        pytest.skip("needs an x86 CPU with AVX-512 VNNI or AVX2 (vpdpbusd, or its AVX2 pair); the float32 case ran")
    monkeypatch.setattr(cpu_vnni, "ENABLED", request.param == "vnni")
    return request.param
