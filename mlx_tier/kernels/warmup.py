"""The CPU kernel compiled ahead of a run, in a child process of its own.

The CPU kernel's loops are Numba functions compiled on first use and kept in
Numba's on-disk cache (``cache=True``). A fresh install compiles them inside
the run: about a minute on a 2-core machine, and LLVM's working memory (measured
~250 MB at its peak, ~170 MB still held after it) on top of the run's own memory
split, which does not count it — under a memory limit a model sized to the
limit can then be pushed over it. :func:`ensure_compiled` instead compiles them
in a short child process (``python -m mlx_tier.kernels.warmup``) before the
model is loaded: the child writes Numba's cache and exits, returning its memory,
and the run loads the compiled code from the cache (a few MB).

Numba compiles one version per argument *types*, so the child calls the
kernel on tiny blocks of each quantization format the checkpoint holds (the
scales' dtype and the Python paths taken differ by format), through each path
a run takes: decode rows (the fused matvec, whole pairs per thread), prompt
rows (dequantise + BLAS), a mix; stacked experts and a dense layer (their
arrays' layouts differ); input dims that take the VNNI loops and dims that do
not, and a row they cannot write in digits.

A marker file in the user cache folder (``kernels/<key>.ok``) records that the
child ran for a key made of what decides Numba's cache: the kernel sources'
stamps, Numba's and Python's versions, the CPU, ``NUMBA_*`` settings, the
formats and the cache's own index files as the child left them (a cache
removed since, or grown by a run that compiled more, runs the child again);
later runs skip the child (~2 s). Where Numba cannot write its cache
(a read-only install and no writable user cache), the run compiles in place
as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from mlx_tier.fsio import user_cache_dir, write_atomic

# The modules whose Numba functions a run may compile (their stamps key the marker).
SOURCES = ("cpu.py", "cpu_vnni.py", "simd.py")
SUPPORTED_MODES = ("affine", "mxfp4")
# Longest the child may take: a cold compile of every format is a few minutes at most.
TIMEOUT_S = 1800


def formats(config: dict) -> list[dict]:
    """The distinct quantization formats of a checkpoint's ``config.json`` that the CPU
    kernel computes (:func:`all_formats` whose mode is in :data:`SUPPORTED_MODES`)."""
    return [f for f in all_formats(config) if f["mode"] in SUPPORTED_MODES]


def all_formats(config: dict) -> list[dict]:
    """The distinct quantization formats of a checkpoint's ``config.json``
    (``{"bits", "group_size", "mode"}``, sorted): the top-level ``quantization`` and
    each per-module entry (mlx-lm's mixed quantization). ``[]`` for an unquantized
    checkpoint (its float layers run on BLAS: nothing to compile)."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    if not isinstance(q, dict) or "bits" not in q:
        return []
    top = {"bits": int(q["bits"]), "group_size": int(q.get("group_size", 64)), "mode": q.get("mode", "affine")}
    found = {json.dumps(top, sort_keys=True)}
    for value in q.values():
        if isinstance(value, dict) and "bits" in value:
            own = {"bits": int(value["bits"]), "group_size": int(value.get("group_size", top["group_size"])),
                   "mode": value.get("mode", top["mode"])}
            found.add(json.dumps(own, sort_keys=True))
    return list(map(json.loads, sorted(found)))


def marker_key(fmts: list[dict]) -> str:
    """A hex digest of what decides whether Numba's cache holds the kernel for ``fmts``."""
    import llvmlite.binding as llvm
    import numba

    here = Path(__file__).parent
    stamps = []
    for name in SOURCES:
        st = (here / name).stat()
        stamps.append([name, st.st_mtime_ns, st.st_size])
    facts = {"sources": stamps, "cache": _cache_stamps(), "numba": numba.__version__, "python": sys.version, "exe": sys.executable,
             "cpu": llvm.get_host_cpu_name(), "features": llvm.get_host_cpu_features().flatten(),
             "machine": platform.machine(), "formats": fmts, "where": str(here),
             "env": sorted((k, v) for k, v in os.environ.items() if k.startswith(("NUMBA_", "MLX_TIER_VNNI")))}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def _cache_stamps() -> list:
    """``[name, size, mtime]`` of each index file of the kernel's Numba cache (a cache
    removed or grown since the marker was written changes the key); ``[]`` where
    Numba does not say where its cache is."""
    from mlx_tier.kernels import cpu

    folder = getattr(getattr(cpu._qmv4, "_cache", None), "cache_path", None)
    if not folder or not os.path.isdir(folder):
        return []
    out = []
    for path in sorted(Path(folder).glob("cpu*.nbi")):
        st = path.stat()
        out.append([path.name, st.st_size, st.st_mtime_ns])
    return out


def ensure_compiled(fmts: list[dict], say: Callable[[str], None] = lambda line: None) -> bool:
    """Compile the CPU kernel for ``fmts`` in a child process unless a marker says it
    was done for this key; ``say`` gets one line before a compile and one if it
    failed. Returns whether the kernel is known compiled (the child ran now or
    before). A failed child loses nothing: the run compiles in place."""
    if not fmts:
        return True
    marker = user_cache_dir() / "kernels" / f"{marker_key(fmts)}.ok"
    if marker.is_file():
        return True
    say("compiling the CPU kernel for this machine (first run only; a minute or two)")
    cmd = [sys.executable, "-m", "mlx_tier.kernels.warmup", json.dumps(fmts)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        say(f"could not compile the CPU kernel ahead ({e}); it compiles during the run")
        return False
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        say(f"could not compile the CPU kernel ahead ({last}); it compiles during the run")
        return False
    marker = marker.with_name(f"{marker_key(fmts)}.ok")  # the cache as the child left it
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(marker, json.dumps({"formats": fmts}) + "\n")
    except OSError:
        pass  # the next run compiles ahead again: slower, never wrong
    return True


def compile_for(model_dir: Path, kernel: str | None, say: Callable[[str], None] = lambda line: None) -> None:
    """:func:`ensure_compiled` for the checkpoint in ``model_dir`` where a run of it uses
    the CPU kernel: ``kernel`` (``None``: ``auto``) resolves to ``cpu``, or ``auto`` on
    CUDA (its warm tier's kernel). An unreadable config is left for the load to report."""
    import mlx.core as mx

    from mlx_tier.kernels.registry import resolve

    name = kernel or "auto"
    cuda = getattr(mx, "cuda", None)
    if not (resolve(name) == "cpu" or (name == "auto" and cuda is not None and cuda.is_available())):
        return
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return
    if isinstance(config, dict):
        ensure_compiled(formats(config), say)


def _calls(fmt: dict) -> None:
    """Every path of the CPU kernel on tiny blocks of format ``fmt`` (see the module doc)."""
    import mlx.core as mx
    import numpy as np
    from mlx import nn
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlx_tier.kernels import cpu
    from mlx_tier.kernels.cpu_dense import quantized_matmul

    gs = fmt["group_size"]
    quantize = dict(group_size=gs, bits=fmt["bits"], mode=fmt["mode"])
    dims = {max(256, 2 * gs)} | ({3 * gs} if (3 * gs) % 128 else set())  # VNNI-ready rows, and others
    rng = np.random.default_rng(0)
    for d in sorted(dims):
        block = SwitchGLU(d, d, 4)
        nn.quantize(block, **quantize)
        dense = nn.QuantizedLinear(d, d, bias=False, **quantize)
        for m in (block, dense):
            m.set_dtype(mx.float32)
        mx.eval(block.parameters(), dense.parameters())
        for tokens, k in ((1, 2), (cpu.THREADS, 2), (16, 2), (cpu.VNNI_GEMM_MIN_ROWS, 4)):
            x = rng.standard_normal((tokens, d), dtype=np.float32)
            x[-1, 0] = np.inf if tokens > 1 else x[-1, 0]  # a row the VNNI loops leave to float32
            slots = np.stack([rng.permutation(4)[:k] for _ in range(tokens)]).astype(np.uint32)
            cpu.expert_forward(block, mx.array(x), mx.array(slots))
            quantized_matmul(dense, mx.array(x))


def main(argv: list[str]) -> int:
    """``python -m mlx_tier.kernels.warmup FORMATS_JSON``: compile for each format."""
    import warnings

    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)  # the kernel computes on the host
    with warnings.catch_warnings(), np.errstate(all="ignore"):  # the non-finite row's NaNs are expected
        warnings.simplefilter("ignore")
        for fmt in json.loads(argv[0]):
            _calls(fmt)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
