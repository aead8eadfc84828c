"""A tiered model: the checkpoint as stored, the cold store, the hot cache, the warm pool, budgets and loading into mlx-lm."""
