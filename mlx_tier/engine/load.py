"""Tiered loading: mlx-lm's own model with every expert block served from the cache.

``load`` builds the model with mlx-lm (lazily, so no expert weight is read),
replaces each ``SwitchGLU``/``SwitchMLP`` (``mlx_lm.models.switch_layers``) by a
:class:`TieredExperts` wrapping it, and evaluates only the dense part
(attention, norms, embeddings, routers, shared experts). Generation, batching
and prompt caches stay mlx-lm's.

Dtypes are mlx-lm's (:mod:`mlx_tier.engine.dtypes`): by default none is cast,
as ``mlx_lm.load``; ``TierConfig(dtype=...)`` casts as ``mlx_lm.convert
--dtype`` would. The model survives what mlx-lm does to its models after
load: a cast (``set_dtype``, ``update``) reaches the experts through their
stand-ins (:class:`mlx_tier.engine.slabs.StandIns`), and ``copy.deepcopy``
gives an independent tiered model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.utils import load_tokenizer

from mlx_tier import defaults
from mlx_tier.engine import budgets as tier_budgets
from mlx_tier.engine import module_batch
from mlx_tier.engine.cache import LayerCache
from mlx_tier.engine.cache_stats import CacheStats
from mlx_tier.engine.checkpoint import expert_tensors as _stored_expert_tensors
from mlx_tier.engine.checkpoint import module_at, moe_blocks, open_checkpoint, set_child
from mlx_tier.engine.compute import LIBRARY_KERNEL, dtype_name
from mlx_tier.engine.dtypes import cast_model, compute_dtype, gather_mm_computes
from mlx_tier.engine.expert_cache import ExpertCache
from mlx_tier.engine.prefetch import BackgroundReader, link_layers
from mlx_tier.engine.slabs import SlabTensor, StandIns
from mlx_tier.engine.store import (
    DEFAULT_PAGE_CACHE,
    DEFAULT_READ_METHOD,
    ExpertStore,
    check_read_settings,
)
from mlx_tier.errors import BudgetError, CheckpointError, ConfigError, ProfileError
from mlx_tier.kernels import registry as kernels
from mlx_tier.policy.cost_model import TransferCosts
from mlx_tier.policy.eviction import DEFAULT_POLICY, PolicySpec
from mlx_tier.routing.profile import HOW_TO_MAKE, PROFILE_FILE, adaptive_slots, load_for
from mlx_tier.units import GIB

# Fraction of free memory (after the dense part is loaded) that the default
# budget takes: leaves room for the KV cache, activations and the OS. Free
# memory where the tier lives: GPU memory for the hot tier on CUDA, else host.
DEFAULT_BUDGET_FRACTION = tier_budgets.DEFAULT_FRACTION

# Prefetch off by default (why: mlx_tier.defaults).
DEFAULT_PREFETCH = defaults.DEFAULT_PREFETCH


@dataclass(frozen=True)
class TierConfig:
    """How a model is tiered.

    Attributes:
        cache_gb: expert cache budget in GiB; on CUDA the GPU (hot tier) budget.
            ``None``: half of the free memory where the tier lives, after the
            dense part is loaded (GPU memory on CUDA, else host memory;
            :mod:`mlx_tier.engine.budgets`).
        slots_per_layer: exact slot count per layer; overrides ``cache_gb``.
        policy: the eviction policy (:class:`mlx_tier.policy.eviction.PolicySpec`), made
            once at the edge and passed down whole; a name (lfu, the default
            DEFAULT_POLICY; lru, 2q, or pinned: keeps the saved profile's most
            used experts, needs a profile) is made into a spec here, once. The
            profile a pinned policy needs is bound at load (:func:`tier_model`).
        dtype: cast the model's floating parameters, experts included, to this
            dtype at load, as ``mlx_lm.convert --dtype`` does (those the model's
            ``cast_predicate`` keeps stay as they are:
            :func:`mlx_tier.engine.dtypes.cast_model`); greedy tokens then equal
            mlx-lm's model cast the same way. ``None`` (the default): no cast,
            every tensor as stored, as ``mlx_lm.load`` -- except with the CPU
            kernel on MLX's CPU backend, which computes in float32
            (:func:`mlx_tier.engine.dtypes.compute_dtype`). On MLX's CPU backend
            ``mx.float32`` is much faster than bf16/fp16 (7.5x on a bf16 demo:
            benches/results/cpu-dtype/NOTES.md); the job runner chooses it
            there (:data:`mlx_tier.defaults.JOB_CPU_DTYPE`).
        read_threads: size of the cold-tier read pool.
        read_method: how experts are read: ``"pread"`` or ``"mmap"``
            (:mod:`mlx_tier.engine.store`; default chosen by benches/read_methods.py).
        page_cache: what reads do to the OS page cache: ``"keep"``, ``"drop"``
            (fadvise DONTNEED after reading) or ``"direct"`` (O_DIRECT, pread only).
        prefetch: at each MoE layer, predict the next layer's experts with its
            router and read them in the background (:mod:`mlx_tier.engine.prefetch`).
            Exactness and hit/miss counts do not depend on it. Default from
            ``benches/prefetch.py`` (benches/results/prefetch/NOTES.md); reported to hurt on Apple
            unified memory (docs/architecture.md, "Prefetch").
        read_ahead: when a layer call needs more experts than the layer has
            slots (a large pool), serve them in rounds with each round's
            experts read while the round before computes (MoE-Lightning's
            pipelining of reads and compute, arXiv 2411.11217; known experts,
            not predicted). Bytes only, like ``prefetch``: tokens and hit/miss
            counts do not depend on it. One tier only (not the CUDA path).
        kernel: what computes the experts (:mod:`mlx_tier.kernels.registry`): ``"mlx"``
            (mlx-lm's own ops: greedy tokens equal mlx-lm's exactly, hence the
            library default), ``"cpu"`` (:mod:`mlx_tier.kernels.cpu`, eager,
            within fp32 rounding; on the build machine many times faster),
            ``"metal"``, or ``"auto"`` (cpu on MLX's CPU backend, else mlx).
            ``None`` (the default): the caller's default, resolved in one
            place each: :func:`load` uses :data:`LIBRARY_KERNEL` (``"mlx"``),
            the job runner (:class:`mlx_tier.job.config.JobConfig`)
            :data:`mlx_tier.defaults.JOB_KERNEL` (``"auto"``).
        dense_kernel: with the cpu kernel, also serve the dense layers
            (``nn.QuantizedLinear``, float32 ``nn.Linear`` such as a router
            gate, a tied embedding's ``as_linear``) through it
            (:func:`mlx_tier.kernels.cpu_dense.serve_dense`).
        attention_kernel: with the cpu kernel, also compute attention on
            numpy's BLAS (:func:`mlx_tier.kernels.cpu_attention.serve_attention`:
            MLX's CPU attention runs on the reference BLAS of the Linux wheel).

    Raises:
        ValueError: an unknown ``read_method``/``page_cache``/``kernel``, or mmap with direct.
    """

    cache_gb: float | None = None
    slots_per_layer: int | None = None
    policy: PolicySpec | str = DEFAULT_POLICY
    dtype: mx.Dtype | None = None
    read_threads: int = 4
    read_method: str = DEFAULT_READ_METHOD
    page_cache: str = DEFAULT_PAGE_CACHE
    # Frequency profiles (mlx_tier.routing.profile): pinning, pre-warm, adaptive split.
    # layer_slots: exact slots of each MoE layer (overrides slots_per_layer and
    #   cache_gb; budget = sum of slots x slot bytes).
    # split: "uniform" (same slots everywhere) or "adaptive" (the same total
    #   slots, spread by the profile: mlx_tier.routing.profile.adaptive_slots).
    # profile: a profile file (default: the one saved for the checkpoint).
    # prewarm: fill each layer's slots at load with the profile's most used
    #   experts; None = only for policy "pinned" (explicit, so that the mere
    #   presence of a saved profile never changes a run's numbers).
    layer_slots: tuple[int, ...] | None = None
    split: str = "uniform"
    profile: Path | None = None
    prewarm: bool | None = None
    prefetch: bool = DEFAULT_PREFETCH
    read_ahead: bool = True
    kernel: str | None = None
    dense_kernel: bool = True
    attention_kernel: bool = True
    # The CUDA path (mlx_tier/engine/two_tier.py): a warm tier of host_cache_gb GiB in
    # host memory under the hot slabs (cache_gb is then the GPU budget). On CUDA
    # it is always on, None = half of the available host memory, 0 = off (copy
    # on every miss); elsewhere None = one tier, and a value runs the two-tier
    # logic on the one memory, both budgets taken from it (tier_budgets). Warm
    # experts are computed in place on the CPU stream, or copied to the hot
    # tier when transfer_costs (mlx_tier.policy.cost_model; None: its defaults) say
    # copying is cheaper.
    host_cache_gb: float | None = None
    transfer_costs: TransferCosts | None = None

    def __post_init__(self):
        check_read_settings(self.read_method, self.page_cache)
        if self.kernel is not None:
            kernels.resolve(self.kernel)
        if isinstance(self.policy, str):  # the one place a policy name becomes a spec
            object.__setattr__(self, "policy", PolicySpec(self.policy))


class TieredExperts(nn.Module):
    """Drop-in for an mlx-lm expert block whose experts live in a LayerCache.

    Called like ``SwitchGLU``: ``x`` ``[..., D]`` and router top-k ``indices``
    ``[..., k]`` (uint32) give ``[..., k, D]``. The router output is evaluated
    (the host must know which experts to read), expert ids are remapped to
    slot ids, and the wrapped mlx-lm block runs on the slabs. Once the layer is
    fully resident nothing is evaluated: the remap runs lazily on the device.

    Args:
        inner: the mlx-lm ``SwitchGLU``/``SwitchMLP`` over the slabs.
        cache: the layer's :class:`~mlx_tier.engine.cache.LayerCache`.
        kernel: what computes the experts (:func:`mlx_tier.kernels.registry.kernel_for`).
        remap: the fully resident layer's remap
            (:func:`mlx_tier.kernels.registry.remap_for`); ``None``: ``lut[indices]``
            with the router outputs kept and counted later.
    """

    def __init__(self, inner: nn.Module, cache: LayerCache, kernel: kernels.Kernel = kernels.kernel_for("mlx"),
                 remap: kernels.Remap | None = None):
        super().__init__()
        self._inner = inner  # leading underscore: hidden from parameters()
        self._cache = cache
        self._kernel = kernel  # (inner, x, slots) -> [..., k, D]: mlx_tier.kernels.registry
        self.remap = remap
        self._prefetch = None  # NextLayerPrefetch (mlx_tier.engine.prefetch) when prefetch is on
        self._stand_ins: StandIns | None = None  # the experts as parameters (show())

    @property
    def cache(self) -> LayerCache:
        return self._cache

    def show(self, path: str, tensors: dict[str, SlabTensor]) -> None:
        """Show the experts ``tensors`` of the block at ``path`` as this module's
        parameters (:class:`mlx_tier.engine.slabs.StandIns`)."""
        self._stand_ins = StandIns.show(self, path, tensors)

    def _follow_casts(self) -> None:
        """Cast the slabs whose stand-ins a cast of the model has changed."""
        changed = self._stand_ins.changed(self, self._cache.tensors) if self._stand_ins is not None else None
        if changed:
            self._cache.cast(changed)
            object.__setattr__(self, "_wide_blocks", [])  # they hold the scratch of the old dtypes

    def _resident_slots(self, indices: mx.array) -> mx.array:
        """Slot ids ``[..., k]`` (uint32) of a fully resident layer, lazy; the
        uses are counted later (:meth:`LayerCache.count_deferred`)."""
        cache = self._cache
        if self.remap is None:
            cache.defer_count(indices)
            return cache.lut[indices]
        slots, uses = self.remap(indices.reshape(-1), cache.lut)  # [N], [E]
        cache.add_device_counts(uses)
        return slots.reshape(indices.shape)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if module_batch.in_pass():  # beside other forward passes: computed with their rows
            return module_batch.hand_over(self, x, indices)
        return self.alone(x, indices)

    def alone(self, x: mx.array, indices: mx.array) -> mx.array:
        """``[..., k, D]``: this call's rows only (``__call__`` outside module batching)."""
        self._follow_casts()
        if self._cache.hook is not None:  # between layers: a long step may stop here (set_layer_hook)
            self._cache.hook(self._cache.layer)
        if self._cache.all_resident():  # no miss possible: stay lazy, no host sync
            return self._kernel(self._inner, x, self._resident_slots(indices))
        # Layer l+1's predicted experts [..., k], evaluated with this layer's
        # router output (one host sync), read while this layer computes.
        ahead = self._prefetch.predict(x, indices.shape[-1]) if self._prefetch is not None else None
        if ahead is None:
            mx.eval(indices)
        else:
            mx.eval(indices, ahead)
        idx = np.array(indices)  # [..., k] expert ids
        out = self._compute(x, idx)
        self._cache.settle()  # the reader it replaces first: a later write must not change what it reads
        self._cache.pending = out
        self._cache.end_call()  # drop this layer's unused prefetched experts
        if ahead is not None:
            self._prefetch.issue(np.array(ahead))
        return out

    def _compute(self, x: mx.array, idx: np.ndarray) -> mx.array:
        """``[..., k, D]``: the experts of ``idx`` (``[..., k]`` expert ids) on ``x``,
        made resident by the cache in one pass or, when they exceed the slots, in
        rounds of one pair per row, gathered back in pair order once at the end.
        A host kernel's later rounds hold :attr:`LayerCache.width` experts each, computed
        from the cache's scratch slabs (:meth:`LayerCache.assign_wide`); the rounds are
        asked to their end (the wide ones keep their last experts then)."""
        cache = self._cache
        if cache.widens():
            rounds = cache.assign_wide(idx)
        else:
            rounds = ((slots, mask, None) for slots, mask in cache.assign(idx))
        try:
            return self._rounds(x, idx, rounds)
        finally:  # a round that raised: the rest are abandoned now (a read ahead into scratch ends)
            rounds.close()

    def _rounds(self, x: mx.array, idx: np.ndarray, rounds) -> mx.array:
        """:meth:`_compute`'s rounds, each computed before the next is asked for."""
        parts, ys, whole = [], [], None
        for slots, mask, slabs in rounds:
            inner = self._inner if slabs is None else self._on(slabs)
            if mask is None:  # every needed expert resident at once: one pass, the last
                whole = self._kernel(inner, x, mx.array(slots))
                continue
            # More experts needed than a round holds: this round computes only the
            # (token, k) pairs whose expert is in it, one pair per row.
            k, D = idx.shape[-1], x.shape[-1]
            pairs = np.flatnonzero(mask.reshape(-1))  # rows of [T*k]
            rows = x.reshape(-1, D)[mx.array(pairs // k)]  # [n, D]
            y = self._kernel(inner, rows, mx.array(slots.reshape(-1)[pairs])[:, None])  # [n, 1, D]
            mx.eval(y)  # the next round may overwrite the slots (or scratch slabs) y read
            parts.append(pairs)
            ys.append(y.squeeze(1))
        if whole is not None:
            return whole
        order = np.argsort(np.concatenate(parts))  # each pair in exactly one round
        return mx.concatenate(ys)[mx.array(order)].reshape(*idx.shape, x.shape[-1])

    def _on(self, slabs: dict[str, mx.array]) -> nn.Module:
        """The expert block over ``slabs`` (name on disk -> a scratch slab) instead of the
        cache's: shallow copies of the block and of its leaves that hold them, made once
        for the same scratch slabs (the two halves rounds alternate: known by identity,
        the blocks hold them)."""
        held = getattr(self, "_wide_blocks", [])
        for arrays, block in held:
            if len(arrays) == len(slabs) and all(a is b for a, b in zip(arrays, slabs.values())):
                return block
        block = copy.copy(self._inner)
        names = {id(child): name for name, child in self._inner.children().items() if isinstance(child, nn.Module)}
        leaves = {}
        for name, t in self._cache.tensors.items():
            child = names[id(t.module)]
            leaf = leaves.setdefault(child, copy.copy(t.module))
            leaf[t.attr] = slabs[name]
        for child, leaf in leaves.items():
            block[child] = leaf
        # Not a parameter nor a child; the two latest (scratch made anew after a cast replaces them).
        object.__setattr__(self, "_wide_blocks", [*held[-1:], (tuple(slabs.values()), block)])
        return block


def expert_tensors(path: str, block: nn.Module, index: dict, model_dir: Path) -> tuple[int, dict]:
    """The stacked expert tensors of one expert block as cache slabs
    (:func:`mlx_tier.engine.checkpoint.expert_tensors`), in the dtypes mlx-lm
    gives them at load (as stored, unless its ``sanitize`` cast one).

    Args:
        path: the block's parameter path (``model.layers.3.mlp.switch_mlp``).
        index: tensor name -> TensorInfo of the checkpoint.

    Returns:
        ``(E, {name on disk: SlabTensor})``.
    Raises:
        CheckpointError: as :func:`mlx_tier.engine.checkpoint.expert_tensors`, or an
            nvfp4 global scale on the CPU.
    """
    num_experts, stored = _stored_expert_tensors(path, block, index, model_dir)
    tensors = {}
    for name, t in stored.items():
        if t.attr == "global_scale" and mx.default_device() == mx.cpu:
            raise CheckpointError(
                f"{path}: nvfp4 experts with a per-expert global scale need a GPU "
                "(MLX's CPU backend cannot run them)"
            )
        slab = SlabTensor(t.leaf, t.attr, t.info)
        tensors[name] = slab if t.array.dtype == slab.dtype else slab.cast_to(t.array.dtype)
    return num_experts, tensors


def _check_computable(model_dir: Path, found: list) -> None:
    """Refuse unquantized experts in a dtype MLX cannot run here, naming the fix.

    Args:
        found: ``(path, block, E, tensors)`` per MoE layer, dtypes as they will run.
    Raises:
        ConfigError: e.g. bf16 experts on MLX's CPU backend (``mlx_lm.load``'s
            model fails there too, at its first token).
    """
    for *_, tensors in found:
        for t in tensors.values():
            if t.attr == "weight" and mx.issubdtype(t.dtype, mx.floating) and not gather_mm_computes(t.dtype):
                name, where = str(t.dtype).removeprefix("mlx.core."), "CPU" if mx.default_device() == mx.cpu else "GPU"
                raise ConfigError(f"{model_dir}: its unquantized experts are {name}, which MLX's {where} backend "
                                  "cannot compute (mlx_lm.load's model fails the same way): load with "
                                  "TierConfig(dtype=mx.float32)", "dtype")


def plan_slots(budget_bytes: int, num_layers: int, slot_nbytes: int, num_experts: int) -> int:
    """Slots per layer that fit ``budget_bytes``, at most E.

    Raises:
        BudgetError: the budget holds less than one slot per layer.
    """
    per_slot_row = num_layers * slot_nbytes  # one slot in every layer
    slots = min(num_experts, budget_bytes // per_slot_row)
    if slots < 1:
        need = per_slot_row / GIB
        raise BudgetError(
            f"cache budget {budget_bytes / GIB:.3g} GiB is too small: one expert slot per "  # .3g: not "0.000"
            f"MoE layer needs {need:.3g} GiB ({num_layers} layers x {slot_nbytes / 2**20:.2f} MiB)", "cache_gb"
        )
    return int(slots)


def _profile_for(config: TierConfig, model_dir: Path, num_layers: int, num_experts: int):
    """The profile ``config`` needs (pinned, pre-warm, adaptive split), else ``None``.

    Raises:
        ProfileError: needed but none saved, unreadable, or of another shape.
        ValueError: an unknown ``split``.
    """
    if config.split not in ("uniform", "adaptive"):
        raise ValueError(f"split must be 'uniform' or 'adaptive', got {config.split!r}")
    wants = {f"policy {config.policy.name!r}": config.policy.needs_profile, "pre-warm": bool(config.prewarm),
             "the adaptive split": config.split == "adaptive" and config.layer_slots is None}
    needed = [why for why, yes in wants.items() if yes]
    if not needed:
        return None
    profile = load_for(model_dir, num_layers, num_experts, config.profile)
    if profile is None:
        raise ProfileError(
            f"{model_dir}: {' and '.join(needed)} need{'s' if len(needed) == 1 else ''} a saved frequency profile "
            f"and none was found ({PROFILE_FILE} next to the checkpoint, or in the user cache dir); {HOW_TO_MAKE}"
        )
    return profile


def _layer_slot_counts(config: TierConfig, profile, slots: int, total: int, experts: list[int]) -> tuple[int, ...]:
    """Slots of each layer: ``config.layer_slots``, an adaptive split of
    ``total`` slots (``slots`` x L when ``slots_per_layer`` is set), or ``slots``
    everywhere; each capped at the layer's experts.

    Raises:
        BudgetError: ``layer_slots`` of the wrong length or outside [1, E].
    """
    L = len(experts)
    if config.layer_slots is not None:
        per = tuple(int(n) for n in config.layer_slots)
        if len(per) != L or not all(1 <= n <= e for n, e in zip(per, experts)):
            raise BudgetError(f"layer_slots must give each of the {L} MoE layers 1 to {max(experts)} slots, "
                              f"got {per}", "layer_slots")
        return per
    if config.split == "adaptive":
        total = slots * L if config.slots_per_layer is not None else total
        return tuple(min(n, e) for n, e in zip(adaptive_slots(profile, total), experts))
    return tuple(min(slots, e) for e in experts)


def _wrap_blocks(model: nn.Module, model_dir: Path, found: list, config: TierConfig, kernel_name: str, dtype,
                 two_tiers: bool) -> list[TieredExperts]:
    """Put a :class:`TieredExperts` (no cache yet) in place of each expert block,
    cast the model to ``dtype`` (``None``: no cast), then evaluate the dense part:
    the hidden blocks' stacked experts are never read.

    Args:
        found: ``(path, block, E, tensors)`` per MoE layer; each ``tensors``
            (name on disk -> SlabTensor) is updated with the cast.
    Raises:
        ConfigError: experts MLX cannot compute here (:func:`_check_computable`),
            before anything is read.
    """
    kernel, remap = kernels.kernel_for(kernel_name), kernels.remap_for(kernel_name)
    wrappers = []
    for path, block, _, tensors in found:
        wrappers.append(TieredExperts(block, None, kernel, remap))
        set_child(model, path, wrappers[-1])
        wrappers[-1].show(path, tensors)
    if dtype is not None:
        cast_model(model, dtype)  # the dense part and the experts' stand-ins
        for wrapper, (_, _, _, tensors) in zip(wrappers, found):
            changed = wrapper._stand_ins.changed(wrapper, tensors)
            tensors.update({name: tensors[name].cast_to(d) for name, d in changed.items()})
    _check_computable(model_dir, found)
    mx.eval(model.parameters())
    if config.dense_kernel and kernel_name == "cpu" and not two_tiers:  # with two tiers: the warm tier's kernel
        from mlx_tier.kernels.cpu_dense import serve_dense

        serve_dense(model, float_layers=mx.default_device() == mx.cpu)  # a GPU's float matmul is its own
    if config.attention_kernel and kernel_name == "cpu" and mx.default_device() == mx.cpu:
        from mlx_tier.kernels.cpu_attention import serve_attention

        serve_attention(model)
    return wrappers


def _budgets(config: TierConfig, two_tiers: bool, slot_nbytes: int, num_layers: int,
             num_experts: int) -> tuple[int, int, int | None]:
    """``(hot budget, slots per layer, warm budget)`` in bytes: explicit slots fix
    the hot budget, else it comes from ``cache_gb`` or the free memory where
    the tier lives, measured now (after the dense part is loaded:
    :mod:`mlx_tier.engine.budgets`). Slots are 0 with ``layer_slots`` (counted
    per layer), the warm budget ``None`` for one tier.

    Raises:
        BudgetError: slots outside [1, E], a budget below one slot per layer,
            or budgets that do not fit (:func:`mlx_tier.engine.budgets.tier_budgets`).
        ConfigError: a negative or non-finite budget.
    """
    budget, slots = None, 0
    if config.layer_slots is not None:
        budget = sum(config.layer_slots) * slot_nbytes
    elif config.slots_per_layer is not None:
        slots = config.slots_per_layer
        if not 1 <= slots <= num_experts:
            raise BudgetError(f"slots per layer must be in [1, {num_experts}], got {slots}", "slots_per_layer")
        budget = slots * slot_nbytes * num_layers
    budgets = tier_budgets.tier_budgets(config.cache_gb if budget is None else budget / GIB,
                                        config.host_cache_gb if two_tiers else None, tier_budgets.probe())
    if budget is None:
        budget = budgets.hot
        slots = plan_slots(budget, num_layers, slot_nbytes, num_experts)
    return budget, slots, budgets.warm


def _layer_caches(found: list, wrappers: list[TieredExperts], per_layer: tuple[int, ...], store: ExpertStore,
                  policy: PolicySpec) -> tuple[list[LayerCache], CacheStats]:
    """One :class:`LayerCache` per MoE layer (``found``: ``(path, block, E, tensors)``),
    each handed to its wrapper; their shared counters."""
    stats = CacheStats()
    layers = []
    for i, ((_, _, n, tensors), wrapper) in enumerate(zip(found, wrappers)):
        layers.append(LayerCache(i, tensors, n, per_layer[i], store, stats, policy))
        wrapper._cache = layers[-1]
    return layers, stats


def tier_model(model: nn.Module, model_dir: Path, config: TierConfig, index: dict | None = None) -> ExpertCache:
    """Replace every expert block of an mlx-lm model (built lazily) with a tiered one.

    Evaluates the dense part. Returns the model's ExpertCache, also set as
    ``model.expert_cache``. ``index``: the checkpoint's tensors
    (:func:`mlx_tier.engine.checkpoint.index_checkpoint`; read when ``None``).

    Raises:
        CheckpointError: no expert block, or experts not stored stacked.
        BudgetError: budget below one slot per layer; bad ``layer_slots``;
            budgets that do not fit their memory (:mod:`mlx_tier.engine.budgets`).
        ConfigError: a negative or non-finite ``cache_gb``/``host_cache_gb``;
            unquantized experts in a dtype MLX cannot compute here (bf16/fp16
            on the CPU backend: pass ``dtype=mx.float32``).
        ProfileError: pinned, pre-warm or the adaptive split without a
            fitting saved profile (:mod:`mlx_tier.routing.profile`).
    """
    blocks = moe_blocks(model, model_dir)
    if not config.policy.live:
        raise ConfigError(f"policy {config.policy.name!r} needs the future: use it in trace simulation "
                          "(mlx_tier.routing.simulate), not live", "policy")
    store = ExpertStore(model_dir, threads=config.read_threads, read_method=config.read_method,
                         page_cache=config.page_cache, index=index)
    found = [(path, block, *expert_tensors(path, block, store.index, model_dir)) for path, block in blocks]
    experts = [n for _, _, n, _ in found]
    profile = _profile_for(config, model_dir, len(found), max(experts))
    # Hide the blocks (and their lazily loaded stacked arrays, never evaluated)
    # before touching the parameters, so that only the dense part is read.
    two_tiers = tier_budgets.two_tiers(config.host_cache_gb, tier_budgets.backend_of())  # always on CUDA
    kernel_name = kernels.choose(config.kernel or LIBRARY_KERNEL, [b for _, b in blocks], two_tiers)
    dtype = compute_dtype(config.dtype, kernel_name, two_tiers)
    wrappers = _wrap_blocks(model, model_dir, found, config, kernel_name, dtype, two_tiers)
    slot_nbytes = max(sum(t.slot_nbytes() for t in tensors.values()) for *_, tensors in found)
    budget, slots, warm_budget = _budgets(config, two_tiers, slot_nbytes, len(found), max(experts))
    per_layer = _layer_slot_counts(config, profile, slots, budget // slot_nbytes, experts)
    in_slots = config.layer_slots is not None or config.slots_per_layer is not None  # else a byte budget
    policy = replace(config.policy, profile=profile) if config.policy.needs_profile else config.policy
    layers, stats = _layer_caches(found, wrappers, per_layer, store, policy)
    if two_tiers:  # the CUDA path: hot slabs + a warm host tier
        from mlx_tier.engine.two_tier import build_two_tier

        parents = [module_at(model, path.rpartition(".")[0]) for path, _ in blocks]
        expert_cache = build_two_tier(blocks, parents, layers, (budget, warm_budget, in_slots), store, config,
                                      kernels.kernel_for("cpu") if kernel_name == "cpu" else None,
                                      lambda path, m: set_child(model, path, m))
    else:
        reader = BackgroundReader() if config.prefetch or config.read_ahead else None
        for layer in layers if config.read_ahead else []:
            layer.reader = reader
        if config.prefetch:
            parents = [module_at(model, path.rpartition(".")[0]) for path, _ in blocks]
            links = link_layers(parents, [b for _, b in blocks], layers, reader)
            for wrapper, link in zip(wrappers, links):
                wrapper._prefetch = link
        expert_cache = ExpertCache(layers, stats, budget, store, budget_in_slots=in_slots)
        if kernel_name == "cpu":  # an eager host kernel: wide rounds from scratch slabs
            for layer in layers:
                layer.width = min(layer.num_experts, max(layer.num_slots, defaults.ROUND_EXPERTS))
    if config.prewarm or (config.prewarm is None and policy.needs_profile):
        expert_cache.prewarm(profile)
    # What computes the experts (mlx_tier.kernels.registry), for reports; with two tiers,
    # the warm tier's kernel (the hot tier runs MLX's ops). The cast made at load, likewise.
    expert_cache.kernel = kernel_name
    expert_cache.dtype_name = dtype_name(dtype)
    model.expert_cache = expert_cache
    return expert_cache


def load(path, cache_gb: float | None = None, *, config: TierConfig | None = None):
    """Load an mlx-lm MoE checkpoint with its experts tiered.

    Args:
        path: checkpoint directory in mlx-lm format (``config.json``, safetensors
            shards with stacked experts, tokenizer files), or a Hugging Face
            repo id as ``mlx_lm.load`` takes it (local cache first, downloaded
            when missing; :func:`mlx_tier.engine.hub.resolve_model`).
        cache_gb: expert cache budget in GiB (on CUDA the GPU's hot tier), as
            ``mlx_lm.load``'s callers like it; ``None``: ``config.cache_gb``
            (``None`` there too: half of the memory free after the dense part
            is loaded; on CUDA, of free GPU memory).
        config: further settings (:class:`TierConfig`).

    Returns:
        ``(model, tokenizer)`` exactly as ``mlx_lm.load`` returns them, with each
        expert block replaced by :class:`TieredExperts`; ``model.expert_cache``
        is the :class:`~mlx_tier.engine.expert_cache.ExpertCache` (counters in ``.stats``).
        Its dtypes are ``mlx_lm.load``'s unless ``config.dtype`` casts them
        (:class:`TierConfig`); a later cast, or ``copy.deepcopy``, works as on
        mlx-lm's model.

    Raises:
        CheckpointError: a bad checkpoint folder (:mod:`mlx_tier.engine.checkpoint`:
            missing config or shards, a truncated or corrupt file, an unknown
            model type), or not an MoE checkpoint; a repo id not cached while
            offline, or not downloadable.
        BudgetError: budget too small for one expert slot per MoE layer.
        ConfigError: unquantized experts in a dtype MLX cannot compute here
            (bf16/fp16 on the CPU backend, where ``mlx_lm.load``'s model fails
            at its first token: pass ``TierConfig(dtype=mx.float32)``).
    """
    from mlx_tier.engine.hub import resolve_model

    path = resolve_model(path)
    ckpt = open_checkpoint(path)
    config = config or TierConfig()
    if cache_gb is not None:
        config = replace(config, cache_gb=cache_gb)
    tier_model(ckpt.model, path, config, ckpt.index)
    tokenizer = load_tokenizer(path, eos_token_ids=ckpt.config.get("eos_token_id"))
    return ckpt.model, tokenizer


def cache_stats(model: nn.Module) -> CacheStats:
    """The live counters of a model returned by :func:`load`."""
    return model.expert_cache.stats
