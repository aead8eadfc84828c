"""Default budgets of the expert tiers, each from the free memory where that tier lives.

- CUDA (GPU memory + host RAM): the hot tier lives on the GPU, so its default
  is a fraction of the GPU's *free device memory* (measured after the dense
  part is loaded there); the warm tier lives in host RAM, so its default is a
  fraction of *available host memory*. Two tiers are on by default;
  ``host_cache_gb=0`` turns the warm tier off (copy on every miss).
- Metal and the CPU backend (one unified memory): one tier, its default a
  fraction of available host memory, as before. A warm tier there is only the
  stand-in that runs the CUDA path's logic on one memory (tests, benches):
  both tiers then come out of the *same* memory, never twice — the default hot
  budget is the one-tier default minus the warm budget, and explicit budgets
  that add up to more than the machine's memory are refused. (``mlx-tier run``
  refuses ``--host-cache-gb`` off CUDA outright: no user gains from it there.)

"Available host memory" is what this process may still take: inside a memory
cgroup (a container's limit) the cgroup's limit less its use, when that is the
smaller (:mod:`mlx_tier.engine.limits`).

Pure functions over a :class:`FreeMemory` snapshot; :func:`probe` is the only
place that asks the OS and MLX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from mlx_tier.engine.limits import MemoryLimit, probe_limit
from mlx_tier.errors import BudgetError, ConfigError
from mlx_tier.units import GIB

# Fraction of the free memory of a tier's home that its default budget takes:
# room for the KV cache, activations, the OS (as tiered.DEFAULT_BUDGET_FRACTION).
DEFAULT_FRACTION = 0.5


@dataclass(frozen=True)
class FreeMemory:
    """Where the tiers would live and how much room there is, in bytes.

    Attributes:
        backend: ``"cuda"``, ``"metal"`` or ``"cpu"`` (:func:`backend_of`).
        host_available: host memory this process may still take now
            (:attr:`MemoryLimit.available`: a cgroup's limit less its use when
            smaller than psutil's ``available``).
        host_total: host memory this process may hold in all (the host's, or
            its cgroup's limit when smaller).
        device_free: free GPU memory (CUDA only; ``None`` elsewhere or unknown).
        device_total: GPU memory installed (CUDA only; ``None`` elsewhere or unknown).
        limit: where the host figures came from (``None``: given, not probed).
    """

    backend: str
    host_available: int
    host_total: int
    device_free: int | None = None
    device_total: int | None = None
    limit: MemoryLimit | None = None

    @property
    def unified(self) -> bool:
        """One memory for every tier (Metal, CPU): no separate warm tier."""
        return self.backend != "cuda"


@dataclass(frozen=True)
class TierBudgets:
    """Bytes of each tier. ``warm`` is ``None`` for one tier (no warm pool)."""

    hot: int
    warm: int | None


def device_memory(info: dict, active: int = 0) -> tuple[int | None, int | None]:
    """``(free, total)`` GPU bytes from ``mx.device_info()`` on CUDA.

    MLX's CUDA device info gives ``free_memory``/``total_memory`` (NVML,
    system-wide, else ``cudaMemGetInfo``) in recent versions; older ones give
    only ``memory_size``, and then free = total - ``active`` (MLX's own
    allocations: other processes' use is not seen). ``(None, None)`` when
    neither is there.
    """
    total = info.get("total_memory", info.get("memory_size"))
    free = info.get("free_memory")
    if free is None and total is not None:
        free = max(0, int(total) - int(active))
    return (None if free is None else int(free)), (None if total is None else int(total))


def backend_of(api=mx) -> str:
    """``"metal"``, ``"cuda"`` or ``"cpu"``: where ``api`` (``mlx.core``) computes."""
    if api.metal.is_available():
        return "metal"
    cuda = getattr(api, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else "cpu"


def host_available() -> int:
    """Host memory this process may still take now, bytes (:attr:`MemoryLimit.available`:
    psutil's ``available``, or less under a cgroup limit)."""
    return probe_limit().available


def probe(api=mx) -> FreeMemory:
    """The memory snapshot now (``api``: ``mlx.core``, or a fake).

    On CUDA, MLX's buffer cache is emptied first (``clear_cache``): buffers
    freed while the dense part was loaded and converted stay reserved on the
    GPU and would count as used, shrinking the hot default.
    """
    limit = probe_limit()
    backend = backend_of(api)
    free = total = None
    if backend == "cuda":
        api.clear_cache()
        free, total = device_memory(api.device_info(), api.get_active_memory())
    return FreeMemory(backend, limit.available, limit.total, free, total, limit)


# MLX's memory limit before mlx-tier first widened it, per ``mlx.core`` (or fake):
# its default (a fraction of GPU memory: 0.8, 0.9, 0.95 across versions) or the user's.
_LIMIT_BEFORE: dict = {}


def widen_memory_limit(warm_bytes: int, api=mx) -> int | None:
    """On CUDA, raise MLX's memory limit to what it was before plus the warm pools' bytes.

    A CUDA build of MLX counts every allocation against one limit (by default
    a fraction of the GPU's memory, ``mlx/backend/cuda/allocator.cpp``), the
    host-resident managed buffers of the warm pools included; above it each
    evaluation, ``async_eval`` too, first waits for work in flight
    (``mlx/transforms.cpp``), which would serialise the hot and warm shares
    once a large warm pool fills. The limit only paces evaluation; the GPU's
    own memory is bounded by the hot budget. Never lowers the limit, and
    repeated loads do not add up.

    Args:
        warm_bytes: bytes of all warm pools once written.
        api: ``mlx.core``, or a fake.

    Returns:
        The limit now in force on CUDA (bytes); ``None`` elsewhere (nothing changed).
    """
    if backend_of(api) != "cuda":
        return None
    now = int(api.get_memory_limit())
    want = _LIMIT_BEFORE.setdefault(api, now) + int(warm_bytes)
    if want > now:
        api.set_memory_limit(want)
    return max(want, now)


def describe_defaults(mem: FreeMemory, memory_limit: int | None = None) -> str:
    """One line: where the tiers would live on this machine and their default budgets
    (``benches/gpu_check.sh`` prints it). ``memory_limit``: MLX's, in bytes, if known."""
    gib = 2**30
    limit = f"; MLX memory limit {memory_limit / gib:.1f} GiB" if memory_limit is not None else ""
    if mem.limit is not None and mem.limit.limited:
        limit += f"; host memory bounded by {mem.limit.source} ({mem.limit.total / gib:.1f} GiB)"
    if mem.unified:
        return (f"backend {mem.backend}: one memory, host available {mem.host_available / gib:.1f} GiB -> one tier, "
                f"default {default_warm_budget(mem.host_available) / gib:.1f} GiB{limit}")
    if mem.device_free is None:
        return f"backend cuda: MLX reports no GPU memory: give `cache_gb` (the hot budget){limit}"
    b = tier_budgets(None, None, mem)
    return (f"backend cuda: GPU free {mem.device_free / gib:.1f} of {mem.device_total / gib:.1f} GiB, host "
            f"available {mem.host_available / gib:.1f} GiB -> default hot {b.hot / gib:.1f} GiB, warm "
            f"{b.warm / gib:.1f} GiB{limit}")


def two_tiers(host_cache_gb: float | None, backend: str) -> bool:
    """Whether a warm tier is built: always on CUDA, elsewhere only when asked for."""
    return backend == "cuda" or host_cache_gb is not None


def default_hot_budget(device_free: int) -> int:
    """The hot (GPU) tier's default budget in bytes: :data:`DEFAULT_FRACTION` of
    ``device_free``, the GPU's free memory in bytes measured after the dense
    part is loaded there. The one rule for both a run (:func:`tier_budgets`)
    and ``mlx-tier plan --gpu-gb`` (:mod:`mlx_tier.tools.plan_gpu`); the other half
    is left for the KV cache and activations."""
    return int(device_free * DEFAULT_FRACTION)


def default_warm_budget(host_available: int) -> int:
    """The warm (host) tier's default budget in bytes on CUDA: :data:`DEFAULT_FRACTION`
    of ``host_available``, the host memory available in bytes. The same figure is
    the one tier's default on one memory (Metal, CPU): the expert cache in host memory."""
    return int(host_available * DEFAULT_FRACTION)


def _gib(name: str, v: float | None, positive: bool) -> int | None:
    if v is None:
        return None
    if not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v) or v < 0 or (positive and v == 0):
        need = "> 0" if positive else ">= 0"
        raise ConfigError(f"{name} must be a finite number of GiB {need}, got {v!r}", field=name)
    return int(v * GIB)


def tier_budgets(cache_gb: float | None, host_cache_gb: float | None, mem: FreeMemory) -> TierBudgets:
    """The hot and warm budgets for ``cache_gb``/``host_cache_gb`` (GiB, ``None``: default).

    Returns:
        :class:`TierBudgets` in bytes (see the module doc for the rules).

    Raises:
        ConfigError: a budget that is negative, zero (hot) or not finite.
        BudgetError: on CUDA, free GPU memory unknown and no ``cache_gb``; on
            one memory, the warm budget leaving nothing of the default for the
            hot tier, or the two explicit budgets exceeding the machine's memory.
    """
    hot, warm = _gib("cache_gb", cache_gb, True), _gib("host_cache_gb", host_cache_gb, False)
    if not mem.unified:
        if hot is None and mem.device_free is None:
            raise BudgetError("cannot tell the GPU's free memory (MLX reports none): give cache_gb, the GPU "
                              "(hot tier) budget", field="cache_gb")
        hot = hot if hot is not None else default_hot_budget(mem.device_free)
        warm = warm if warm is not None else default_warm_budget(mem.host_available)
        return TierBudgets(hot, warm)
    one_tier = default_warm_budget(mem.host_available)
    if warm is None:
        return TierBudgets(hot if hot is not None else one_tier, None)
    if hot is None:
        if warm >= one_tier:
            raise BudgetError(f"host_cache_gb {warm / GIB:.2f} GiB leaves nothing of the default expert budget "
                              f"({one_tier / GIB:.2f} GiB) for the hot tier: on the {mem.backend} backend both "
                              "tiers share one memory", field="host_cache_gb")
        return TierBudgets(one_tier - warm, warm)
    if hot + warm > mem.host_total:
        raise BudgetError(f"cache_gb + host_cache_gb = {(hot + warm) / GIB:.2f} GiB is more than this machine's "
                          f"memory ({mem.host_total / GIB:.1f} GiB): on the {mem.backend} backend both tiers "
                          "share one memory", field="host_cache_gb")
    return TierBudgets(hot, warm)
