"""Run ``mx.fast.metal_kernel`` bodies on the CPU: g++ compiles each body file
unchanged inside a C++ template function whose signature is written the way
MLX writes it (mlx/backend/metal/custom_kernel.cpp ``write_signature``: inputs,
their ``_shape``/``_strides``/``_ndim`` when the body names them, outputs, then
the thread attributes the body names), through ``tests/metal_shim.h``.

:class:`Harness` builds one shared library per kernel and template set
(cached by a hash of every source) and offers :meth:`Harness.launcher`, a
drop-in for :func:`mlx_tier.kernels.metal.metal_launcher`.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_tier.kernels.metal import KernelSpec, kernel_source

SHIM = Path(__file__).with_name("metal_shim.h")
KERNELS = Path(__file__).resolve().parents[2] / "mlx_tier" / "kernels" / "msl"
ATTRIBUTES = (  # name -> type, as MLX declares them
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"),
)
CTYPE = {mx.float32: "float", mx.float16: "half", mx.uint32: "uint32_t", mx.int32: "int32_t", mx.uint8: "uint8_t"}
NPTYPE = {mx.float32: np.float32, mx.float16: np.float16, mx.uint32: np.uint32, mx.int32: np.int32,
          mx.uint8: np.uint8}


def gxx_missing() -> bool:
    return shutil.which("g++") is None


def _template_value(v) -> str:
    return CTYPE[v] if isinstance(v, mx.Dtype) else str(int(v))


def wrapper_source(spec: KernelSpec, body_path: Path, in_dtypes, out_dtypes, templates: list[list]) -> str:
    """C++ source: the body inside ``kern<...>`` and one ``extern "C" run_i``
    per template set ``templates[i]`` (a list of ``(name, value)``)."""
    src = body_path.read_text()
    params, args = [], []
    for i, (name, dt) in enumerate(zip(spec.input_names, in_dtypes)):
        params.append(f"const {CTYPE[dt]}* {name}")
        args.append(f"(const {CTYPE[dt]}*)in[{i}]")
        for suffix, ctype in (("_shape", "const int*"), ("_strides", "const int64_t*")):
            if name + suffix in src:
                params.append(f"{ctype} {name}{suffix}")
                args.append(f"({ctype})shp[{2 * i + (suffix == '_strides')}]")
        if name + "_ndim" in src:
            params.append(f"const int& {name}_ndim")
            args.append(f"ndim[{i}]")
    for i, (name, dt) in enumerate(zip(spec.output_names, out_dtypes)):
        params.append(f"{CTYPE[dt]}* {name}")
        args.append(f"({CTYPE[dt]}*)out[{i}]")
    for attr, ctype in ATTRIBUTES:
        if attr in src:
            params.append(f"{ctype} {attr}")
            args.append(f"p.{attr}")
    head = ""
    if templates and templates[0]:
        kinds = ["typename" if isinstance(v, mx.Dtype) else "int" for _, v in templates[0]]
        head = "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, templates[0])) + ">\n"
    signature = head + "void kern(" + ", ".join(params) + ") {"
    lines = ['#include "metal_shim.h"', signature, f'#include "{body_path.name}"', "}"]
    for j, tmpl in enumerate(templates):
        inst = "<" + ", ".join(_template_value(v) for _, v in tmpl) + ">" if tmpl else ""
        lines += [(f'extern "C" void run_{j}(void** in, void** shp, const int* ndim, void** out, '
                   "const unsigned* grid, const unsigned* tg) {"),
                  f"  shim::launch(grid, tg, [&](const shim::Position& p) {{ kern{inst}({', '.join(args)}); }});",
                  "}"]
    return "\n".join(lines) + "\n"


class Harness:
    """Compiled kernel bodies, built on first use into ``build_dir``."""

    def __init__(self, build_dir: Path, templates: dict[str, list[list]] | None = None):
        """``templates``: kernel name -> every template set the tests will use,
        compiled into one library per kernel (one g++ run instead of many)."""
        self.build_dir = Path(build_dir)
        self.templates = templates or {}
        self._libs: dict[str, ctypes.CDLL] = {}

    def library(self, spec: KernelSpec, in_dtypes, out_dtypes, templates, body_path: Path | None = None):
        body_path = body_path or KERNELS / spec.file
        if body_path == KERNELS / spec.file:
            assert body_path.read_text() == kernel_source(spec), "installed body differs from the source tree"
        code = wrapper_source(spec, body_path, in_dtypes, out_dtypes, templates)
        key = hashlib.sha256((code + body_path.read_text() + SHIM.read_text()).encode()).hexdigest()[:16]
        if key not in self._libs:
            lib = self.build_dir / f"{spec.name}-{key}.so"
            if not lib.exists():
                cpp = self.build_dir / f"{spec.name}-{key}.cpp"
                cpp.write_text(code)
                cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w", f"-I{SHIM.parent}",
                       f"-I{body_path.parent}", str(cpp), "-o", str(lib) + ".tmp"]
                subprocess.run(cmd, check=True, capture_output=True, text=True)
                Path(str(lib) + ".tmp").rename(lib)
            self._libs[key] = ctypes.CDLL(str(lib))
        return self._libs[key]

    def run(self, spec: KernelSpec, inputs, template, grid, threadgroup, shapes, dtypes, body_path=None) -> list:
        """Run ``spec``'s body over ``grid`` like ``mx.fast.metal_kernel``; numpy in, mx arrays out."""
        arrs = [np.ascontiguousarray(np.array(a)) for a in inputs]
        known = [list(t) for t in self.templates.get(spec.name, [])]
        sets = known if list(template) in known else [list(template)]
        lib = self.library(spec, [a.dtype for a in inputs], dtypes, sets, body_path)
        run = getattr(lib, f"run_{sets.index(list(template))}")
        outs = [np.zeros(s, NPTYPE[d]) for s, d in zip(shapes, dtypes)]
        shp = [np.array(a.shape or (1,), np.int32) for a in arrs]
        strides = [np.array([s // a.itemsize for s in a.strides] or [1], np.int64) for a in arrs]
        ptrs = (ctypes.c_void_p * len(arrs))(*[a.ctypes.data for a in arrs])
        meta = (ctypes.c_void_p * (2 * len(arrs)))(*[x.ctypes.data for pair in zip(shp, strides) for x in pair])
        ndim = (ctypes.c_int * len(arrs))(*[a.ndim for a in arrs])
        optrs = (ctypes.c_void_p * len(outs))(*[o.ctypes.data for o in outs])
        g = (ctypes.c_uint * 3)(*grid)
        t = (ctypes.c_uint * 3)(*threadgroup)
        run(ptrs, meta, ndim, optrs, g, t)
        return [mx.array(o) for o in outs]

    def launcher(self, spec, inputs, template, grid, threadgroup, shapes, dtypes) -> list:
        """Same call as :func:`mlx_tier.kernels.metal.metal_launcher`."""
        return self.run(spec, inputs, template, grid, threadgroup, shapes, dtypes)
