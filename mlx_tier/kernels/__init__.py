"""Code that computes a tiered block's experts: the registry, the CPU kernel (float32 loops, integer rows on AVX-512 VNNI or AVX2), the Metal kernels and their sources."""

# Every kernel name (mlx_tier.kernels.registry resolves them); here, with no MLX import,
# so that the CLI lists them in --help without loading MLX.
KERNELS = ("mlx", "cpu", "metal", "auto")
