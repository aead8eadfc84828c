"""Commands around a model: plan (will it fit), convert, the built-in demo model."""

# `convert`'s choices (mlx_tier.tools.convert checks them), here with no MLX import so that the
# CLI lists them in --help without loading MLX: routed experts' bits, quantisation modes
# (mxfp4 is 4-bit only), routers' and gates' bits (16: unquantised).
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_MODES = ("affine", "mxfp4")
ROUTER_BITS = (8, 16)
