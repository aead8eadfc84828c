"""A checkpoint's parts as a run holds them, from its config and shard headers (no
weight is read): the dense part and one expert slot in the compute dtype, and
the shape a step's workspace follows (:class:`~mlx_tier.engine.footprint.ModelShape`).

What ``mlx-tier run`` checks before loading (:func:`mlx_tier.engine.footprint.split`)
and what ``mlx-tier plan`` prints come from here, so the two agree.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
import sys
from pathlib import Path

import numpy as np
import psutil

from mlx_tier.engine.checkpoint import Checkpoint
from mlx_tier.engine.footprint import (
    MemoryBudget,
    ModelShape,
    Needs,
    check_kv_bits,
    head_dim_of,
    kv_element_bytes,
    split,
)
from mlx_tier.errors import BudgetError, CheckpointError
from mlx_tier.units import GIB

# Where configs state the experts per token, by model family.
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k", "num_activated_experts", "n_activated_experts")
FLOATING = ("F16", "BF16", "F32", "F64")


def resident_nbytes(info, itemsize: int | None) -> int:
    """Bytes of a checkpoint tensor once resident: floating tensors at ``itemsize``
    bytes an element (``None``: as stored), packed quantized ones as stored."""
    size = itemsize if (itemsize is not None and info.dtype in FLOATING) else info.np_dtype.itemsize
    return int(np.prod(info.shape)) * size


def top_k_of(config: dict, where: str = "checkpoint") -> int:
    """Experts per token named in ``config``.

    Raises:
        CheckpointError: no key of :data:`TOP_K_KEYS` holds an integer.
    """
    top_k = next((config[k] for k in TOP_K_KEYS if isinstance(config.get(k), int)), None)
    if top_k is None:
        raise CheckpointError(f"{where}: config states no experts-per-token ({', '.join(TOP_K_KEYS)})")
    return int(top_k)


def expert_inner(weight_shapes: list[tuple[int, ...]], hidden: int) -> int:
    """An expert's inner width from its stacked projections' weight shapes ``[E, out, in]``:
    the widest output other than the hidden width."""
    rows = [shape[1] for shape in weight_shapes if len(shape) > 2]
    inner = [r for r in rows if r != hidden]
    return max(inner or rows or [hidden])


def needs_of(ckpt: Checkpoint, kernel: str, itemsize: int | None, kv_itemsize: float) -> Needs:
    """What a run of ``ckpt`` holds beside its expert cache (:class:`Needs`).

    Args:
        ckpt: the opened checkpoint (:func:`mlx_tier.engine.checkpoint.open_checkpoint`).
        kernel: the expert kernel the run uses (``"cpu"``, ``"mlx"``, ``"metal"``).
        itemsize: bytes of a floating element in the compute dtype (4: float32 on
            the CPU backend; ``None``: as stored).
        kv_itemsize: bytes of a cached key/value element.

    Raises:
        CheckpointError: experts not stacked, or no experts-per-token in the config.
    """
    experts = ckpt.experts()
    names = {n for _, _, ts in experts for n in ts}
    slot = max(sum(resident_nbytes(t.info, itemsize) // t.info.shape[0] for t in ts.values()) for _, _, ts in experts)
    dense = sum(resident_nbytes(info, itemsize) for n, info in ckpt.index.items() if n not in names)
    num_experts = max(n for _, n, _ in experts)
    hidden = int(ckpt.config.get("hidden_size") or 0)
    weights = [t.info.shape for _, _, ts in experts for t in ts.values() if t.attr == "weight"]
    shape = ModelShape.of_config(ckpt.config, expert_inner(weights, hidden), top_k_of(ckpt.config, str(ckpt.path)),
                                 num_experts, kv_itemsize)
    return Needs(dense=dense, slot_row=slot * len(experts), all_experts=sum(slot * n for _, n, _ in experts),
                 shape=shape, kernel=kernel, expert=slot,
                 experts_on_disk=sum(t.info.nbytes for _, _, ts in experts for t in ts.values()))


def process_rss() -> int:
    """This process's resident set now, in bytes."""
    return int(psutil.Process().memory_info().rss)


