"""The CUDA path: hot (GPU) + warm (host, computed on the CPU) vs the warm tier off, side by side.

Question: with a GPU budget smaller than the model's experts, does a warm host
tier whose experts the CPU computes in place beat copy-on-miss (one tier: every
miss read and copied into the GPU's slots)? Two engines on one checkpoint in
one process, runs interleaved, each run on a freshly loaded model (empty expert
caches; the page cache stays warm):

- ``warm off``: ``TierConfig(slots_per_layer=H, host_cache_gb=0)`` (copy on
  every miss: the single-tier cache; on CUDA a warm tier is on by default);
- ``two tiers``: the same H hot slots plus W warm slots (``host_cache_gb``),
  placement by the cost model with the bandwidths measured at the start, warm
  experts computed by MLX's ops on the warm tier's own CPU stream;
- ``two tiers, CPU kernel``: the same, warm experts computed by the CPU expert
  kernel (``kernel="cpu"``) while the GPU computes the hot ones;
- ``two tiers + prefetch``: the same as ``two tiers`` with prefetch on (warm ->
  hot promotions of the next layer's predicted experts, cold reads ahead).

Each run prefills a fixed prompt (TTFT) then decodes N tokens *fed from a fixed
text* (a random model's greedy output repeats one token, which flatters any
cache). Prints the caliber, the measured bandwidths, and per engine medians:
decode tok/s, TTFT, hot/warm/cold hit rates, the share of expert uses computed
on the CPU, warm -> hot promotions ahead per token, MiB read per token; then
each engine / warm off.

    python benches/two_tier.py MODEL [--hot-fraction 0.25] [--warm-fraction 0.5] [--runs 3] [--tokens 24]

Made for a Linux machine with an NVIDIA GPU and ``mlx[cuda]`` (benches/gpu_check.sh
runs it). On the CPU backend both tiers are host memory and the figures say
nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import mlx.core as mx
import numpy as np
import psutil
from mlx_lm.models.cache import make_prompt_cache

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.engine.dtypes import job_compute_dtype
from mlx_tier.engine.warm_pool import pool_slot_nbytes
from mlx_tier.job.report import backend_name
from mlx_tier.policy.cost_model import TransferCosts

TEXT = ("The committee met on Tuesday to review the budget for the new library, the repairs to the bridge "
        "over the river, and a proposal to extend the bus line to the hospital. After a long discussion the "
        "members agreed to postpone the vote until the engineers had delivered their report on the bridge.")


def _gbps(fn, nbytes: int, reps: int = 10) -> float:
    fn()  # warm-up (compile, first touch)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def measure_costs(out_dim: int = 768, in_dim: int = 2048) -> TransferCosts:
    """Bandwidths of the cost model, measured now on one expert-sized 4-bit projection
    (group 64): CPU and default-device matvec GB/s of weights per token, and
    host -> device copy GB/s (a fresh host buffer made into an array and used on the device)."""
    w = mx.random.normal((out_dim, in_dim))
    qw, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((1, in_dim))
    nbytes = qw.nbytes + s.nbytes + b.nbytes
    mx.eval(qw, s, b, x)

    def matvec(stream):
        return lambda: mx.eval(mx.quantized_matmul(x, qw, s, b, group_size=64, bits=4, stream=stream))

    cpu = _gbps(matvec(mx.cpu), nbytes)
    dev = _gbps(matvec(mx.default_device()), nbytes)
    host = np.random.default_rng(0).integers(0, 2**31, size=(64, 2**20 // 4), dtype=np.uint32)  # 64 MiB

    def copy():
        a = mx.array(host)
        mx.eval(mx.sum(a, stream=mx.default_device()))

    return TransferCosts(pcie_gbps=_gbps(copy, host.nbytes, reps=3), gpu_gbps=dev, cpu_gbps=cpu)


def run_once(model, prompt: list[int], text: list[int]) -> dict:
    """Prefill ``prompt`` (TTFT), decode ``text`` one token a step; cache counter deltas of the decode."""
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    mx.eval(model(mx.array([prompt]), cache=cache))
    t1 = time.perf_counter()
    before = model.expert_cache.snapshot()
    for tok in text:
        mx.eval(model(mx.array([[tok]]), cache=cache))
    t2 = time.perf_counter()
    d = model.expert_cache.snapshot() - before
    seen = max(d.hits + d.misses, 1)
    out = {"ttft": t1 - t0, "tok_s": len(text) / (t2 - t1), "miss": d.misses / seen,
           "mib_per_token": d.bytes_read / len(text) / 2**20}
    out["hot_hit"] = getattr(d, "hot_hits", d.hits) / seen
    out["warm_hit"] = (getattr(d, "warm_hits", 0) + getattr(d, "promotions", 0)) / seen
    out["on_cpu"] = (getattr(d, "warm_hits", 0) + getattr(d, "misses_warm", 0)) / seen
    out["ahead_per_token"] = getattr(d, "promotions_ahead", 0) / len(text)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--hot-fraction", type=float, default=0.25, help="hot slots per layer / experts")
    ap.add_argument("--warm-fraction", type=float, default=0.5, help="warm slots per layer / experts")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24, help="decode steps fed from a fixed text")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    costs = measure_costs()
    probe, tokenizer = mlx_tier.load(args.model, config=TierConfig(slots_per_layer=1, dtype=job_compute_dtype()))
    E, L = probe.expert_cache.num_experts, len(probe.expert_cache.layers)
    tensors = probe.expert_cache.layers[0].tensors
    slot_bytes = probe.expert_cache.layers[0].slot_nbytes
    del probe
    H = max(1, round(E * args.hot_fraction))
    W = min(E - H, round(E * args.warm_fraction))

    def two(cpu_kernel: bool) -> dict:  # W warm slots: with the CPU kernel, floats are float32 there
        host_gb = W * L * pool_slot_nbytes(tensors, cpu_kernel) / 2**30 * 1.0001
        return {"slots_per_layer": H, "host_cache_gb": host_gb, "transfer_costs": costs}

    dtype = job_compute_dtype()  # as mlx-tier run computes
    engines = {"warm off (copy on miss)": TierConfig(slots_per_layer=H, host_cache_gb=0, dtype=dtype),
               "two tiers": TierConfig(**two(False), kernel="mlx", dtype=dtype),
               "two tiers, CPU kernel": TierConfig(**two(True), kernel="cpu", dtype=dtype),
               "two tiers + prefetch": TierConfig(**two(False), kernel="mlx", prefetch=True, dtype=dtype)}
    ids = tokenizer.encode(TEXT)
    prompt, text = ids[:32], ids[32 : 32 + args.tokens]
    runs = {name: [] for name in engines}
    for _ in range(args.runs):
        for name, cfg in engines.items():
            model, _ = mlx_tier.load(args.model, config=cfg)
            runs[name].append(run_once(model, prompt, text))
            del model
    report(args, costs, E, L, H, W, slot_bytes, pool_slot_nbytes(tensors, True), len(prompt), len(text), runs)


def report(args, costs, E, L, H, W, slot_bytes, cpu_slot_bytes, n_prompt, n_text, runs) -> None:
    ckpt = sum(os.path.getsize(os.path.join(args.model, f)) for f in os.listdir(args.model) if f.endswith(".safetensors"))
    gib = 2**30
    print("caliber:")
    print(f"  machine: {platform.machine()} {platform.system()}, {psutil.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / gib:.0f} GiB; backend {backend_name()}; mlx {mx.__version__}; "
          f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"  model: {args.model}, {ckpt / gib:.2f} GiB on disk, {L} MoE layers x {E} experts, "
          f"{slot_bytes / 2**20:.2f} MiB per expert resident")
    print(f"  hot: {H} of {E} slots per layer ({H * L * slot_bytes / gib:.2f} GiB); warm: {W} slots per layer "
          f"({W * L * slot_bytes / gib:.2f} GiB; {W * L * cpu_slot_bytes / gib:.2f} GiB for the CPU kernel, "
          "float32 scales); cold: the rest")
    print(f"  cost model, measured now: PCIe/host->device {costs.pcie_gbps:.1f} GB/s, device matvec "
          f"{costs.gpu_gbps:.2f} GB/s, CPU matvec {costs.cpu_gbps:.2f} GB/s (copy pays from "
          f"{costs.cpu_gbps * (1 / costs.pcie_gbps + 1 / costs.gpu_gbps):.2f} tokens)")
    print(f"  single request, prompt {n_prompt} tokens, {n_text} decode steps fed from a fixed text, "
          f"page cache warm, fresh expert caches, {args.runs} runs, medians")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"\n{'engine':24} {'tok/s':>6} {'TTFT s':>6} {'hot':>6} {'warm':>6} {'cold':>6} {'on CPU':>6} "
          f"{'ahead':>5} {'MiB/t':>6}")
    for name, m in med.items():
        print(f"{name:24} {m['tok_s']:6.2f} {m['ttft']:6.2f} {m['hot_hit']:6.1%} {m['warm_hit']:6.1%} "
              f"{m['miss']:6.1%} {m['on_cpu']:6.1%} {m['ahead_per_token']:5.1f} {m['mib_per_token']:6.2f}")
    b = med["warm off (copy on miss)"]
    for name, a in med.items():
        if a is not b:
            print(f"{name} / warm off: decode tok/s {a['tok_s'] / b['tok_s']:.2f}x, TTFT {a['ttft'] / b['ttft']:.2f}x")
    if args.json:
        print(json.dumps(med, indent=2))


if __name__ == "__main__":
    main()
