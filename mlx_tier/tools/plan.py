"""Capacity worksheet for a checkpoint, from its config and safetensors headers.

No weight is read: the model is built lazily with mlx-lm only to locate its
expert blocks, and sizes come from the shard headers. The memory figures are
a run's own: what this process may use (its cgroup's limit or the host's
available memory, :mod:`mlx_tier.engine.limits`, or ``memory_gb``), split as
``mlx-tier run`` splits it (:func:`mlx_tier.engine.footprint.split`).

The speeds come from the expert kernel a run would use, the layers' own work
and the disk read as a run reads it, each measured briefly
(:mod:`mlx_tier.tools.kernel_probe`), over a range of hit rates: uniform random
routing (hit = S / E, the floor for an LRU cache of S slots) up to strong
locality (hit = 0.98, the published 97.8-99.7%; or S / E when higher). With
the bandwidths given instead, decode follows the roofline of docs/architecture.md:

    tok/s = 1 / (bytes_missed_per_token / disk_bw + bytes_active_per_token / compute_bw)

with bytes_missed_per_token = (1 - hit_rate) x top_k x MoE layers x bytes per expert.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_tier.defaults import DEFAULT_POOL_STEP, JOB_KERNEL
from mlx_tier.engine import footprint
from mlx_tier.engine.checkpoint import CONTEXT_KEYS, find_expert_blocks, open_checkpoint
from mlx_tier.engine.dtypes import job_compute_dtype
from mlx_tier.engine.footprint import MemoryBudget, ModelShape, Needs, split
from mlx_tier.engine.limits import probe_limit
from mlx_tier.engine.sizes import expert_inner, may_use_now
from mlx_tier.errors import BudgetError, CheckpointError
from mlx_tier.policy.reads import page_cache_for
from mlx_tier.tools.kernel_probe import measure_expert_reads, measure_kernel, predict
from mlx_tier.units import GIB

TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k", "num_activated_experts", "n_activated_experts")
LOCALITY_HIT_RATE = 0.98


@dataclass(frozen=True)
class Plan:
    """The worksheet (all sizes in bytes, parameters as counts)."""

    model: str
    model_type: str
    moe_layers: int
    experts_per_layer: int
    top_k: int
    total_params: int
    active_params: int  # per token: dense + top_k experts per MoE layer
    dense_params: int
    expert_params: int  # one expert of one layer
    dense_bytes: int  # on disk
    expert_bytes_disk: int  # one expert of one layer
    expert_bytes_resident: int  # in the job's compute dtype (float32 scales on CPU: mlx_tier.engine.dtypes.job_compute_dtype)
    expert_bytes_warm: int  # in a CUDA warm tier: floating tensors float32 for the CPU kernel, else as stored (mlx_tier.engine.warm_pool)
    layer_bytes_disk: int  # all experts of one layer
    experts_per_gb: float  # resident experts per GiB of cache
    context_tokens: int
    kv_bytes: int  # estimate for context_tokens, standard attention (upper bound)
    memory_total: int
    memory_available: int
    cache_budget: int  # what mlx-tier would choose now
    slots_per_layer: int
    disk_gbps: float
    disk_measured: bool
    compute_gbps: float
    tok_s_low: float  # hit rate = S / E
    tok_s_high: float  # hit rate = max(0.98, S / E)
    hit_rate_low: float
    hit_rate_high: float
    source: str = "local"  # local: a checkpoint folder; hub: config and headers read remotely, nothing downloaded
    memory_source: str = "host"  # where memory_total/available came from: host, a cgroup file, or memory_gb
    memory_split: dict | None = None  # the run's split of its total (mlx_tier.engine.footprint.MemoryBudget.as_dict)
    model_context: int | None = None  # the checkpoint's context length (config.json), None: not stated
    memory_fit: str | None = None  # why a run would be refused before loading (None: it fits)
    kernel: str = "mlx"  # the expert kernel a run would use, the one measured
    prompt_gflops: float = 0.0  # that kernel's prompt step, measured (0: not measured)
    disk_method: str = "given"  # how disk_gbps was found
    prompt_step: int = 0  # tokens per prompt step a run would take (memory permitting)
    prompt_tok_s: float = 0.0  # predicted prompt reading, tokens/s at the uniform hit rate (0: not predicted)
    # The overnight job's throughput schedule (mlx_tier.tools.pools.PoolPlan.as_dict, with the
    # document lengths it is for and the rates it used); None when not planned.
    job: dict | None = None
    kv_bits: int | None = None  # KV caches quantized to these bits (run --kv-bits); None: not
    # How a run's throughput schedule reads experts (TierConfig.page_cache, mlx_tier.policy.reads):
    # "direct" (around the page cache, where the filesystem takes O_DIRECT) or "keep".
    page_cache: str = "keep"

    def as_dict(self) -> dict:
        return asdict(self)


def _params(index: dict, name: str, group_size: int | None) -> int:
    """Logical parameter count of a tensor; quantised weights are unpacked via their scales."""
    info = index[name]
    base = name.rsplit(".", 1)[0]
    scales = index.get(f"{base}.scales")
    if name.endswith(".weight") and scales is not None and info.dtype == "U32":
        in_features = scales.shape[-1] * (group_size or 64)
        return int(np.prod(info.shape[:-1])) * in_features
    return int(np.prod(info.shape))


def _group_size(config: dict, tensor: str, default: int | None) -> int | None:
    q = config.get("quantization") or {}
    layer = q.get(tensor.rsplit(".", 1)[0])
    if isinstance(layer, dict) and "group_size" in layer:
        return layer["group_size"]
    if q.get("mode") in ("mxfp4", "mxfp8"):
        return 32
    if q.get("mode") == "nvfp4":
        return 16
    return default


def measure_disk_gbps(files: list[Path], total_mb: int = 64, chunk_mb: int = 4) -> float:
    """Random positioned reads of ``chunk_mb`` MiB from the shards, in GB/s.

    On Linux the pages are dropped from the page cache first
    (``posix_fadvise(DONTNEED)``) so the figure is the disk's, not memory's.
    """
    chunk = chunk_mb * 2**20
    files = [f for f in files if f.stat().st_size >= chunk]
    if not files:
        return 0.0
    rng = random.Random(0)
    buf = bytearray(chunk)
    done, t = 0, 0.0
    while done < total_mb * 2**20:
        f = rng.choice(files)
        size = f.stat().st_size
        off = rng.randrange(0, size - chunk + 1) // 4096 * 4096
        fd = os.open(f, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, off, chunk, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            n = os.preadv(fd, [buf], off)
            t += time.perf_counter() - t0
        finally:
            os.close(fd)
        done += n
    return done / t / 1e9 if t else 0.0


def measure_compute_gbps(out_dim: int = 1536, in_dim: int = 1024, bits: int = 4, reps: int = 20) -> float:
    """Weights streamed per second by a 4-bit matvec on the default device, in GB/s."""
    w = mx.random.normal((out_dim, in_dim))
    qw, s, b = mx.quantize(w, group_size=32, bits=bits)
    x = mx.random.normal((1, in_dim))
    mx.eval(qw, s, b, x)
    mx.eval(mx.quantized_matmul(x, qw, s, b, group_size=32, bits=bits))
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(mx.quantized_matmul(x, qw, s, b, group_size=32, bits=bits))
    dt = (time.perf_counter() - t0) / reps
    return (qw.nbytes + s.nbytes + b.nbytes) / dt / 1e9


def predicted_tok_s(hit_rate: float, missed_bytes_at_zero: float, active_bytes: float, disk_gbps: float, compute_gbps: float) -> float:
    """The docs/architecture.md roofline for one hit rate (bytes per token, GB/s)."""
    t = (1 - hit_rate) * missed_bytes_at_zero / (disk_gbps * 1e9) + active_bytes / (compute_gbps * 1e9)
    return 1 / t if t > 0 else float("inf")


@dataclass(frozen=True)
class _Source:
    """A checkpoint's config, tensor headers and expert block paths, local or on the hub."""

    name: str
    kind: str  # "local" or "hub"
    config: dict
    index: dict
    blocks: list
    files: list  # local shards (for the disk probe); empty for the hub


