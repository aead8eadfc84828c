"""mlx-tier: run Mixture-of-Experts models larger than memory with MLX.

Experts stream from SSD (safetensors byte ranges) into a bounded resident
cache; everything else is mlx-lm's.

The names below are imported on first use (PEP 562), so that light commands
(``mlx-tier status``, ``mlx-tier thermal``) start without loading MLX,
mlx-lm and transformers.
"""

import importlib

_EXPORTS = {
    "BudgetError": "mlx_tier.errors",
    "CacheStats": "mlx_tier.engine.cache_stats",
    "CheckpointError": "mlx_tier.errors",
    "ExpertCache": "mlx_tier.engine.expert_cache",
    "TierConfig": "mlx_tier.engine.load",
    "TieredExperts": "mlx_tier.engine.load",
    "cache_stats": "mlx_tier.engine.load",
    "cast_model": "mlx_tier.engine.dtypes",
    "load": "mlx_tier.engine.load",
}
__all__ = ["BudgetError", "CacheStats", "CheckpointError", "ExpertCache", "TierConfig", "TieredExperts",
           "cache_stats", "cast_model", "load"]  # = _EXPORTS
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
