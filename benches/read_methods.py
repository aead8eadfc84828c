"""How should the cold tier read an expert? Read method x page-cache mode, cold and warm.

Questions (cold path, reads):
1. ``pread`` vs ``mmap``, each with the page cache kept / dropped after the read
   / bypassed (``O_DIRECT``, pread only): time per expert, cold (the shards'
   pages evicted first) and warm (the same experts read again at once).
2. Do reusable output buffers beat a fresh ``np.empty`` per read?
3. Would ``mlx-tier pack`` (an expert-major copy: one contiguous read per
   expert) beat the ~9 ranges per expert of the mlx-lm layout by >= 10%?

Every figure is the median over ``--runs`` runs; in each run every variant
reads its own random sample of experts, variants interleaved (rotated order)
so drift hits all alike. Two access patterns: ``single`` (one expert per
``read_experts`` call, its 9 ranges in parallel) and ``layer`` (8 experts of one
layer per call, as a decode step's misses are issued together). "Cold" evicts
the checkpoint's pages with ``posix_fadvise(DONTNEED)`` before the read (not
the machine's whole page cache). For question 3 the experts of layer 0 are
copied into a packed file next to the checkpoint (removed at the end); random
experts of layer 0 are read from each layout, both into reused buffers, so
that only the layout differs (fresh buffers cost page faults: question 2).

    python benches/read_methods.py [--model DIR] [--runs 9] [--sample 32] [--threads 4] [--json OUT]

Default model: the synthetic 2 GiB qwen3_moe (``benches/make_synthetic_moe.py``),
built into ``$MLX_TIER_CACHE/synthetic-qwen3moe-2g`` when missing (~4 min).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import psutil
from make_synthetic_moe import ensure_synthetic
from pagecache import drop_pages

from mlx_tier.engine.checkpoint import TensorInfo, index_checkpoint
from mlx_tier.engine.store import ExpertStore

SETTINGS = [("pread", "keep"), ("pread", "drop"), ("pread", "direct"), ("mmap", "keep"), ("mmap", "drop")]
BASE = ("pread", "keep")
LAYER_BATCH = 8
PAYS = 0.10  # pack is worth it only if it saves at least this fraction of the time
TIE = 0.05  # settings closer than this to the fastest are reported as ties (the machine is shared)
REUSED = "pread/keep reused-buffers"
# Question 3 compares layouts alone: both read layer 0's experts into reused buffers.
RANGES = "9 ranges, reused (layer 0)"
PACKED = "packed, reused (layer 0)"


def expert_layers(index: dict[str, TensorInfo]) -> list[list[str]]:
    """Stacked expert tensor names grouped by expert block (``...switch_mlp``), in file order."""
    blocks = defaultdict(list)
    for name in index:
        if ".switch_mlp." in name or ".experts." in name:
            blocks[name.rsplit(".", 2)[0]].append(name)
    return [sorted(names, key=lambda n: index[n].start) for _, names in sorted(blocks.items())]


def sample_calls(layers: list[list[str]], E: int, n: int, batch: int, rng: random.Random) -> list[tuple[list[str], list[int]]]:
    """``n`` experts as read calls of ``batch`` distinct experts of one random layer."""
    return [(rng.choice(layers), rng.sample(range(E), batch)) for _ in range(n // batch)]


def timed(read, calls) -> float:
    t0 = time.perf_counter()
    for names, experts in calls:
        read(names, experts)
    return time.perf_counter() - t0


def read_reused(store: ExpertStore):
    """``store.read_experts`` into caller-owned buffers (``out=``), allocated once per (layer, batch)."""
    bufs: dict = {}

    def read(names, experts):
        out = bufs.get((names[0], len(experts)))
        if out is None:
            out = bufs[(names[0], len(experts))] = {
                n: np.empty((len(experts), *store.info(n).shape[1:]), store.info(n).np_dtype) for n in names
            }
        store.read_experts(names, experts, out=out)

    return read


def pack_layer(store: ExpertStore, names: list[str], E: int, path: Path) -> int:
    """Copy one layer's experts into ``path`` expert-major; returns bytes per expert."""
    with open(path, "wb") as f:
        for e in range(E):
            raw = store.read_experts(names, [e])
            f.writelines(raw[n].tobytes() for n in names)
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size // E