def _open(model: str | Path) -> _Source:
    """Read what the plan needs: a local folder (or a cached hub snapshot), else the hub's headers."""
    from mlx_tier.engine.hub import (
        cached_snapshot,
        check_name,
        is_repo_id,
        remote_metadata,
    )

    check_name(model)
    path = Path(model).expanduser()
    if not path.exists() and is_repo_id(model):
        path = cached_snapshot(str(model)) or path
    if path.exists():
        return _open_local(path)
    config, index = remote_metadata(str(model))
    return _Source(str(model), "hub", config, index, _blocks_from_config(str(model), config), [])


def _open_local(model_dir: Path) -> _Source:
    ckpt = open_checkpoint(model_dir)  # builds the graph; reads no weight
    return _Source(str(model_dir), "local", ckpt.config, ckpt.index, ckpt.blocks,
                   sorted({i.file for i in ckpt.index.values()}))


def _blocks_from_config(name: str, config: dict) -> list:
    """Expert blocks of the model mlx-lm builds from ``config`` (lazy arrays: nothing is computed)."""
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{name}: cannot build the model with mlx-lm: {e}") from None
    return find_expert_blocks(model)


def measure_scratch_disk_gbps(folder: Path | None = None, total_mb: int = 64) -> float:
    """Disk bandwidth where a download would go (``HF_HUB_CACHE`` or the temp folder), in GB/s:
    a ``total_mb`` MiB scratch file is written, synced, read back as :func:`measure_disk_gbps`
    does (page cache dropped first on Linux), then removed."""
    import tempfile

    folder = Path(folder or os.environ.get("HF_HUB_CACHE") or tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".mlx-tier-disk-probe-") as f:
        block = os.urandom(2**20)
        for _ in range(total_mb):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        return measure_disk_gbps([Path(f.name)], total_mb=total_mb)