def release_freed_memory() -> None:
    """Hand back to the system what this process has freed but still holds, so that its
    resident set measures what it uses: Python's unreachable objects, MLX's buffer
    cache, and glibc's free heap pages (``malloc_trim(0)``, which returns whole free
    pages inside the heap too: the KV caches of a pool that just finished are freed in
    chunks of a few hundred KiB, below glibc's mmap threshold, and otherwise stay in
    the resident set). Costs tens of milliseconds (a full garbage collection): for a
    decision that changes output, not for every step. No-op for glibc's part where
    there is no glibc (macOS's allocator returns large blocks itself)."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_rss() -> int:
    """This process's largest resident set so far, in bytes: ``VmHWM`` of
    ``/proc/self/status`` on Linux, else ``getrusage`` (bytes on macOS, KiB elsewhere).

    Not ``ru_maxrss`` on Linux: it carries the high-water mark of the process that
    started this one over fork and exec (``mlx-tier run`` started from a large Python
    process would report that process's peak); ``VmHWM`` belongs to this address space.
    """
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def may_use_now(available: int, total: int) -> int:
    """What this process may hold in all now: what it holds (its resident set) and what its
    limit leaves (``available``), never more than the limit's ``total`` (bytes; shared
    library pages count in the resident set but may be charged to another group)."""
    return min(total, available + process_rss())


def run_budget(model_dir: Path, tier, memory_gb: float | None, prefill_step: int,
               kv_bits: int | None = None) -> MemoryBudget | None:
    """The memory split of a run of ``model_dir`` (:func:`mlx_tier.engine.footprint.split`), before loading.

    The total is ``memory_gb`` when given, else what this process may use: the
    memory it holds now plus what its limit leaves (:mod:`mlx_tier.engine.limits`).
    The expert cache is ``tier.cache_gb`` (or ``slots_per_layer`` slot rows) when
    set, else derived.

    Args:
        model_dir: the checkpoint folder.
        tier: the run's :class:`~mlx_tier.engine.load.TierConfig` (kernel, dtype, cache).
        memory_gb: the total in GiB, or ``None``.
        prefill_step: the prompt step asked for (tokens).
        kv_bits: the KV caches quantized to these bits (``None``: in the compute dtype).

    Returns:
        the split, or ``None`` on CUDA (the expert cache lives in GPU memory:
        one host total does not size it).
    Raises:
        BudgetError: ``memory_gb`` above what the process may use; a split that
            does not fit (every figure named).
        ConfigError: ``kv_bits`` this model's KV cache cannot be quantized to.
        CheckpointError: an unreadable checkpoint.
    """
    from mlx_tier.engine import budgets
    from mlx_tier.engine.checkpoint import open_checkpoint
    from mlx_tier.engine.compute import LIBRARY_KERNEL
    from mlx_tier.engine.dtypes import job_compute_dtype
    from mlx_tier.kernels import registry

    mem = budgets.probe()
    if not mem.unified:
        if memory_gb is not None:
            raise BudgetError("`memory_gb` sizes one memory: on CUDA the expert cache lives in GPU memory; give "
                              "`cache_gb` (GPU) and `host_cache_gb` (host) instead", "memory_gb")
        return None
    ckpt = open_checkpoint(Path(model_dir))
    check_kv_bits(kv_bits, head_dim_of(ckpt.config))  # before anything is loaded
    dtype = tier.dtype if tier.dtype is not None else job_compute_dtype()
    kernel = registry.choose(tier.kernel or LIBRARY_KERNEL, [b for _, b in ckpt.blocks], False)
    kv_itemsize = kv_element_bytes(kv_bits, 4 if dtype is None or dtype.size == 4 else 2)
    needs = needs_of(ckpt, kernel, dtype.size if dtype is not None else None, kv_itemsize)
    may_use = may_use_now(mem.host_available, mem.host_total)
    source = mem.limit.source if mem.limit is not None else "host"
    if memory_gb is not None and int(memory_gb * GIB) > may_use:
        raise BudgetError(f"`memory_gb` {memory_gb:g} GiB is more than this process may use: {may_use / GIB:.2f} "
                          f"GiB ({source}: what it holds now and what is available)", "memory_gb")
    total, source = (int(memory_gb * GIB), "memory_gb") if memory_gb is not None else (may_use, source)
    cache = None if tier.cache_gb is None else int(tier.cache_gb * GIB)
    if tier.slots_per_layer is not None:
        cache = tier.slots_per_layer * needs.slot_row
    return split(total, needs, cache, prefill_step, source)
