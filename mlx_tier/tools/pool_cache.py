"""The expert cache of a throughput run under a memory cap: slots traded for pools.

The memory split (:func:`mlx_tier.engine.footprint.split`) gives the expert
cache half of what the fixed parts leave and the KV caches the rest. Under a
tight cap that leaves the throughput schedule room for few sequences and short
prompt pools (the 8 GB synthetic under 2 GiB: 2 sequences, 64-token pools), so
each expert read serves few tokens. MoE-Lightning (arXiv 2411.11217) chooses
how memory is shared between weights and KV caches with its roofline model;
here :func:`mlx_tier.tools.pools.choose_slots` prices each cache size with the
pool model before the model is loaded (the cache is sized at load): the
checkpoint's shapes from its headers, its routing from the expert use profile
earlier runs saved (uniform without one: nothing has run yet), the kernels'
and the disk's rates probed here, a few seconds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mlx_tier.defaults import ROUND_EXPERTS
from mlx_tier.engine import footprint
from mlx_tier.engine.footprint import MemoryBudget
from mlx_tier.tools.pools import (
    MAX_DECODE_POOL,
    PoolPlan,
    Shape,
    attention_terms,
    choose_slots,
    head_terms,
    job_attention,
    measure_read_gbps,
    output_layer_bytes,
    probe_rates,
)


def checkpoint_shape(model_dir: Path, budget: MemoryBudget) -> tuple[Shape, dict, list[Path]]:
    """The pool model's :class:`Shape` of a checkpoint, :func:`probe_rates`' arguments for its
    experts, and its expert files (the reads a run makes).

    Raises:
        CheckpointError: an unreadable checkpoint.
    """
    from mlx_tier.engine.checkpoint import open_checkpoint

    ckpt = open_checkpoint(Path(model_dir))
    s = budget.shape
    experts = ckpt.experts()
    _, count, tensors = experts[0]
    projections = sum(t.attr == "weight" for t in tensors.values())
    shape = Shape(layers=len(experts), experts=count, top_k=s.top_k, slots=1,
                  expert_bytes=sum(t.info.nbytes for t in tensors.values()) // count,
                  expert_flops=2.0 * projections * s.hidden * s.expert_inner,
                  **attention_terms(s.hidden, s.heads, s.kv_heads, s.head_dim), kv_bytes=float(s.kv_per_token),
                  heads=s.heads, hidden=s.hidden, inner=s.expert_inner,
                  width=ROUND_EXPERTS if budget.kernel == "cpu" else 0,
                  **head_terms(output_layer_bytes((n, t.nbytes) for n, t in ckpt.index.items()), s.vocab, s.hidden))
    quant = ckpt.config.get("quantization") or {}
    probe = {"expert_shape": (s.expert_inner, s.hidden), "bits": int(quant.get("bits", 4)),
             "group_size": int(quant.get("group_size", 64)),
             "mode": str(quant.get("mode", "affine")), "heads": s.heads, "head_dim": s.head_dim,
             "kv_heads": s.kv_heads}
    return shape, probe, sorted({t.info.file for _, _, ts in experts for t in ts.values()})


def cache_for_pools(model_dir: Path, budget: MemoryBudget, prompt_tokens: int, output_tokens: int,
                    documents: int | None, cap: int | None = None,
                    disk_gbps: float | None = None, max_tok_s: float | None = None
                    ) -> tuple[int, PoolPlan, PoolPlan] | None:
    """``(slots per layer, their pools, the split's own pools)`` when fewer expert slots than
    the split's cache predict more documents/hour (:func:`choose_slots`) for documents of
    ``prompt_tokens`` and ``output_tokens``, at most ``cap`` sequences (``--batch-size``);
    ``None`` when the split's cache stays (it was given, it is one slot row, or nothing
    is gained). ``disk_gbps``: the read rate, measured on the expert files when ``None``;
    ``max_tok_s``: the user's cap on generated tokens per second (:func:`choose_pools`).

    Raises:
        CheckpointError: an unreadable checkpoint.
    """
    most = budget.cache // budget.slot_row if budget.slot_row else 0
    if budget.cache_given or budget.shape is None or most <= 1:
        return None
    pool = min(cap or MAX_DECODE_POOL, documents or MAX_DECODE_POOL)
    if budget.kv >= 2 * pool * budget.shape.kv_per_token * (prompt_tokens + output_tokens):
        return None  # a full pool fits (and a prompt pool beside it): memory bounds no pool, nothing to probe
    from mlx_tier.engine.budgets import host_available

    shape, probe, files = checkpoint_shape(model_dir, budget)
    shape = with_saved_routing(shape, model_dir)
    if disk_gbps is None:
        disk_gbps = measure_read_gbps(files, warm=sum(f.stat().st_size for f in files) <= 0.8 * host_available())
    rates = probe_rates(disk_gbps, **probe, attention=job_attention(budget.kernel), kernel=budget.kernel)
    slots, plan, own = choose_slots(shape, rates, prompt_tokens, output_tokens, budget.cache + budget.kv,
                                    budget.slot_row, most, documents, cap, budget.prefill_step,
                                    lambda n: lent_slots(with_cache(budget, n), pool, prompt_tokens + output_tokens),
                                    max_tok_s)
    return (slots, plan, own) if slots < most else None


def with_saved_routing(shape: Shape, model_dir: Path) -> Shape:
    """``shape`` with the experts' shares of the routed entries in the expert use profile
    earlier runs of ``model_dir`` saved (:mod:`mlx_tier.routing.profile`); unchanged
    without one, or with one of another shape or unreadable (it only refines a guess)."""
    from mlx_tier.routing import profile
    from mlx_tier.tools.pools import popularity

    try:
        saved = profile.load_for(model_dir, shape.layers, shape.experts)
    except profile.ProfileError:
        return shape
    return shape if saved is None else replace(shape, popularity=popularity(saved.counts))


def lent_slots(budget: MemoryBudget, batch: int, context: int) -> int:
    """Slots per layer the throughput schedule's decode steps borrow within ``budget``
    (:meth:`~mlx_tier.engine.footprint.MemoryBudget.decode_slots`), at most a layer's
    experts beyond the cache's slots; 0 where :data:`~mlx_tier.engine.footprint.LEND_SLOTS`
    is off or the cache was given (``--cache-gb``, ``--slots``: the user's size is kept)."""
    if not footprint.LEND_SLOTS or budget.cache_given or budget.shape is None or budget.slot_row <= 0:
        return 0
    slots = budget.cache // budget.slot_row
    return max(0, min(budget.decode_slots(batch, context), budget.shape.experts - slots))


def with_cache(budget: MemoryBudget, slots: int) -> MemoryBudget:
    """``budget`` with an expert cache of ``slots`` slot rows, the KV caches taking the rest."""
    cache = slots * budget.slot_row
    return replace(budget, cache=cache, kv=budget.kv + budget.cache - cache)