def _resident_bytes(index: dict, names: list[str], dtype) -> int:
    """Bytes of tensors ``names`` once resident: floating ones in the compute
    ``dtype`` (``None``: as stored), packed quantized ones as stored."""
    total = 0
    for n in names:
        info = index[n]
        floating = info.dtype in ("F16", "BF16", "F32", "F64")
        itemsize = dtype.size if (dtype is not None and floating) else info.np_dtype.itemsize
        total += int(np.prod(info.shape)) * itemsize
    return total


def _warm_bytes(index: dict, names: list[str], blocks: list) -> int:
    """Bytes of tensors ``names`` in a CUDA run's warm pools: sized by
    :func:`mlx_tier.engine.warm_pool.warm_slot_nbytes` from the checkpoint's dtypes (kept on
    a GPU), with the CPU kernel exactly where the job runner's default kernel
    (``auto``) picks it for ``blocks`` (:func:`mlx_tier.kernels.registry.choose`): float32
    scales then, else the checkpoint's dtypes (MLX's ops). A hub plan's
    ``blocks`` are built unquantized, so there the CPU kernel is assumed."""
    from mlx_tier.engine.warm_pool import warm_slot_nbytes
    from mlx_tier.kernels.registry import choose

    host_kernel = choose("auto", blocks, host_tier=True) == "cpu"
    # whole stacked tensors at once (all experts of all layers): the caller divides by L x E
    return warm_slot_nbytes(((np.prod(index[n].shape), index[n].mx_dtype) for n in names), host_kernel)


