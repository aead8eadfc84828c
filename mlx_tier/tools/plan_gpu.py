"""The three-tier split of a checkpoint's experts on a GPU machine (``mlx-tier plan --gpu-gb``).

From a :class:`mlx_tier.tools.plan.Plan` (config and shard headers only), by the
rules a run on CUDA applies, through the same functions:

- the GPU's free memory a run would measure after loading the dense part is
  assumed to be ``gpu_gb`` minus the dense part (nothing else on the GPU);
- the hot budget is the run's default from that figure
  (:func:`mlx_tier.engine.budgets.tier_budgets`: half of it; the other half is
  left for the KV cache and activations), and the hot slots per layer are what
  :func:`mlx_tier.engine.load.plan_slots` makes of it (0: below one slot per layer,
  which a run refuses);
- the warm budget is the host budget given, else the run's default (half of the
  plan's available memory); warm slots per layer are what
  :func:`mlx_tier.engine.two_tier.warm_slots_for` makes of it;
- the rest of each layer's experts stay cold on SSD.

On a GPU the checkpoint's dtype is kept, so a hot expert takes its on-disk
bytes; a warm expert is sized as a run's pool sizes it
(:func:`mlx_tier.engine.warm_pool.warm_slot_nbytes`): floating tensors (scales, biases)
in float32 where the job runner's default kernel (``auto``) picks the CPU
kernel, else as stored (MLX's ops, for formats the CPU kernel lacks). Slots are the same in every MoE layer (as
``TierConfig`` makes them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mlx_tier.engine.budgets import FreeMemory, tier_budgets
from mlx_tier.errors import BudgetError
from mlx_tier.units import GIB


@dataclass(frozen=True)
class TierSplit:
    """Experts per MoE layer in each tier, and the figures behind them (bytes).

    Attributes:
        gpu_bytes: the GPU's memory (``gpu_gb``).
        device_free: the free GPU memory assumed after the dense part is loaded
            (``gpu_bytes - dense``): the figure the hot default is taken from.
        hot_budget: the hot tier's default from ``device_free``.
        gpu_left: what the GPU keeps for the KV cache and activations
            (``device_free - hot_budget``), to set against the plan's KV estimate.
        host_budget: the warm tier's budget.
        expert_bytes / warm_expert_bytes: one expert of one layer in the hot / warm tier.
        fits: whether a run with these figures would work: at least one hot
            slot per layer (else a run refuses it) and ``gpu_left`` at least
            the plan's KV cache estimate.
        why: what does not fit, in words (empty when ``fits``).
    """

    gpu_bytes: int
    device_free: int
    hot_budget: int
    gpu_left: int
    host_budget: int
    expert_bytes: int
    warm_expert_bytes: int
    experts_per_layer: int
    hot_slots: int
    warm_slots: int
    cold_experts: int
    fits: bool
    why: str

    def as_dict(self) -> dict:
        return asdict(self)


def assumed_memory(plan, gpu_gb: float) -> FreeMemory:
    """The memory snapshot a run on a ``gpu_gb`` GiB GPU would probe after loading
    the dense part: GPU free = ``gpu_gb`` - dense; host as in ``plan``."""
    gpu = int(gpu_gb * GIB)
    return FreeMemory("cuda", plan.memory_available, plan.memory_total, max(0, gpu - plan.dense_bytes), gpu)


def three_tier_split(plan, gpu_gb: float, host_gb: float | None = None) -> TierSplit:
    """Split ``plan``'s experts into GPU (hot), host (warm) and SSD (cold) per layer.

    Args:
        plan: a :class:`mlx_tier.tools.plan.Plan`.
        gpu_gb: the GPU's memory, GiB.
        host_gb: host memory for the warm tier, GiB (default: the run's, half
            of the plan's available memory).

    Raises:
        ValueError: ``gpu_gb`` or ``host_gb`` not a positive finite number.
    """
    from mlx_tier.engine.load import plan_slots
    from mlx_tier.engine.two_tier import warm_slots_for

    for name, v in (("gpu_gb", gpu_gb), ("host_gb", 1.0 if host_gb is None else host_gb)):
        if not (isinstance(v, (int, float)) and 0 < v < float("inf")):
            raise ValueError(f"{name} must be a positive number of GiB, got {v!r}")
    mem = assumed_memory(plan, gpu_gb)
    budgets = tier_budgets(None, host_gb, mem)
    L, E = plan.moe_layers, plan.experts_per_layer
    try:
        hot = plan_slots(budgets.hot, L, plan.expert_bytes_disk, E)
    except BudgetError:  # below one slot per layer: a run refuses it
        hot = 0
    warm = warm_slots_for(budgets.warm, [hot] * L, [E] * L, plan.expert_bytes_warm)[0] if L else 0
    left = mem.device_free - budgets.hot
    why = _what_does_not_fit(hot, left, plan.kv_bytes)
    return TierSplit(mem.device_total, mem.device_free, budgets.hot, left, budgets.warm, plan.expert_bytes_disk,
                     plan.expert_bytes_warm, E, hot, warm, E - hot - warm, not why, why)


def _what_does_not_fit(hot_slots: int, gpu_left: int, kv_bytes: int) -> str:
    """Why a split would not run ("" when it would): no hot slot per layer (a
    run's :func:`mlx_tier.engine.load.plan_slots` raises BudgetError), or less GPU
    memory left than the KV estimate (a run would run out of GPU memory)."""
    why = []
    if hot_slots == 0:
        why.append("a run refuses it: the hot budget holds less than one expert slot per layer")
    if gpu_left < kv_bytes:
        why.append(f"the GPU memory left ({gpu_left / GIB:.2f} GiB) is below the KV cache estimate "
                   f"({kv_bytes / GIB:.2f} GiB)")
    return "; ".join(why)
