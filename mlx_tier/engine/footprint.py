"""What a run holds in memory beside its expert cache, and one total split into its parts.

A run's resident memory, in bytes::

    runtime    Python, MLX, mlx-lm, the tokenizer, the CPU kernel's compiled loops
    dense      the dense part (attention, embeddings, norms, routers) in the compute dtype
    cache      the expert slabs (the budget ``cache_gb`` sets)
    kv         the KV cache of the sequences in flight
    workspace  the step being computed: activations, attention scores, the
               expert kernel's rows and tiles, expert read buffers
    buffers    freed buffers MLX keeps for reuse (its cache limit, set by
               :mod:`mlx_tier.engine.memory` for the job)
    margin     what no figure above names (allocator slack, page tables,
               the file pages the cold tier's reads go through)

:func:`split` takes one total (``--memory-gb``, else the memory this process
may use: :mod:`mlx_tier.engine.limits`) and gives each part its share; a total
that cannot hold the fixed parts, one slot per MoE layer and one sequence is
refused with the figures (:class:`~mlx_tier.errors.BudgetError`). The workspace
of a step is a shape formula (:func:`step_workspace`) whose factors were
measured (``benches/workspace.py``, benches/results/memory/NOTES.md).

Plain arithmetic over :class:`ModelShape` and byte counts: no MLX here.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_tier.defaults import KV_BITS, KV_GROUP_SIZE, ROUND_EXPERTS
from mlx_tier.errors import BudgetError, ConfigError
from mlx_tier.units import GIB, MIB

# The process before its model (Python, MLX, mlx-lm, transformers' tokenizer, Numba
# and the CPU kernel's compiled loops) and the tokenizer loaded: measured peak RSS
# of a run minus its model's parts (benches/results/memory/NOTES.md).
RUNTIME_BYTES = 400 * MIB
# Kept free of every named part: a share of the total, at least MARGIN_MIN.
MARGIN_FRACTION = 0.08
MARGIN_MIN = 128 * MIB
# Of what the fixed parts leave, the expert cache's default share; the rest is
# for the KV cache of the batch (the one-memory default of mlx_tier.engine.budgets).
CACHE_SHARE = 0.5
# The prompt step's workspace is kept within this share of what the fixed parts leave.
WORKSPACE_SHARE = 0.25
# Fewest tokens one sequence must be able to hold for a run to start.
MIN_SEQUENCE_TOKENS = 512
# Smallest prompt step (tokens) the memory rule chooses.
MIN_PROMPT_STEP = 16
# Workers of the kernel and of the cold tier's reads, for the per-step constants.
KERNEL_THREADS = 2
READ_THREADS = 4
DENSE_TILE_BYTES = 8 << 20  # as mlx_tier.kernels.cpu_dense tiles a dense layer (that module loads Numba)


@dataclass(frozen=True)
class ModelShape:
    """The sizes a step's memory follows.

    Attributes:
        hidden: D, the residual width.
        expert_inner: I, an expert's inner width.
        top_k: experts per token.
        experts: E, experts per MoE layer.
        heads / kv_heads / head_dim: attention.
        layers: decoder layers (all hold a KV cache).
        vocab: output rows (the logits of a decode step).
        kv_itemsize: bytes of a cached key or value element (4 on the CPU backend;
            a quantized cache's: :func:`kv_element_bytes`).
    """

    hidden: int
    expert_inner: int
    top_k: int
    experts: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    kv_itemsize: float = 4

    @classmethod
    def of_config(cls, config: dict, expert_inner: int, top_k: int, experts: int, kv_itemsize: float = 4):
        """From a checkpoint's ``config.json`` and its expert sizes (the config's names vary by model)."""
        heads = int(config.get("num_attention_heads") or 1)
        hidden = int(config.get("hidden_size") or 0)
        return cls(hidden, int(expert_inner), int(top_k), int(experts), heads,
                   int(config.get("num_key_value_heads") or heads),
                   head_dim_of(config), int(config.get("num_hidden_layers") or 0),
                   int(config.get("vocab_size") or 0), kv_itemsize)

    @property
    def kv_per_token(self) -> int:
        """KV-cache bytes per token of one sequence (standard attention: an upper bound)."""
        return int(2 * self.layers * self.kv_heads * self.head_dim * self.kv_itemsize)

    def __str__(self) -> str:
        return (f"D {self.hidden}, experts {self.experts} x I {self.expert_inner} top-{self.top_k}, "
                f"heads {self.heads}/{self.kv_heads}x{self.head_dim}, {self.layers} layers, vocab {self.vocab}")


def kv_element_bytes(bits: int | None, itemsize: float = 4, group_size: int = KV_GROUP_SIZE) -> float:
    """Bytes of one cached key or value element: ``itemsize`` unquantized (``bits`` None),
    else its code plus its share of its group's scale and bias (each ``itemsize``):
    ``bits / 8 + 2 x itemsize / group_size`` (8 bits, float32, groups of 64: 1.125)."""
    return itemsize if bits is None else bits / 8 + 2 * itemsize / group_size


def read_ahead_bytes(cache: int, shape: ModelShape, kernel: str = "mlx", expert: int = 0) -> int:
    """Bytes of a layer's next round of experts, read while a round computes
    (:attr:`mlx_tier.engine.load.TierConfig.read_ahead`): one layer's slots, about the
    cache over the model's layers (exact when every layer has experts; a model with
    dense layers holds a little more). With the CPU kernel a round holds
    :data:`~mlx_tier.defaults.ROUND_EXPERTS` experts when the slots are fewer
    (:attr:`mlx_tier.engine.cache.LayerCache.width`): the two scratch halves consecutive
    rounds alternate (the next round is read into one while this one computes from the
    other) and a read that cannot go there, three times that many of ``expert`` (one
    expert's resident bytes) then."""
    ahead = cache // max(1, shape.layers)
    return max(ahead, 3 * ROUND_EXPERTS * expert) if kernel == "cpu" else ahead


def check_kv_bits(bits: int | None, head_dim: int | None = None, group_size: int = KV_GROUP_SIZE) -> None:
    """Whether a KV cache can be quantized to ``bits`` (``None``: not quantized, always).

    Raises:
        ConfigError: ``bits`` not in :data:`~mlx_tier.defaults.KV_BITS`, or a head dim that
            the group size does not divide (``field``: ``kv_bits``).
    """
    if bits is None:
        return
    if bits not in KV_BITS:
        raise ConfigError(f"`kv_bits` must be one of {', '.join(map(str, KV_BITS))}, got {bits}", "kv_bits")
    if head_dim is not None and head_dim % group_size:
        raise ConfigError(f"this model's head dim of {head_dim} is not a multiple of the KV group size "
                          f"{group_size}: its KV cache cannot be quantized (`kv_bits`)", "kv_bits")


def head_dim_of(config: dict) -> int:
    """A checkpoint's attention head dim from its ``config.json`` (``head_dim``, else
    ``hidden_size / num_attention_heads``)."""
    heads = int(config.get("num_attention_heads") or 1)
    return int(config.get("head_dim") or (int(config.get("hidden_size") or 0) // heads))


# Measured over the shape terms (benches/workspace.py): peak RSS of a step beyond
# what was resident before it and the KV it added, / the terms below.
WORKSPACE_FACTOR = {"cpu": 1.3, "mlx": 1.3}


def _row_bytes(s: ModelShape, context: int) -> int:
    """float32 bytes one token of a step holds at once (its layer's activations)."""
    attention = (2 * s.heads + 2 * s.kv_heads) * s.head_dim + 2 * s.heads * context  # q, out, k, v; scores, softmax
    experts = s.top_k * (3 * s.expert_inner + 2 * s.hidden)  # each pair: gate, up, glu, out, out copied back
    return 4 * (8 * s.hidden + 2 * s.experts + attention + experts)


def step_workspace(shape: ModelShape, kernel: str, tokens: int, context: int, batch: int = 1) -> int:
    """Bytes a step holds beyond the resident model and the KV cache it grows.

    Args:
        shape: the model's sizes.
        kernel: ``"cpu"`` or ``"mlx"`` (the expert kernel; others count as ``"mlx"``).
        tokens: rows of the step: prompt tokens of a prompt step, or the batch of
            a decode step (one token per sequence).
        context: tokens each row attends to (the longest sequence's length after the step).
        batch: sequences of a decode step (their logits are evaluated); 1 for a prompt step.

    Returns:
        bytes: the shape terms times the measured :data:`WORKSPACE_FACTOR`, plus
        the per-step constants (dequantised tiles of the kernel's threads, read
        buffers of the cold tier).
    """
    s = shape
    rows = tokens * _row_bytes(s, context)
    logits = 3 * batch * s.vocab * 4 if tokens == batch else 0  # a decode step: logits, log-probs, sampling
    # the CPU kernel's threads each dequantise at most one expert, or a tile of a dense layer (mlx_tier.kernels.cpu)
    tiles = KERNEL_THREADS * max(s.expert_inner * s.hidden * 4, DENSE_TILE_BYTES) if kernel == "cpu" else 0
    reads = READ_THREADS * 3 * s.expert_inner * s.hidden
    return int(WORKSPACE_FACTOR.get(kernel, WORKSPACE_FACTOR["mlx"]) * (rows + logits) + tiles + reads)


# MLX's buffer cache (freed buffers kept for reuse) within a total: this share of
# it, between these bounds (mlx_tier.engine.memory sets the limit for the job).
BUFFERS_FRACTION = 0.05
BUFFERS_MIN = 32 * MIB
BUFFERS_MAX = 256 * MIB
# Rows mlx-lm allocates a KV cache by (its KVCache.step): a sequence may hold this many more.
KV_STEP = 256
# The throughput schedule's decode steps borrow a prompt step's idle workspace as expert
# slots (MemoryBudget.decode_slots, mlx_tier.job.pool_engine); benches/throughput.py turns
# it off to measure what it buys.
LEND_SLOTS = True
# ... and the KV room no sequence in flight holds (mlx_tier.job.scheduler.Scheduler._lend_idle_kv);
# benches/throughput.py turns it off to measure what it buys.
LEND_KV_ROOM = True
# Most sequences a decode step may hold (mlx_tier.job.batch_engine.MAX_AUTO_BATCH): its workspace is reserved.
DECODE_BATCH = 8


@dataclass(frozen=True)
class Needs:
    """What a run of one checkpoint holds beside its expert cache, known before loading.

    Attributes (bytes unless stated):
        dense: the dense part, resident in the compute dtype.
        slot_row: one expert slot in every MoE layer (the least cache a run takes).
        all_experts: every expert of every layer (a larger cache is never used).
        shape: the sizes a step's workspace and the KV cache follow.
        kernel: the expert kernel the run uses (``"cpu"``, ``"mlx"``, ``"metal"``).
        runtime: the process without its model (:data:`RUNTIME_BYTES`).
        expert: one expert's resident bytes (the largest layer's); 0: unknown (the
            CPU kernel's wide rounds then not counted: :func:`read_ahead_bytes`).
        experts_on_disk: every expert of every layer as stored (what the page cache
            would have to keep); 0: unknown.
    """

    dense: int
    slot_row: int
    all_experts: int
    shape: ModelShape
    kernel: str
    runtime: int = RUNTIME_BYTES
    expert: int = 0
    experts_on_disk: int = 0


@dataclass(frozen=True)
class MemoryBudget:
    """One total split into the parts of a run (bytes), and the prompt step that fits.

    Attributes:
        total: what the run may hold in all.
        source: where ``total`` came from (``"memory_gb"`` or the limit's description).
        runtime, dense, cache, kv, workspace, buffers, margin: the parts
            (module doc); ``kv`` is what sequences in flight may hold; ``workspace``
            holds a step's and :func:`read_ahead_bytes`.
        prefill_step: most prompt tokens a step reads (its workspace fits ``workspace``).
        cache_given: ``cache`` was set (``cache_gb``), not derived.
        shape, kernel: what the workspace follows (:meth:`prompt_step`).
        slot_row: one expert slot in every MoE layer (the cache's unit), 0 when unknown.
        expert: one expert's resident bytes (:attr:`Needs.expert`), 0 when unknown.
        experts_on_disk: every expert of every layer as stored (:attr:`Needs.experts_on_disk`),
            0 when unknown.
    """

    total: int
    source: str
    runtime: int
    dense: int
    cache: int
    kv: int
    workspace: int
    buffers: int
    margin: int
    prefill_step: int
    cache_given: bool = False
    shape: ModelShape | None = None
    kernel: str = "mlx"
    slot_row: int = 0
    expert: int = 0
    experts_on_disk: int = 0

    def prompt_step(self, done: int) -> int:
        """Most tokens the next step of a prompt may read, ``done`` tokens into it: at most
        :attr:`prefill_step`, fewer as the prompt's attention grows, its workspace within
        :attr:`workspace` (at least :data:`MIN_PROMPT_STEP`)."""
        if self.shape is None:
            return self.prefill_step
        step_room = self.workspace - read_ahead_bytes(self.cache, self.shape, self.kernel, self.expert)
        return prompt_step_for(self.shape, self.kernel, step_room, self.prefill_step, done)

    def decode_slots(self, batch: int, context: int) -> int:
        """Expert slots per layer a decode step of ``batch`` sequences (``context`` tokens
        each at most) can borrow from :attr:`workspace`: what a prompt step's workspace
        holds beyond the decode step's own and the read ahead of the grown cache
        (:func:`read_ahead_bytes`), in whole slot rows (:attr:`slot_row`); 0 when the
        shape or the slot row is unknown. Not capped at a layer's experts
        (:func:`mlx_tier.tools.pool_cache.lent_slots` is)."""
        if self.shape is None or self.slot_row <= 0:
            return 0
        step = step_workspace(self.shape, self.kernel, batch, context, batch)
        n = 0
        while (n + 1) * self.slot_row + step + read_ahead_bytes(
                self.cache + (n + 1) * self.slot_row, self.shape, self.kernel, self.expert) <= self.workspace:
            n += 1
        return n

    def parts(self) -> dict[str, int]:
        """The parts by name, in the order a run holds them; they sum to ``total``."""
        return {"runtime": self.runtime, "dense part": self.dense, "experts": self.cache, "KV": self.kv,
                "workspace": self.workspace, "MLX buffers": self.buffers, "margin": self.margin}

    def describe(self) -> str:
        """One line: ``"2.00 GiB (cgroup v1 memory.limit_in_bytes) = runtime 0.47 + ... GiB"``."""
        parts = " + ".join(f"{name} {v / GIB:.2f}" for name, v in self.parts().items())
        return f"{self.total / GIB:.2f} GiB ({named(self.source)}) = {parts} GiB"

    def as_dict(self) -> dict:
        return {"total": self.total, "source": self.source, **{k.replace(" ", "_"): v for k, v in self.parts().items()},
                "prefill_step": self.prefill_step}


def named(source: str) -> str:
    """A total's source for messages: the setting ``memory_gb`` as `memory_gb` (the CLI shows
    its flag), a limit as it is."""
    return "`memory_gb`" if source == "memory_gb" else source


def margin_for(total: int) -> int:
    """Bytes kept free of every named part of ``total``."""
    return max(MARGIN_MIN, int(total * MARGIN_FRACTION))


def buffers_for(total: int) -> int:
    """MLX's buffer cache limit within ``total`` (bytes)."""
    return min(BUFFERS_MAX, max(BUFFERS_MIN, int(total * BUFFERS_FRACTION)))


def prompt_step_for(shape: ModelShape, kernel: str, room: int, most: int, context: int = 0) -> int:
    """Most prompt tokens (at most ``most``, at least :data:`MIN_PROMPT_STEP`) whose step,
    ``context`` tokens into the prompt, has a workspace within ``room`` bytes."""
    step = max(1, most)
    while step > MIN_PROMPT_STEP and step_workspace(shape, kernel, step, context + step) > room:
        step = max(MIN_PROMPT_STEP, step * 3 // 4)
    return step


def default_cache(room: int, needs: Needs) -> int:
    """The expert cache's default bytes out of ``room`` (what the fixed parts and the workspace
    leave): :data:`CACHE_SHARE` of it, or enough for one token's top-k experts in every layer
    when the KV cache of one shortest sequence still fits beside that (fewer slots than
    top-k serve each token in rounds); whole slot rows, at least one, at most every expert,
    and no more than leave that sequence room beside their read-ahead workspace
    (:func:`read_ahead_bytes`)."""
    if not needs.slot_row:
        return 0

    def fits(rows: int) -> bool:  # beside the read-ahead workspace it brings and one shortest sequence
        cache = rows * needs.slot_row
        return cache + read_ahead_bytes(cache, needs.shape, needs.kernel, needs.expert) <= room - min_kv(needs.shape)

    rows = int(room * CACHE_SHARE) // needs.slot_row
    top_k = min(needs.shape.top_k, needs.shape.experts)
    if rows < top_k and fits(top_k):
        rows = top_k
    while rows > 1 and not fits(rows):  # a larger total never gets a split refused where a smaller one fits
        rows -= 1
    return min(needs.all_experts, max(1, rows) * needs.slot_row)


def min_kv(shape: ModelShape) -> int:
    """KV bytes of the shortest sequence a run must hold (:data:`MIN_SEQUENCE_TOKENS` + one allocation step)."""
    return shape.kv_per_token * (MIN_SEQUENCE_TOKENS + KV_STEP)


def split(total: int, needs: Needs, cache: int | None = None, prefill_step: int = 512,
          source: str = "memory_gb") -> MemoryBudget:
    """Split ``total`` bytes into a run's parts (module doc).

    The fixed parts come first (runtime, dense part, MLX buffers, margin), then
    the workspace of the larger of a prompt step and a decode step of
    :data:`DECODE_BATCH` sequences; the prompt step shrinks (to
    :data:`MIN_PROMPT_STEP` at least) until its workspace is within
    :data:`WORKSPACE_SHARE` of what the fixed parts leave. Of the rest, the expert
    cache takes ``cache`` or its default (:func:`default_cache`), the KV cache
    what is left after :func:`read_ahead_bytes` more workspace.

    Args:
        total: bytes the run may hold.
        needs: what it holds beside the cache (:class:`Needs`).
        cache: the expert cache's bytes when set (``cache_gb``; at most every expert's),
            else ``None``.
        prefill_step: the prompt step asked for (tokens).
        source: where ``total`` came from, for messages.

    Raises:
        BudgetError: the total cannot hold the fixed parts, the workspace, one
            slot per MoE layer (or the ``cache`` given) and one sequence of
            :data:`MIN_SEQUENCE_TOKENS` tokens; the message names every figure
            (``field``: ``cache_gb`` when a given cache is what does not fit, else ``memory_gb``).
    """
    given = cache is not None
    s, fixed_parts = needs.shape, (needs.runtime, needs.dense, buffers_for(total), margin_for(total))
    room = total - sum(fixed_parts)
    step = prompt_step_for(s, needs.kernel, max(0, int(room * WORKSPACE_SHARE)), prefill_step)
    workspace = max(step_workspace(s, needs.kernel, step, step),
                    step_workspace(s, needs.kernel, DECODE_BATCH, MIN_SEQUENCE_TOKENS, DECODE_BATCH))
    room -= workspace
    if cache is None:
        cache = default_cache(room, needs)
    elif needs.all_experts > 0:  # more than every expert is never used: the rest goes to the KV cache
        cache = min(cache, needs.all_experts)
    ahead = read_ahead_bytes(cache, s, needs.kernel, needs.expert)
    kv = room - cache - ahead
    budget = MemoryBudget(total, source, needs.runtime, needs.dense, cache, kv, workspace + ahead, fixed_parts[2],
                          fixed_parts[3], step, given, s, needs.kernel, needs.slot_row, needs.expert,
                          needs.experts_on_disk)
    if cache < needs.slot_row:
        raise BudgetError(f"`cache_gb` {cache / GIB:.3g} GiB is too small: one expert slot per MoE layer needs "
                          f"{needs.slot_row / GIB:.3g} GiB", "cache_gb")  # .3g: 0.0001 GiB is not "0.000"
    if kv < min_kv(s):
        raise _does_not_fit(budget, needs)
    return budget


def _does_not_fit(b: MemoryBudget, needs: Needs) -> BudgetError:
    """The refusal of a split that does not fit, every figure named (GiB)."""
    besides = {"runtime": b.runtime, "dense part": b.dense, "workspace": b.workspace, "MLX buffers": b.buffers,
               "margin": b.margin, f"KV of one {MIN_SEQUENCE_TOKENS}-token sequence": min_kv(needs.shape)}
    listed = " + ".join(f"{name} {v / GIB:.2f}" for name, v in besides.items())
    need = sum(besides.values())
    where = f"{b.total / GIB:.2f} GiB ({named(b.source)})"
    if b.cache_given:
        return BudgetError(f"`cache_gb` {b.cache / GIB:.2f} GiB does not fit in {where}: the run also needs "
                           f"{listed} = {need / GIB:.2f} GiB, which leaves {max(0, b.total - need) / GIB:.2f} GiB "
                           f"for the expert cache", "cache_gb")
    return BudgetError(f"{where} is too little for this model: it needs {listed} + one expert slot per MoE layer "
                       f"{needs.slot_row / GIB:.2f} = {(need + needs.slot_row) / GIB:.2f} GiB", "memory_gb")


def room_now(budget: MemoryBudget, rss: int, available: int) -> int:
    """Bytes new sequences may take now (their KV cache and prompt transients).

    The least of the budget's KV share, what the total leaves beside the
    process's resident set ``rss`` now, and what the memory limit leaves
    (``available``: :attr:`mlx_tier.engine.limits.MemoryLimit.available`); the
    last two less the step's workspace, MLX's buffers and the margin, which
    the resident set may not hold yet. Sequences in flight hold theirs in ``rss``.
    Never less than the KV cache of one shortest sequence (:func:`min_kv`), which
    the split set aside: a document that starts when memory is short is read in
    parts, not failed.
    """
    reserve = budget.workspace + budget.buffers + budget.margin
    room = min(budget.kv, budget.total - rss - reserve, available - reserve)
    return max(min_kv(budget.shape) if budget.shape is not None else 0, room)