def _kv_bytes(config: dict, moe_layers: int, dtype, context_tokens: int, kv_bits: int | None = None) -> int:
    """KV cache bytes of one sequence of ``context_tokens`` (standard attention:
    K and V per layer, ``num_key_value_heads x head_dim``; fp32 on the CPU backend;
    quantized to ``kv_bits``: :func:`mlx_tier.engine.footprint.kv_element_bytes`)."""
    n_layers = config.get("num_hidden_layers") or moe_layers
    heads = config.get("num_attention_heads") or 1
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads)
    kv_itemsize = footprint.kv_element_bytes(kv_bits, 4 if dtype == mx.float32 else 2)
    return int(2 * n_layers * kv_heads * head_dim * kv_itemsize * context_tokens)


def _expert_layout(model_dir, config: dict, index: dict, blocks: list) -> tuple[tuple[str, ...], list[str], int, int]:
    """``(block prefixes, stacked expert tensor names, E, top-k)`` of a checkpoint.

    Raises:
        CheckpointError: no expert block, experts not stacked ``[E, ...]``, or no top-k in the config.
    """
    if not blocks:
        raise CheckpointError(f"{model_dir}: not a Mixture-of-Experts checkpoint")
    prefixes = tuple(path + "." for path, _ in blocks)
    expert_names = [n for n in index if n.startswith(prefixes)]
    if not expert_names:
        raise CheckpointError(f"{model_dir}: experts are not stored stacked [E, ...] (Hugging Face layout?): "
                              "run `mlx-tier convert` first")
    top_k = next((config[k] for k in TOP_K_KEYS if isinstance(config.get(k), int)), None)
    if top_k is None:
        raise CheckpointError(f"{model_dir}: config states no experts-per-token ({', '.join(TOP_K_KEYS)})")
    return prefixes, expert_names, index[expert_names[0]].shape[0], top_k


def _speeds(needs, L: int, top_k: int, expert_bytes_disk: int, dense_bytes: int, hits: tuple[float, float],
            disk_gbps: float, compute_gbps: float, rates, step: int, slotted: bool) -> tuple[float, float, float]:
    """Predicted decode tok/s at the low and high hit rates of ``hits`` and prompt tok/s at
    prompt steps of ``step`` tokens: from the kernel measured (``rates``, each layer's own
    work: :func:`mlx_tier.tools.kernel_probe.predict`), else from the bandwidths alone
    (:func:`predicted_tok_s`; prompt 0). All 0 when the plan is not runnable (below one
    slot per layer, or a rate of 0)."""
    if not (slotted and disk_gbps > 0 and compute_gbps > 0):
        return 0.0, 0.0, 0.0
    if rates is not None:
        low, high = (predict(needs.shape, L, expert_bytes_disk, rates, disk_gbps, h).decode_tok_s for h in hits)
        prompt = predict(needs.shape, L, expert_bytes_disk, rates, disk_gbps, hits[0], prompt_step=step).prompt_tok_s
        return low, high, prompt
    miss_bytes_at_zero = L * top_k * expert_bytes_disk
    active_bytes = dense_bytes + miss_bytes_at_zero
    low, high = (predicted_tok_s(h, miss_bytes_at_zero, active_bytes, disk_gbps, compute_gbps) for h in hits)
    return low, high, 0.0


