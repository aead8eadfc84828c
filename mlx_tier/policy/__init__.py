"""Which expert leaves a slot, where an expert is placed, what a copy costs. Plain Python/numpy: no MLX, so the live cache and the simulators share every decision."""
