"""The three-tier split of a checkpoint's experts on a GPU machine (``mlx-tier plan --gpu-gb``).

From a :class:`mlx_tier.plan.Plan` (config and shard headers only): the GPU
holds the dense part and the KV cache, the rest of ``gpu_gb`` is the hot tier;
the warm tier is the host budget (given, or the fraction of available host
memory mlx-tier takes by default); the remaining experts stay cold on SSD. On a
GPU the checkpoint's dtype is kept, so one expert takes its on-disk bytes in
either tier. Slots are the same in every MoE layer (as ``TierConfig`` makes them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# The warm tier's default on CUDA: this fraction of available host memory.
from .tier_budgets import DEFAULT_FRACTION as HOST_BUDGET_FRACTION

GIB = 1024**3


@dataclass(frozen=True)
class TierSplit:
    """Experts per MoE layer in each tier, and the budgets (bytes) behind them."""

    gpu_bytes: int
    hot_budget: int  # gpu_bytes - dense - KV cache
    host_budget: int
    expert_bytes: int
    experts_per_layer: int
    hot_slots: int
    warm_slots: int
    cold_experts: int

    def as_dict(self) -> dict:
        return asdict(self)


def three_tier_split(plan, gpu_gb: float, host_gb: float | None = None) -> TierSplit:
    """Split ``plan``'s experts into GPU (hot), host (warm) and SSD (cold) per layer.

    Args:
        plan: a :class:`mlx_tier.plan.Plan`.
        gpu_gb: GPU memory for mlx-tier, GiB.
        host_gb: host memory for the warm tier, GiB (default: half of the
            plan's available memory).

    Raises:
        ValueError: ``gpu_gb`` or ``host_gb`` not a positive finite number.
    """
    for name, v in (("gpu_gb", gpu_gb), ("host_gb", 1.0 if host_gb is None else host_gb)):
        if not (isinstance(v, (int, float)) and 0 < v < float("inf")):
            raise ValueError(f"{name} must be a positive number of GiB, got {v!r}")
    gpu = int(gpu_gb * GIB)
    hot_budget = max(0, gpu - plan.dense_bytes - plan.kv_bytes)
    host = int(host_gb * GIB) if host_gb is not None else int(plan.memory_available * HOST_BUDGET_FRACTION)
    per_slot_row = plan.moe_layers * plan.expert_bytes_disk  # one slot in every layer
    E = plan.experts_per_layer
    hot = min(E, hot_budget // per_slot_row) if per_slot_row else 0
    warm = min(E - hot, host // per_slot_row) if per_slot_row else 0
    return TierSplit(gpu, hot_budget, host, plan.expert_bytes_disk, E, int(hot), int(warm), int(E - hot - warm))