def make_plan(
    model_dir: str | Path,
    memory_gb: float | None = None,
    context_tokens: int = 8192,
    disk_gbps: float | None = None,
    compute_gbps: float | None = None,
    doc_tokens: int | None = None,
    summary_tokens: int = 64,
    kv_bits: int | None = None,
) -> Plan:
    """Capacity worksheet for ``model_dir`` (no weights loaded).

    Args:
        model_dir: an mlx-lm checkpoint folder, or a Hugging Face repo id: from
            the local hub cache when there, else from the repo's ``config.json``
            and safetensors headers over HTTP (:func:`mlx_tier.engine.hub.remote_metadata`;
            nothing large is downloaded, and the disk is probed with a scratch file).
        memory_gb: the total a run is given (``run --memory-gb``) to plan for; default:
            what this process may use here (its cgroup's limit or the host's
            available memory, :mod:`mlx_tier.engine.limits`).
        context_tokens: context length for the KV cache estimate.
        disk_gbps / compute_gbps: bandwidths; measured briefly when ``None`` (the disk as a
            run reads its misses, the expert kernel a run uses: :mod:`mlx_tier.tools.kernel_probe`).
        doc_tokens / summary_tokens: also plan the overnight job's pools for
            documents of ``doc_tokens`` prompt tokens and summaries of
            ``summary_tokens`` (:func:`job_pools`: its kernels are probed, a few
            seconds); ``None``: not planned.
        kv_bits: plan for KV caches quantized to these bits (``run --kv-bits``).

    Raises:
        CheckpointError: not an mlx-lm MoE checkpoint; not found; hub unreachable.
        ConfigError: ``kv_bits`` this model's KV cache cannot be quantized to.
    """
    source = _open(model_dir)
    model_dir, config, index, blocks = source.name, source.config, source.index, source.blocks
    footprint.check_kv_bits(kv_bits, footprint.head_dim_of(config))
    prefixes, expert_names, num_experts, top_k = _expert_layout(model_dir, config, index, blocks)
    dtype = job_compute_dtype()  # the plan is for mlx-tier run
    sizes = _checkpoint_sizes(config, index, blocks, prefixes, expert_names, num_experts, top_k, dtype,
                              context_tokens, kv_bits)
    L, resident = len(blocks), sizes["expert_bytes_resident"]
    needs = _needs(config, index, expert_names, blocks, num_experts, top_k, dtype, resident, kv_bits)
    memory, traded = _for_pools(_memory(needs, memory_gb), source, doc_tokens, summary_tokens, disk_gbps)
    budget = memory.split.cache if memory.split is not None else 0
    slots = min(num_experts, budget // (L * resident)) if resident else 0
    speed = _measured(source, needs, expert_names, top_k, slots, sizes, memory.split, disk_gbps, compute_gbps)
    job = None
    if doc_tokens and slots and memory.split is not None:  # the split's KV share, as a run sizes its pools
        from mlx_tier.tools.pool_cache import lent_slots
        from mlx_tier.tools.pools import MAX_DECODE_POOL

        lend = lent_slots(memory.split, MAX_DECODE_POOL, doc_tokens + summary_tokens)
        job = job_pools(config, L, num_experts, top_k, slots, sizes["expert_bytes_disk"], 2 * sizes["expert_params"],
                        speed["disk_gbps"], memory.split.kv, doc_tokens, summary_tokens,
                        memory.split.prefill_step, kv_bits, _head_bytes(index), lend, needs.kernel,
                        min(context_tokens, _model_context(config) or context_tokens)) | traded
    return Plan(
        job=job,
        kv_bits=kv_bits,
        page_cache=page_cache_for("throughput", sizes["layer_bytes_disk"] * L, probe_limit().total),
        model=str(model_dir),
        source=source.kind,
        model_type=config.get("model_type", "?"),
        moe_layers=L,
        experts_per_layer=num_experts,
        top_k=top_k,
        **sizes,
        context_tokens=context_tokens,
        model_context=_model_context(config),
        memory_total=memory.total,
        memory_available=memory.available,
        cache_budget=budget,
        slots_per_layer=int(slots),
        memory_source=memory.source,
        memory_split=memory.split.as_dict() if memory.split is not None else None,
        memory_fit=memory.why,
        **speed,
    )


def _checkpoint_sizes(config: dict, index: dict, blocks: list, prefixes: tuple, expert_names: list,
                      num_experts: int, top_k: int, dtype, context_tokens: int, kv_bits: int | None) -> dict:
    """The plan's parameter counts and byte sizes from the checkpoint's headers (:class:`Plan`'s
    field names): ``*_params`` in parameters, ``*_bytes*`` in bytes (resident ones in the
    run's compute ``dtype``), ``experts_per_gb`` per GiB of cache."""
    default_gs = (config.get("quantization") or {}).get("group_size")
    params = {n: _params(index, n, _group_size(config, n, default_gs)) for n in index}
    is_param = {n: not n.endswith((".scales", ".biases")) for n in index}
    expert_params_all = sum(p for n, p in params.items() if n.startswith(prefixes) and is_param[n])
    total = sum(p for n, p in params.items() if is_param[n])
    L = len(blocks)
    expert_params = expert_params_all // (L * num_experts)
    expert_set = set(expert_names)
    expert_bytes_disk = sum(index[n].nbytes for n in expert_names) // (L * num_experts)
    resident = _resident_bytes(index, expert_names, dtype) // (L * num_experts)
    return dict(
        total_params=total,
        active_params=total - expert_params_all + L * top_k * expert_params,
        dense_params=total - expert_params_all,
        expert_params=expert_params,
        dense_bytes=sum(i.nbytes for n, i in index.items() if n not in expert_set),
        expert_bytes_disk=expert_bytes_disk,
        expert_bytes_resident=resident,
        expert_bytes_warm=_warm_bytes(index, expert_names, [b for _, b in blocks]) // (L * num_experts),
        layer_bytes_disk=expert_bytes_disk * num_experts,
        experts_per_gb=GIB / resident if resident else 0.0,
        kv_bytes=_kv_bytes(config, L, dtype, context_tokens, kv_bits),
    )


def _measured(source, needs: Needs, expert_names: list, top_k: int, slots: int, sizes: dict,
              memory_split: MemoryBudget | None, disk_gbps: float | None, compute_gbps: float | None) -> dict:
    """The plan's rates and speed range (:class:`Plan`'s field names): the disk and the expert
    kernel as given, else measured briefly (GB/s), and the decode (tok/s, at the low and high
    hit rates) and prompt-reading speeds they give."""
    disk_method = "given"
    disk_measured = disk_gbps is None
    if disk_gbps is None:
        disk_gbps, disk_method = _measure_disk(source, expert_names, source.blocks, top_k)
    rates = None
    if compute_gbps is None:
        default_gs = (source.config.get("quantization") or {}).get("group_size")
        rates = measure_kernel(needs.shape, _expert_quant(source.config, expert_names, default_gs), needs.kernel)
        compute_gbps = rates.decode_gbps
    num_experts = needs.shape.experts
    hit_low = slots / num_experts
    hit_high = max(LOCALITY_HIT_RATE, hit_low) if slots else 0.0
    step = memory_split.prefill_step if memory_split is not None else 0
    low, high, prompt = _speeds(needs, len(source.blocks), top_k, sizes["expert_bytes_disk"], sizes["dense_bytes"],
                                (hit_low, hit_high), disk_gbps, compute_gbps, rates, step, slots >= 1)
    return dict(
        disk_gbps=round(disk_gbps, 3),
        disk_measured=disk_measured,
        compute_gbps=round(compute_gbps, 3),
        tok_s_low=round(low, 3),
        tok_s_high=round(high, 3),
        hit_rate_low=round(hit_low, 4),
        hit_rate_high=round(hit_high, 4),
        kernel=rates.kernel if rates is not None else needs.kernel,
        prompt_gflops=round(rates.prompt_gflops, 3) if rates is not None else 0.0,
        disk_method=disk_method,
        prompt_step=step,
        prompt_tok_s=round(prompt, 3),
    )


# Prompt tokens of a call beside its text: the default instruction with a part's or a
# combining call's note, in a chat template (SmolLM2's counts 80 and 81); a run counts its own.
CALL_OVERHEAD = 80


def job_pools(config: dict, layers: int, experts: int, top_k: int, slots: int, expert_bytes: int,
              expert_flops: float, disk_gbps: float, free_bytes: int, doc_tokens: int, summary_tokens: int,
              max_pool: int | None = None, kv_bits: int | None = None, head_bytes: int = 0,
              decode_slots: int = 0, kernel: str = "cpu", context: int | None = None) -> dict:
    """The overnight job's pools and predicted documents/hour (:func:`mlx_tier.tools.pools.choose_pools`)
    from a checkpoint's config, its kernels' rates probed here (:func:`mlx_tier.tools.pools.probe_rates`);
    ``head_bytes``: its output layer's bytes (:func:`mlx_tier.tools.pools.output_layer_bytes`; 0: not priced);
    ``decode_slots``: expert slots per layer its decode steps borrow (:func:`mlx_tier.tools.pool_cache.lent_slots`);
    ``kernel``: the expert kernel a run would use (:func:`mlx_tier.kernels.registry.choose`), the one probed;
    ``context``: the usable context (``None``: unbounded): a document longer than a call is
    priced over its calls (:func:`mlx_tier.tools.calls.call_plan`, :data:`CALL_OVERHEAD`
    tokens of instruction a call), as a run prices it."""
    from mlx_tier.tools.calls import CallPlan, call_plan
    from mlx_tier.tools.pools import (
        Shape,
        choose_pools,
        head_terms,
        job_attention,
        probe_rates,
    )

    hidden = int(config.get("hidden_size") or 0)
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inner = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or hidden)
    q = config.get("quantization") or {}
    dense = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    kv = _kv_bytes(config, layers, job_compute_dtype(), 1, kv_bits)
    shape = Shape(layers, experts, top_k, slots, expert_bytes, expert_flops, int(dense * 0.6), 2.0 * dense,
                  4.0 * heads * head_dim, float(kv), heads, hidden, inner,
                  **head_terms(head_bytes, int(config.get("vocab_size") or 0), hidden))
    rates = probe_rates(disk_gbps, (inner, hidden), int(q.get("bits", 4)), int(q.get("group_size", 64)), heads,
                        head_dim, attention=job_attention(kernel), kv_heads=kv_heads,
                        kernel=kernel, mode=str(q.get("mode", "affine")))
    calls = (call_plan(doc_tokens, context - summary_tokens, summary_tokens, CALL_OVERHEAD, CALL_OVERHEAD)
             if context is not None and context > summary_tokens else CallPlan(1, doc_tokens))
    pools = choose_pools(shape, rates, max(1, calls.part_prompt), summary_tokens, max(0, free_bytes),
                         max_pool=max_pool, decode_slots=decode_slots)
    if calls.calls > 1:
        combined = choose_pools(shape, rates, calls.combine_prompt, summary_tokens, max(0, free_bytes),
                                max_pool=max_pool, decode_slots=decode_slots) if calls.combines else None
        pools = pools.of_calls(calls.parts, calls.combines, combined, doc_tokens)
    else:  # one call: its prompt is the document's tokens and the instruction's
        pools = replace(pools, document_tokens=doc_tokens)
    return {**pools.as_dict(), "decode_slots": decode_slots, "rates": rates.as_dict()}


