"""mlx-tier: run Mixture-of-Experts models larger than memory with MLX.

Experts stream from SSD (safetensors byte ranges) into a bounded resident
cache; everything else is mlx-lm's.
"""

from .cache import CacheStats, ExpertCache
from .store import CheckpointError
from .tiered import BudgetError, TierConfig, TieredExperts, cache_stats, load

__all__ = [
    "BudgetError",
    "CacheStats",
    "CheckpointError",
    "ExpertCache",
    "TierConfig",
    "TieredExperts",
    "cache_stats",
    "load",
]
__version__ = "0.1.0"
