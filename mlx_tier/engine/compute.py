"""What will compute a tiered model, known before it loads: its expert kernel and its cast.

A summary's tokens depend on them (the CPU kernel's logits are within a stated bound
of MLX's, not equal: docs/kernels.md; a bf16 model computed in float32 is not the
same model either), so a job records them with each summary and compares them with
the next run's before that run loads anything (:mod:`mlx_tier.job.provenance`).

:func:`planned_compute` follows :func:`mlx_tier.engine.load.load`'s choice:
:func:`mlx_tier.kernels.registry.choose` for the kernel (``auto`` takes MLX's ops where
the CPU kernel lacks the experts' quantization mode: seen in ``config.json``, and where it
names such a mode, from the checkpoint's expert blocks, opened lazily), and
:func:`mlx_tier.engine.dtypes.compute_dtype` for the cast.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_tier.engine.budgets import backend_of, two_tiers
from mlx_tier.engine.dtypes import compute_dtype

# The kernel load() uses when TierConfig.kernel is None: MLX's own ops, whose greedy tokens
# equal mlx-lm's exactly (the job runner's default is defaults.JOB_KERNEL).
LIBRARY_KERNEL = "mlx"


def dtype_name(dtype) -> str:
    """A cast as reports and records name it: ``"float32"``..., ``"as stored"`` for none."""
    return str(dtype).removeprefix("mlx.core.") if dtype is not None else "as stored"


def compute_fields(kernel: str, dtype) -> dict:
    """``{"kernel", "dtype"}`` as a summary's record keeps them (``dtype``: an
    ``mx.Dtype``, ``None`` for no cast, or its :func:`dtype_name`)."""
    return {"kernel": kernel, "dtype": dtype if isinstance(dtype, str) else dtype_name(dtype)}


def cpu_kernel_lacks(model_dir: Path | None) -> bool:
    """Whether ``config.json`` gives some layer a quantization mode the CPU kernel lacks
    (:func:`mlx_tier.kernels.warmup.all_formats`); ``False`` for an unreadable one (the
    load says what is wrong with it)."""
    from mlx_tier.kernels.warmup import SUPPORTED_MODES, all_formats

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text()) if model_dir else {}
        return any(f["mode"] not in SUPPORTED_MODES for f in all_formats(config))
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return False


def _choice_of_blocks(name: str, model_dir: Path, two: bool) -> str:
    """The load's own choice (:func:`mlx_tier.kernels.registry.choose`) from the checkpoint's
    expert blocks, opened lazily (no weight read): asked only when ``config.json`` gives some
    layer a mode the CPU kernel lacks, which may be a layer that is not an expert's.
    ``"mlx"`` when the checkpoint cannot be opened (the load then says why)."""
    from mlx_tier.engine.checkpoint import open_checkpoint
    from mlx_tier.errors import MlxTierError
    from mlx_tier.kernels.registry import choose

    try:
        return choose(name, [b for _, b in open_checkpoint(Path(model_dir)).blocks], two)
    except (MlxTierError, OSError, ValueError):
        return "mlx"


def planned_compute(kernel: str | None, dtype, host_cache_gb: float | None, model_dir: Path | None) -> dict:
    """:func:`compute_fields` of the model ``load`` would build from ``model_dir`` with
    ``TierConfig(kernel=kernel, dtype=dtype, host_cache_gb=host_cache_gb)``.

    Raises:
        ValueError: an unknown kernel name (as ``load`` would).
    """
    from mlx_tier.kernels.registry import resolve

    name = kernel or LIBRARY_KERNEL
    two = two_tiers(host_cache_gb, backend_of())
    chosen = "cpu" if two and name == "auto" else resolve(name)
    if chosen == "cpu" and name == "auto" and cpu_kernel_lacks(model_dir):
        chosen = _choice_of_blocks(name, model_dir, two)
    return compute_fields(chosen, compute_dtype(dtype, chosen, two))