def _model_context(config: dict) -> int | None:
    """The checkpoint's context length (config.json), ``None`` when it states none."""
    return next((config[k] for k in CONTEXT_KEYS if isinstance(config.get(k), int)), None)


def _head_bytes(index: dict) -> int:
    """The output layer's bytes in a checkpoint's ``index`` (name -> :class:`~mlx_tier.engine.checkpoint.TensorInfo`)."""
    from mlx_tier.tools.pools import output_layer_bytes

    return output_layer_bytes((name, info.nbytes) for name, info in index.items())


def _for_pools(memory: _Memory, source, doc_tokens: int | None, summary_tokens: int,
               disk_gbps: float | None) -> tuple[_Memory, dict]:
    """``memory`` with the expert cache a throughput run would load: fewer slots where the pool
    model prices the KV room they leave higher (:mod:`mlx_tier.tools.pool_cache`, as ``run``
    decides; a local checkpoint, the job planned; ``disk_gbps`` when given, else measured);
    and what was traded, for the job's rows. A hub checkpoint keeps the split's cache here."""
    from dataclasses import replace

    from mlx_tier.tools.pool_cache import cache_for_pools, with_cache

    if not doc_tokens or memory.split is None or source.kind != "local":
        return memory, {}
    found = cache_for_pools(Path(source.name), memory.split, doc_tokens, summary_tokens, None, None, disk_gbps)
    if found is None:
        return memory, {}
    split_slots = int(memory.split.cache // memory.split.slot_row)
    return replace(memory, split=with_cache(memory.split, found[0])), {
        "cache_for_pools": {"slots": found[0], "split_slots": split_slots}}


@dataclass(frozen=True)
class _Memory:
    """The memory a plan is made for: totals (bytes), their source, and the run's split
    of it (``None`` with ``why`` when a run would be refused)."""

    total: int
    available: int
    source: str
    split: MemoryBudget | None
    why: str | None


def _memory(needs: Needs, memory_gb: float | None) -> _Memory:
    """The run's memory split as ``mlx-tier run`` makes it (:func:`mlx_tier.engine.footprint.split`):
    of ``memory_gb`` when given (the same total as ``run --memory-gb``), else of what this
    process may use (its cgroup's limit or the host's available memory)."""
    limit = probe_limit()
    if memory_gb is not None:
        total = available = int(memory_gb * GIB)
        source, may_use = "memory_gb", total
    else:
        total, available, source = limit.total, limit.available, limit.source
        may_use = may_use_now(limit.available, limit.total)
    try:
        return _Memory(total, available, source, split(may_use, needs, None, DEFAULT_POOL_STEP, source), None)
    except BudgetError as e:
        return _Memory(total, available, source, None, str(e))


def _needs(config: dict, index: dict, expert_names: list[str], blocks: list, num_experts: int, top_k: int,
           dtype, expert_bytes_resident: int, kv_bits: int | None = None) -> Needs:
    """What a run holds beside its cache (:class:`mlx_tier.engine.footprint.Needs`), from the headers."""
    from mlx_tier.kernels.registry import choose

    names = set(expert_names)
    L = len(blocks)
    dense = _resident_bytes(index, [n for n in index if n not in names], dtype)
    weights = [index[n].shape for n in expert_names if n.endswith(".weight")]
    shape = ModelShape.of_config(config, expert_inner(weights, int(config.get("hidden_size") or 0)), top_k,
                                 num_experts, footprint.kv_element_bytes(kv_bits, 4 if dtype == mx.float32 else 2))
    kernel = choose(JOB_KERNEL, [b for _, b in blocks], False)
    return Needs(dense, L * expert_bytes_resident, L * num_experts * expert_bytes_resident, shape, kernel,
                 expert=expert_bytes_resident)


def _expert_quant(config: dict, expert_names: list[str], default_gs: int | None) -> dict | None:
    """How the experts are quantized (``{"bits", "group_size", "mode"}``), ``None`` when they are not."""
    q = config.get("quantization") or {}
    weight = next((n for n in expert_names if n.endswith(".weight")), None)
    if not q or weight is None or f"{weight.rsplit('.', 1)[0]}.scales" not in expert_names:
        return None
    own = q.get(weight.rsplit(".", 1)[0])
    own = own if isinstance(own, dict) else {}
    return {"bits": own.get("bits", q.get("bits", 4)), "group_size": _group_size(config, weight, default_gs) or 64,
            "mode": own.get("mode", q.get("mode", "affine"))}


def _measure_disk(source, expert_names: list[str], blocks: list, top_k: int) -> tuple[float, str]:
    """Disk GB/s as a run reads its misses (a local checkpoint's own expert ranges, through
    the run's store), else of a scratch file where a download would go; and how."""
    if not source.files:
        return measure_scratch_disk_gbps(), "measured, 4 MiB reads of a scratch file"
    from mlx_tier.engine.store import ExpertStore

    layers = [[n for n in expert_names if n.startswith(path + ".")] for path, _ in blocks]
    with ExpertStore(Path(source.name), index=source.index) as store:
        return measure_expert_reads(store, layers, top_k), f"measured, top-{top_k} expert reads as a run reads them"
