"""What computing in float32 instead of the checkpoint's own dtype gains on MLX's CPU backend.

Question: ``mlx_tier.load`` casts nothing by default, as ``mlx_lm.load`` (its
greedy tokens then equal mlx-lm's); ``TierConfig(dtype=mx.float32)`` casts
the model to float32, which the job runner does on the CPU backend. How much
faster is that, and is the tiered model as fast as mlx-lm in each dtype? The
demo MoE as built (float16 scales and biases, 4-bit group 32, but float32
norms, so its activations are float32) and a bf16 copy of it (mlx-community's
usual layout: bf16 scales, biases, norms and routers),
every expert resident (8/8 slots: compute, not reads), MLX's own kernels
(``kernel="mlx"``, the library default). Engines on the same checkpoint in one
process, runs interleaved; greedy, single request, median of N runs.

    python benches/cpu_dtype.py [--runs 5] [--max-tokens 16] [--dtypes float16,bfloat16]

Prints the caliber (docs/architecture.md "Measuring"), the CPU time of one
4-bit ``gather_qmm`` in each dtype (the op alone), and, per checkpoint dtype,
each engine's TTFT, TPOT, decode tok/s and CPU time per decoded token (all
threads), with ratios to mlx-lm as loaded, and whether the tiered engines'
tokens equal their mlx-lm reference's. The page cache is warm (the checkpoint
was just read).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import psutil
from mlx_lm import load as mlx_load
from mlx_lm import stream_generate
from mlx_lm.utils import load_model, save_config, save_model

import mlx_tier
from mlx_tier import TierConfig, cast_model
from mlx_tier.engine.checkpoint import model_shape
from mlx_tier.job.report import backend_name
from mlx_tier.tools.demo_model import ensure_demo_model

PROMPT = "The history of the city of Paris begins"


def copy_as(path: Path, dtype: mx.Dtype, out: Path) -> Path:
    """The checkpoint at ``path`` cast as ``mlx_lm.convert --dtype`` casts (``cast_model``), saved to ``out``."""
    model, config = load_model(path)
    cast_model(model, dtype)
    save_model(out, model)
    save_config(config, out / "config.json")
    for f in path.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return out


def engines(path: Path) -> dict:
    """name -> model: mlx-lm as loaded and cast to float32; mlx-tier as loaded and with ``dtype=mx.float32``."""
    plain, tokenizer = mlx_load(str(path))
    plain32, _ = mlx_load(str(path))
    cast_model(plain32, mx.float32)
    E = model_shape(path)[1]
    out = {"mlx-lm as loaded": plain, "mlx-tier as loaded": None, "mlx-lm cast to float32": plain32,
           "mlx-tier dtype=float32": None}
    out["mlx-tier as loaded"], _ = mlx_tier.load(path, config=TierConfig(slots_per_layer=E, kernel="mlx"))
    out["mlx-tier dtype=float32"], _ = mlx_tier.load(
        path, config=TierConfig(slots_per_layer=E, kernel="mlx", dtype=mx.float32))
    return out, tokenizer


def measure(model, tokenizer, prompt, max_tokens) -> dict:
    """One greedy generation: TTFT (s), TPOT (s), CPU seconds per decoded token (all
    threads: less sensitive than wall time to other work on a shared machine), the tokens."""
    t0 = time.perf_counter()
    first, tokens = None, []
    for resp in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        tokens.append(resp.token)
        if first is None:
            first, cpu0 = time.perf_counter(), time.process_time()
    end, cpu1 = time.perf_counter(), time.process_time()
    n = max(len(tokens) - 1, 1)
    return {"ttft": first - t0, "tpot": (end - first) / n, "cpu": (cpu1 - cpu0) / n, "tokens": tokens}


def run(path: Path, runs: int, max_tokens: int) -> tuple[dict, str]:
    models, tokenizer = engines(path)
    prompt = tokenizer.encode(PROMPT)
    for m in models.values():  # warm-up
        measure(m, tokenizer, prompt, 2)
    results = {name: [] for name in models}
    for _ in range(runs):
        for name, m in models.items():
            results[name].append(measure(m, tokenizer, prompt, max_tokens))
    return results, "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def report(label: str, results: dict, load: str) -> None:
    base = statistics.median(r["tpot"] for r in results["mlx-lm as loaded"])
    print(f"\n{label} (load average after: {load})")
    base_cpu = statistics.median(r["cpu"] for r in results["mlx-lm as loaded"])
    print(f"{'engine':26} {'TTFT s':>8} {'TPOT ms':>9} {'tok/s':>7} {'vs mlx-lm':>9} {'CPU ms/tok':>10} "
          f"{'vs mlx-lm':>9}  same tokens as")
    same = {"mlx-tier as loaded": "mlx-lm as loaded", "mlx-tier dtype=float32": "mlx-lm cast to float32"}
    for name, rs in results.items():
        ttft, tpot, cpu = (statistics.median(r[k] for r in rs) for k in ("ttft", "tpot", "cpu"))
        ref = same.get(name)
        agree = "" if ref is None else f"{ref}: {rs[0]['tokens'] == results[ref][0]['tokens']}"
        print(f"{name:26} {ttft:8.2f} {tpot * 1e3:9.1f} {1 / tpot:7.2f} {base / tpot:9.2f} {cpu * 1e3:10.1f} "
              f"{base_cpu / cpu:9.2f}  {agree}")


def gather_qmm_ms(dtype: mx.Dtype, experts: int, out_dim: int, in_dim: int, group_size: int, reps: int = 10) -> float:
    """CPU ms (all threads, median of ``reps``) of one ``gather_qmm`` over ``experts`` 4-bit
    experts ``[out_dim, in_dim]`` for one token, scales, biases and activation in ``dtype``."""
    qw, s, b = mx.quantize(mx.random.normal((experts, out_dim, in_dim)), group_size=group_size, bits=4)
    s, b = s.astype(dtype), b.astype(dtype)
    x = mx.random.normal((1, 1, 1, in_dim)).astype(dtype)
    idx = mx.arange(experts, dtype=mx.uint32).reshape(1, 1, experts)
    mx.eval(qw, s, b, x, idx)

    def op():
        return mx.gather_qmm(x, qw, s, b, rhs_indices=idx, transpose=True, group_size=group_size, bits=4)

    mx.eval(op())
    times = []
    for _ in range(reps):
        t = time.process_time()
        mx.eval(op())
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e3


def report_ops() -> None:
    """One expert op in each dtype: the kernel-level cost, apart from the rest of a model."""
    shapes = {"8 experts 2048x768, group 64": (8, 2048, 768, 64), "demo gate/up: 2 experts 1536x576, group 32":
              (2, 1536, 576, 32), "demo down: 2 experts 576x1536, group 32": (2, 576, 1536, 32)}
    print(f"\none 4-bit gather_qmm for one token, CPU ms (median of 10; load average {os.getloadavg()[0]:.1f})")
    print(f"{'op':44} {'float32':>8} {'bfloat16':>9} {'float16':>8}")
    for name, shape in shapes.items():
        ms = [gather_qmm_ms(d, *shape) for d in (mx.float32, mx.bfloat16, mx.float16)]
        print(f"{name:44} {ms[0]:8.2f} {ms[1]:9.2f} {ms[2]:8.2f}   ({ms[1] / ms[0]:.1f}x, {ms[2] / ms[0]:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtypes", default="float16,bfloat16", help="checkpoint dtypes: float16 = the demo as built")
    args = ap.parse_args()
    demo = ensure_demo_model(print)
    size = sum(p.stat().st_size for p in demo.glob("*.safetensors"))
    print("caliber:")
    print(f"  machine: {platform.machine()} {platform.system()}, {psutil.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB; backend {backend_name()}; mlx {mx.__version__}")
    print(f"  model: {demo.name} ({size / 2**20:.0f} MiB on disk, fits in memory), 8/8 slots (every expert "
          f"resident), kernel mlx; single request, prompt {PROMPT!r}, {args.max_tokens} tokens, greedy, page "
          f"cache warm, {args.runs} runs interleaved, medians")
    report_ops()
    with tempfile.TemporaryDirectory(prefix="cpu-dtype-") as tmp:
        for name in args.dtypes.split(","):
            path = demo if name == "float16" else copy_as(demo, getattr(mx, name), Path(tmp) / name)
            results, load = run(path, args.runs, args.max_tokens)
            report(f"checkpoint in {name}", results, load)


if __name__ == "__main__":
    main()