def read_packed(path: Path, expert_nbytes: int, pool):
    """One positioned read per expert from the packed file (the pack layout), into reused buffers."""
    fd = os.open(path, os.O_RDONLY)
    bufs: dict[int, np.ndarray] = {}

    def one(e, dest):
        mv, done = memoryview(dest), 0
        while done < expert_nbytes:
            done += os.preadv(fd, [mv[done:]], e * expert_nbytes + done)

    def read(names, experts):
        dest = bufs.get(len(experts))
        if dest is None:
            dest = bufs[len(experts)] = np.zeros((len(experts), expert_nbytes), np.uint8)  # faulted in once
        for fut in [pool.submit(one, e, dest[i]) for i, e in enumerate(experts)]:
            fut.result()

    return read, fd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the synthetic 2 GiB MoE)")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--sample", type=int, default=32, help="experts read per variant per run")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None, help="write the medians here")
    args = ap.parse_args()

    model = args.model or ensure_synthetic()
    index = index_checkpoint(model)
    layers = expert_layers(index)
    E = index[layers[0][0]].shape[0]
    expert_nbytes = sum(index[n].expert_nbytes() for n in layers[0])
    shards = sorted(model.glob("*.safetensors"))
    packed = model.parent / f".{model.name}.packed-layer0"
    rng = random.Random(0)

    with ExpertStore(model, threads=args.threads) as s:
        pack_nbytes = pack_layer(s, layers[0], E, packed)
    assert pack_nbytes == expert_nbytes
    variants = [f"{m}/{p}" for m, p in SETTINGS] + [REUSED, RANGES, PACKED]
    times = {(v, pat, temp): [] for v in variants for pat in ("single", "layer") for temp in ("cold", "warm")}
    drop_method = None
    try:
        for run in range(args.runs):
            order = variants[run % len(variants):] + variants[: run % len(variants)]
            for v in order:
                for pat, batch in (("single", 1), ("layer", LAYER_BATCH)):
                    pool_layers = [layers[0]] if v in (RANGES, PACKED) else layers
                    calls = sample_calls(pool_layers, E, args.sample, batch, rng)
                    method, page_cache = v.split()[0].split("/") if v in variants[: len(SETTINGS) + 1] else BASE
                    store = ExpertStore(model, threads=args.threads, read_method=method, page_cache=page_cache)
                    fd = None
                    if v == PACKED:
                        read, fd = read_packed(packed, expert_nbytes, store._pool)
                        read(None, list(range(batch)))  # allocate the buffer (and fault its pages in) once
                    elif v in (REUSED, RANGES):
                        read = read_reused(store)
                        for names, _ in calls:  # allocate the buffers (and fault their pages in) once
                            read(names, list(range(batch)))
                    else:
                        read = store.read_experts
                    drop_method = drop_pages([*shards, packed])
                    times[(v, pat, "cold")].append(timed(read, calls) / args.sample)
                    times[(v, pat, "warm")].append(timed(read, calls) / args.sample)
                    if fd is not None:
                        os.close(fd)
                    store.close()
    finally:
        packed.unlink(missing_ok=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    ckpt = sum(f.stat().st_size for f in shards)
    print("caliber:")
    print(f"  machine: {platform.machine()} {platform.system()} {platform.release()}, {psutil.cpu_count()} cores "
          f"(shared with other jobs while measured), {psutil.virtual_memory().total / 2**30:.0f} GiB; "
          f"filesystem of {model}")
    print(f"  checkpoint: {model.name}, {ckpt / 2**30:.2f} GiB, {len(layers)} MoE layers x {E} experts, "
          f"{expert_nbytes / 2**20:.2f} MiB per expert in {len(layers[0])} ranges")
    print(f"  {args.threads} read threads; {args.sample} experts per variant per run, {args.runs} runs, medians; "
          f"cold = pages evicted by {drop_method}; warm = same experts again right after")
    print(f"\n{'variant':28} {'pattern':7} {'cold ms/exp':>11} {'GB/s':>6} {'vs base':>7} "
          f"{'warm ms/exp':>11} {'GB/s':>6} {'vs base':>7}")
    for v in variants:
        base = RANGES if v == PACKED else "pread/keep"
        for pat in ("single", "layer"):
            row = f"{v:28} {pat:7}"
            for temp in ("cold", "warm"):
                t, b = med[(v, pat, temp)], med[(base, pat, temp)]
                row += f" {t * 1e3:11.2f} {expert_nbytes / t / 1e9:6.2f} {b / t:6.2f}x"
            print(row)

    pack_gain = {pat: 1 - med[(PACKED, pat, "cold")] / med[(RANGES, pat, "cold")] for pat in ("single", "layer")}
    reuse_gain = {f"{pat}/{temp}": 1 - med[(REUSED, pat, temp)] / med[("pread/keep", pat, temp)]
                  for pat in ("single", "layer") for temp in ("cold", "warm")}
    print("\nratios (time saved; > 0 is faster):")
    print("  packed vs 9 ranges (same buffers), cold: " + ", ".join(f"{p} {g:+.1%}" for p, g in pack_gain.items())
          + f" -> at read level pack {'saves' if pack_gain['layer'] >= PAYS else 'does not save'} >= {PAYS:.0%} "
          "on 'layer' (a decode step's pattern); end to end it can save at most this share of the I/O stall "
          "fraction that benches/capped.py reports")
    print("  reused buffers vs fresh np.empty: " + ", ".join(f"{k} {g:+.1%}" for k, g in reuse_gain.items()))
    best = {}
    for temp in ("cold", "warm"):  # every setting within TIE of the fastest
        t_min = min(med[(f"{m}/{p}", "layer", temp)] for m, p in SETTINGS)
        best[temp] = [f"{m}/{p}" for m, p in SETTINGS if med[(f"{m}/{p}", "layer", temp)] <= t_min * (1 + TIE)]
    print(f"  fastest for a layer's misses (within {TIE:.0%}): cold {', '.join(best['cold'])}; "
          f"warm {', '.join(best['warm'])}")
    if args.json:
        out = {"caliber": {"model": str(model), "checkpoint_bytes": ckpt, "expert_bytes": expert_nbytes,
                           "ranges_per_expert": len(layers[0]), "threads": args.threads, "runs": args.runs,
                           "sample": args.sample, "drop_method": drop_method, "cpu_count": psutil.cpu_count()},
               "median_s_per_expert": {"|".join(k): v for k, v in med.items()},
               "pack_gain": pack_gain, "reuse_gain": reuse_gain, "fastest": best}
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
