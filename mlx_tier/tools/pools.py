"""Pool sizes for the overnight job, from a small measured model of a layer step.

The throughput schedule (:mod:`mlx_tier.job.pool_engine`) reads prompts in
pools of many tokens and decodes many sequences together. How large? In the
spirit of MoE-Lightning's hierarchical roofline (arXiv 2411.11217) and
MoE-Gen's module batch sizes (arXiv 2503.09716), one MoE layer step of ``T``
tokens (whose average context is ``C`` tokens) costs, per layer::

    D(T)   = sum_i 1 - (1 - p_i)^T                 distinct experts routed; p_i the chance a token
                                                   routes to expert i (sum k): measured, or k/E
                                                   (uniform routing: the pessimistic case)
    H(T)   = the same sum over the S most used experts    resident ones (the eviction policy keeps
                                                   the experts used most: W-TinyLFU)
    read   = (D(T) - H(T)) * expert_bytes / disk     misses, read in rounds of S experts (the
                                                   resident ones first): each round's read
                                                   overlaps the round before's compute (read
                                                   ahead), so a step waits for max(0, read -
                                                   expert * (rounds - 1) / rounds)
    expert = D(T) * (dequant + rows * flops / gemm)      rows = T*k/D(T) >= gemm_min_rows
           | T*k * pair(rows)                           fewer rows: the loops, one pass per pair
    pair(r) = bytes / loop + (bytes / matvec - bytes / loop) / r   a slot's pass over its rows
                                                   shared by its r pairs (loop: many rows a slot;
                                                   matvec: one)
    dense  = T * dense_flops / gemm  (T >= gemm_min_rows, else T * pair(T) of the dense bytes)
    attn   = max(T * C * attn_flops / attention,     its products, or its reads of the KV caches
                 N * C * kv_bytes / L / kv_read)     (N sequences: a decode step reads all of theirs)
    fixed  = overhead + (D(T) - H(T)) * per_expert       slot writes, rounds, dispatch (measured)
    step   = fixed + read + expert + dense + attn
    head(N) = N * pair(N) of the output layer's bytes   a decode step's output layer (the logits),
              (N >= gemm_min_rows: dequant + GEMM)      one row a sequence, once a step

so the seconds per token, ``L * step(T) / T`` (a decode step of ``T``
sequences: ``(L * step(T) + head(T)) / T``), fall as ``T`` grows until the
per-token terms dominate. The prefill pool is the smallest ``T`` within
:data:`NEAR_BEST` of the best rate that memory allows, or the next size up
when that is within it too (a larger step reads each expert for more tokens,
which the model prices optimistically under a memory cap:
benches/results/throughput/NOTES.md, round 21); the decode pool the
largest number of sequences whose KV cache fits (a generated token's cost only
falls with more sequences). Predicted documents/hour follow for a given
prompt and summary length.

A prefill step also decodes the sequences generating meanwhile, in the same
layer steps (module batching, :mod:`mlx_tier.engine.module_batch`): each of
the ``read / T`` prefill steps a document's prompt takes (its share of them)
gives a token to each of the ``pool - prefill_batch`` sequences generating
beside it, a row of the prefill pool's layer steps (priced as a prompt token,
plus its attention's reads of its KV cache and its share of ``head`` over the
riding rows); a document's remaining tokens are priced at the decode pool's rate.

The model is plain arithmetic over :class:`Rates` and :class:`Shape`;
:func:`probe_rates` measures the rates on this machine in a few seconds, and
:func:`calibrate` corrects two of its guesses from one real forward call of the
model (the job's shared prefix): how the router spreads tokens (a random or
trained router is not uniform: each expert's share of the entries, so fewer
distinct experts per step, more of them resident; :func:`popularity`) and the
fixed cost per expert read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from mlx_tier.engine.footprint import KV_STEP
from mlx_tier.units import significant

# A slot used by at least this many rows in one call takes the GEMM path where the
# rows take the float32 loops (mlx_tier.kernels.cpu.GEMM_MIN_ROWS, repeated here: the
# model must not import MLX); the probe reads the layout's own (Rates.gemm_min_rows).
GEMM_MIN_ROWS = 8
# The prefill pool: the smallest pool whose rate is within this fraction of the best (or the
# next size up, within it too).
NEAR_BEST = 0.97
# The cache chooser prices each expert cache with this share less of the KV room it leaves: the
# room a run measures at its start (its resident set after load and the shared prefix) differs
# from the split's by a few percent.
ROOM_MARGIN = 0.1
# Candidate pool sizes, tokens per layer step.
POOL_CANDIDATES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Most sequences decoded together when memory allows more (prompt caches, step
# bookkeeping and the per-sequence Python work grow with it).
MAX_DECODE_POOL = 64
# popularity() measures routing only from a sample covering this much of it (Good's coverage).
MIN_COVERAGE = 0.9
# Rows a slot in the probe of the loops' rate on a prompt pool's small slots (below the GEMM's).
LOOP_PROBE_ROWS = 16
# Least seconds each of probe_rates' kernel probes runs (in repetitions, the median taken).
PROBE_SECONDS = 0.25
# Largest prompt chunk of one sequence in one step: attention scores of a chunk
# against its context are a transient of chunk x context x heads floats.
MAX_CHUNK = 1024


@dataclass(frozen=True)
class Rates:
    """This machine's rates (measured: :func:`probe_rates`).

    Attributes:
        disk_gbps: reading experts that miss the cache, GB/s.
        gemm_gflops: expert GEMM on dequantised float32 weights, GFLOP/s (all kernel threads).
        matvec_gbps: fused dequantise + matvec, GB/s of packed expert weights (a few
            pairs, one row a slot: a decode step's).
        loop_gbps: the same loops over many rows a slot (a prompt pool's experts below
            ``gemm_min_rows``: a slot's pass shared by its rows), GB/s of packed bytes a
            pair; 0: ``matvec_gbps``.
        dequant_gbps: dequantising packed expert weights to float32, GB/s of packed bytes.
        attention_gflops: attention over a KV cache (scores and weighted sum), GFLOP/s.
        kv_read_gbps: a decode step's attention (one query a sequence) over KV caches,
            GB/s of keys and values read; 0: not measured (its products' rate alone).
        overhead_s: fixed seconds per MoE layer step (dispatch, norms, router, bookkeeping).
        per_expert_s: fixed seconds per expert a layer step reads into a slot (a miss:
            its slot write, its round, its dispatch to the kernel).
        gemm_min_rows: rows of one expert (or tokens of a dense layer) from which the
            kernel dequantises and calls BLAS instead of the fused matvec (the
            layout's: 64 on the VNNI loops, 16 on them with AVX2, 8 on the float32 loops).
    """

    disk_gbps: float
    gemm_gflops: float
    matvec_gbps: float
    dequant_gbps: float
    attention_gflops: float
    # Fitted to the demo on the build machine (2 cores, loaded): prompt steps of 16 and
    # 1,024 tokens at 3/8 slots (benches/results/throughput/NOTES.md). A run fits
    # per_expert_s to its own first forward call (calibrate), at most this.
    overhead_s: float = 0.005
    per_expert_s: float = 0.003
    gemm_min_rows: int = GEMM_MIN_ROWS
    loop_gbps: float = 0.0
    kv_read_gbps: float = 0.0

    def pair_seconds(self, nbytes: float, rows: float) -> float:
        """Seconds of one (token, expert) pair of ``nbytes`` packed weights on the loops, its
        slot taking ``rows`` rows in the call: the slot's pass over its weights is shared by
        its rows (``matvec_gbps`` at one row, ``loop_gbps`` at many)."""
        loop = max(self.loop_gbps, self.matvec_gbps) * 1e9
        return nbytes / loop + (nbytes / (self.matvec_gbps * 1e9) - nbytes / loop) / max(rows, 1.0)

    def as_dict(self) -> dict:
        return {k: significant(v) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Shape:
    """What a layer step of a tiered model costs, in bytes and FLOPs.

    Attributes:
        layers: MoE layers L.
        experts: experts per layer E.
        top_k: experts per token k.
        slots: resident expert slots per layer S (``experts`` when all are resident).
        expert_bytes: one expert's packed bytes (what is read on a miss).
        expert_flops: FLOPs of one token through one expert (2 x its parameters).
        dense_bytes: packed bytes of one layer's dense matrices (attention projections).
        dense_flops: FLOPs of one token through them.
        attn_flops: attention FLOPs per token per context token in one layer (4 x heads x head dim).
        kv_bytes: KV-cache bytes per token of one sequence, all layers.
        heads: attention heads (the prefill transient's scores).
        hidden: model width D (the MoE block's transient rows of a pool).
        inner: an expert's inner width (its hidden rows).
        routed: experts the router spreads a layer's tokens over, measured
            (:func:`calibrate`); ``0.0``: all ``experts``, uniformly.
        popularity: each expert's share of a layer's routed entries, most used
            first, per layer (each sums to 1; :func:`popularity`), measured; ``()``:
            uniform over :attr:`spread`.
        read_ahead: a layer's next round of experts is read while a round computes
            (:attr:`mlx_tier.engine.load.TierConfig.read_ahead`).
        kv_read_bytes: bytes a token's keys and values take as the attention reads them,
            all layers (a quantized cache is dequantised to the compute dtype as it is
            read); ``0.0``: ``kv_bytes``.
        width: experts a round of a layer call holds when the call needs more than the
            slots (:attr:`mlx_tier.engine.cache.LayerCache.width`); ``0``: the slots.
        head_bytes: bytes of the output layer (``lm_head``, or a tied embedding; as
            stored in a checkpoint, or as loaded), which a step runs on one position a
            sequence (:func:`head_seconds`); ``0.0``: not priced.
        head_flops: FLOPs of one position through it (2 x vocabulary x hidden).
    """

    layers: int
    experts: int
    top_k: int
    slots: int
    expert_bytes: int
    expert_flops: float
    dense_bytes: int
    dense_flops: float
    attn_flops: float
    kv_bytes: float
    heads: int
    hidden: int = 0
    inner: int = 0
    routed: float = 0.0
    read_ahead: bool = True
    popularity: tuple[tuple[float, ...], ...] = ()
    kv_read_bytes: float = 0.0
    width: int = 0
    head_bytes: float = 0.0
    head_flops: float = 0.0

    @property
    def spread(self) -> float:
        """Experts a layer's tokens are routed over (``routed`` when measured)."""
        return min(float(self.experts), self.routed) if self.routed > 0 else float(self.experts)


def distinct_experts(tokens: float, experts: float, top_k: int) -> float:
    """Expected distinct experts routed by ``tokens`` tokens, uniform routing over ``experts``."""
    if experts <= top_k:
        return float(experts) if tokens > 0 else 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** max(tokens, 0.0))


def routed_split(shape: Shape, tokens: float) -> tuple[float, float]:
    """``(distinct, resident)``: expected distinct experts a layer step of ``tokens`` tokens
    routes to, and how many of them are among the ``slots`` most used (those the eviction
    policy keeps), averaged over the layers. From :attr:`Shape.popularity` when measured,
    else uniform over :attr:`Shape.spread` (a ``slots / spread`` share resident)."""
    if not shape.popularity:
        d = distinct_experts(tokens, shape.spread, shape.top_k)
        return d, d * min(1.0, shape.slots / shape.spread)
    import numpy as np

    shares = np.array(shape.popularity, np.float64)  # [L, E], each row most used first
    hit = 1.0 - (1.0 - np.minimum(1.0, shape.top_k * shares)) ** max(tokens, 0.0)
    return float(hit.sum(axis=1).mean()), float(hit[:, : shape.slots].sum(axis=1).mean())


def popularity(counts) -> tuple[tuple[float, ...], ...]:
    """Each expert's share of a layer's routed entries, most used first, per layer, from one
    call's uses ``counts`` (one row a layer: the entries routed to each of its experts; rows
    may differ in width). The experts a layer did not use share the Good-Turing estimate
    of its unseen mass (the share of entries on experts used once: Good 1953), spread over
    as many of them as Chao's estimator gives unseen (``f1 (f1 - 1) / (2 (f2 + 1))``, f1
    and f2 the experts used once and twice: Chao 1984), none above an expert seen once.
    Kept per layer (layers differ in how concentrated they are; an average by rank would
    predict more distinct experts a step), each padded with zero shares to the widest.

    Returns ``()`` (routing not measured) when nothing was routed, or when the sample
    covers less than :data:`MIN_COVERAGE` of the routing (Good's coverage, ``1 - f1 /
    entries`` over the layers): a few tokens over many experts make a uniform router
    look concentrated."""
    rows = [sorted((int(c) for c in layer), reverse=True) for layer in counts]
    rows = [r for r in rows if sum(r) > 0]
    entries = sum(sum(r) for r in rows)
    if not rows or 1 - sum(r.count(1) for r in rows) / entries < MIN_COVERAGE:
        return ()
    out = []
    for r in rows:
        total, unseen = sum(r), r.count(0)
        f1, f2 = r.count(1), r.count(2)
        spread = min(unseen, math.ceil(f1 * (f1 - 1) / (2 * (f2 + 1))))
        each = min(f1 / total / spread, 1 / (total + spread)) if spread else 0.0  # at most a seen-once expert's
        seen = [c / total * (1 - each * spread) for c in r[: len(r) - unseen]]
        out.append(sorted(seen + [each] * spread + [0.0] * (unseen - spread), reverse=True))
    width = max(len(r) for r in out)
    return tuple(tuple(r + [0.0] * (width - len(r))) for r in out)


def routed_experts(distinct: float, tokens: int, experts: int, top_k: int) -> float:
    """The ``E'`` in ``[top_k, experts]`` whose uniform routing gives ``distinct`` experts for
    ``tokens`` tokens (:func:`distinct_experts`): how widely a trained or random router
    really spreads its tokens. Bisection; ``experts`` when ``distinct`` is at least uniform's."""
    if tokens <= 0 or distinct >= distinct_experts(tokens, experts, top_k):
        return float(experts)
    lo, hi = float(top_k), float(experts)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if distinct_experts(tokens, mid, top_k) < distinct else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Observed:
    """One real forward call of the model (the shared prefix's prefill), which calibrates
    the model: ``tokens`` tokens in ``seconds`` (all layers), ``distinct`` experts per MoE
    layer (hits plus misses over the layers), ``stall_seconds`` of it waiting on reads,
    ``popularity`` its experts' shares of the entries (:func:`popularity`; ``()``: not
    measured), ``misses`` the experts it read per MoE layer (``None``: all ``distinct``),
    ``layer_seconds`` a typical MoE layer's time in it, its read stalls excluded (``None``:
    ``seconds`` less ``stall_seconds`` over the layers; a first call's total also holds
    one-time costs: compilation, allocation)."""

    tokens: int
    seconds: float
    distinct: float
    stall_seconds: float = 0.0
    popularity: tuple[tuple[float, ...], ...] = ()
    misses: float | None = None
    layer_seconds: float | None = None


def calibrate(shape: Shape, rates: Rates, seen: Observed | None) -> tuple[Shape, Rates]:
    """``shape`` with the router's measured spread, ``rates`` with ``per_expert_s`` fitted to
    ``seen``'s time: what the forward call took beyond its reads and the modelled compute,
    per expert a layer read, at most the default (a first call also pays one-time
    costs: compilation, allocation). Unchanged when ``seen`` is ``None`` or empty."""
    if seen is None or seen.tokens <= 0 or seen.distinct <= 0 or seen.seconds <= 0:
        return shape, rates
    shape = replace(shape, routed=routed_experts(seen.distinct, seen.tokens, shape.experts, shape.top_k),
                    popularity=seen.popularity)
    bare = replace(rates, overhead_s=0.0, per_expert_s=0.0)
    parts = layer_step_seconds(shape, bare, seen.tokens, seen.tokens / 2, 1)
    compute = parts["expert"] + parts["dense"] + parts["attn"]
    layer = seen.layer_seconds if seen.layer_seconds is not None else (seen.seconds - seen.stall_seconds) / shape.layers
    left = layer - compute - rates.overhead_s
    read = seen.distinct if seen.misses is None else seen.misses
    fitted = left / read if read > 0 else rates.per_expert_s
    return shape, replace(rates, per_expert_s=min(rates.per_expert_s, max(0.0, fitted)))


def layer_step_seconds(shape: Shape, rates: Rates, tokens: int, context: float,
                       sequences: int | None = None) -> dict:
    """Seconds of one MoE layer step of ``tokens`` tokens with average ``context``, by part;
    the tokens are of ``sequences`` sequences (``None``: one each, a decode step), each
    of whose KV caches the step's attention reads once.

    Returns:
        ``{"read", "expert", "dense", "attn", "overhead", "total"}`` in seconds; ``read`` is
        what the step waits for (with read ahead, what the reads take beyond the
        compute of the rounds they overlap).
    """
    d, resident = routed_split(shape, tokens)
    read = max(0.0, d - resident) * shape.expert_bytes / (max(rates.disk_gbps, 1e-3) * 1e9)
    rows = tokens * shape.top_k / max(d, 1e-9)
    if rows >= rates.gemm_min_rows:
        expert = d * (shape.expert_bytes / (rates.dequant_gbps * 1e9)
                      + rows * shape.expert_flops / (rates.gemm_gflops * 1e9))
    else:
        expert = tokens * shape.top_k * rates.pair_seconds(shape.expert_bytes, rows)
    if tokens >= rates.gemm_min_rows:
        dense = tokens * shape.dense_flops / (rates.gemm_gflops * 1e9)
    else:
        dense = tokens * rates.pair_seconds(shape.dense_bytes, tokens)
    attn = tokens * context * shape.attn_flops / (rates.attention_gflops * 1e9)
    if rates.kv_read_gbps > 0:
        per_token = shape.kv_read_bytes or shape.kv_bytes
        kv = (tokens if sequences is None else sequences) * context * per_token / max(shape.layers, 1)
        attn = max(attn, kv / (rates.kv_read_gbps * 1e9))
    # The first round holds the slots' count, each later one the round width (LayerCache.assign_wide).
    per_round = max(shape.slots, shape.width, 1)
    rounds = 1 + math.ceil((d - shape.slots) / per_round) if d > shape.slots else 1
    if shape.read_ahead and rounds > 1:
        # The first round is the resident experts (nothing read); each later round's
        # read overlaps the compute of the round before: the step waits for what the
        # reads take beyond the compute of all rounds but the last (its experts' share).
        last = d - shape.slots - per_round * (rounds - 2)
        read = max(0.0, read - expert * (d - last) / d)
    parts = {"read": read, "expert": expert, "dense": dense, "attn": attn,
             "overhead": rates.overhead_s + max(0.0, d - resident) * rates.per_expert_s}
    return {**parts, "total": sum(parts.values())}


def head_seconds(shape: Shape, rates: Rates, rows: float) -> float:
    """Seconds of the output layer on ``rows`` positions at once (one a sequence: a decode
    step's, or the tokens riding a prompt step): below the GEMM's rows each row is a pair of
    the loops (:meth:`Rates.pair_seconds`, the pass over the weights shared by the rows),
    else the layer is dequantised once and multiplied. ``0.0`` where it is not priced.

    An approximation: the rates and the GEMM's row threshold are the experts' (probed on
    their format), while the output layer may be stored otherwise (the demo's is 8-bit,
    whose kernel takes the GEMM from 8 rows); on that layer the loops' price came closer
    to its measured time than the GEMM's (benches/results/throughput/NOTES.md)."""
    if shape.head_bytes <= 0 or rows <= 0:
        return 0.0
    if rows >= rates.gemm_min_rows:
        return shape.head_bytes / (rates.dequant_gbps * 1e9) + rows * shape.head_flops / (rates.gemm_gflops * 1e9)
    return rows * rates.pair_seconds(shape.head_bytes, rows)


def seconds_per_token(shape: Shape, rates: Rates, tokens: int, context: float,
                      sequences: int | None = None) -> float:
    """Whole-model seconds per token at a pool of ``tokens`` of ``sequences`` sequences
    (``L * step / tokens``; ``None``: one token a sequence, a decode step, whose output
    layer runs on every token: :func:`head_seconds`; a prompt's runs on its last token
    only, priced with the tokens it generates)."""
    head = head_seconds(shape, rates, tokens) if sequences is None else 0.0
    return (shape.layers * layer_step_seconds(shape, rates, tokens, context, sequences)["total"] + head) / max(tokens, 1)


def head_terms(head_bytes: int, vocab: int, hidden: int) -> dict:
    """:class:`Shape`'s output-layer terms: ``head_bytes`` and ``head_flops`` (none without
    the layer's bytes or the vocabulary)."""
    if head_bytes <= 0 or vocab <= 0:
        return {"head_bytes": 0.0, "head_flops": 0.0}
    return {"head_bytes": float(head_bytes), "head_flops": 2.0 * vocab * hidden}


def output_layer_bytes(tensors) -> int:
    """Bytes of a model's output layer from ``(name, bytes)`` pairs of its tensors (a
    checkpoint's index, or a loaded model's parameters): those of ``lm_head``, or of the
    token embedding where the output layer is tied to it (no ``lm_head``); 0 when neither
    is found."""
    pairs = list(tensors)
    head = [n for name, n in pairs if ".lm_head." in f".{name}"]
    return int(sum(head) if head else sum(n for name, n in pairs if "embed_tokens." in name))


@dataclass(frozen=True)
class PoolPlan:
    """The chosen pools and what they predict.

    Attributes:
        prefill_tokens: prompt tokens per prefill step (over its prompts).
        prefill_batch: most prompts read at once (those a step's tokens cover, and
            one more, where a prompt ends inside a step).
        decode_pool: sequences decoded together (and most in the engine).
        prompt_tok_s: predicted prompt tokens read per second at the prefill pool.
        decode_tok_s: predicted generated tokens per second, over a document's
            tokens decoded in prefill steps and in decode steps.
        docs_per_hour: predicted documents per hour for the given lengths.
        batch1_docs_per_hour: the same model's prediction for one sequence at a time
            (prompt chunks of ``prefill_tokens``), for comparison.
        limited_by: what bounded the decode pool (``memory``, ``cap``, ``documents``).
        prompt_tokens, output_tokens: the document lengths predicted for.
        merged_tokens: of a document's ``output_tokens``, how many are decoded in
            prefill steps (module batching; the others in decode steps).
        calls: calls a document takes (a long one: its parts and the calls combining their
            summaries, :func:`mlx_tier.tools.calls.call_plan`); the rates above are a call's,
            the documents/hour a whole document's.
        document_tokens: a document's tokens of text (0: as ``prompt_tokens``).
    """

    prefill_tokens: int
    prefill_batch: int
    decode_pool: int
    prompt_tok_s: float
    decode_tok_s: float
    docs_per_hour: float
    batch1_docs_per_hour: float
    limited_by: str
    prompt_tokens: int
    output_tokens: int
    merged_tokens: float = 0.0
    calls: int = 1
    document_tokens: int = 0

    def as_dict(self) -> dict:
        return {k: significant(v) if isinstance(v, float) else v for k, v in asdict(self).items()}

    def of_calls(self, parts: int, combines: int, combined: PoolPlan | None, document_tokens: int) -> PoolPlan:
        """This plan (a part's call) for a long document of ``document_tokens`` read in ``parts``
        such calls then ``combines`` calls priced by ``combined`` (the pools' plan for a combining
        call's prompt; ``None``: none): documents/hour of the whole document."""
        def hours(rate: float, other: float) -> float:
            return parts / rate + (combines / other if combines else 0.0)

        return replace(self, docs_per_hour=1 / hours(self.docs_per_hour, combined.docs_per_hour if combined else 1),
                       batch1_docs_per_hour=1 / hours(self.batch1_docs_per_hour,
                                                      combined.batch1_docs_per_hour if combined else 1),
                       calls=parts + combines, document_tokens=document_tokens)


def prefill_transient(shape: Shape, tokens: int, context: float) -> float:
    """Bytes a prefill step of ``tokens`` holds besides the KV caches: attention scores
    (``tokens x context x heads`` float32, MLX's attention) and the MoE block's rows (the
    pool's ``tokens x k`` pairs: their inputs, outputs and their scatter, ``D`` wide, four
    float32 copies; the experts' hidden rows, three)."""
    pairs = tokens * shape.top_k
    return 4.0 * (tokens * context * shape.heads + pairs * (4 * shape.hidden + 3 * shape.inner))


def choose_pools(shape: Shape, rates: Rates, prompt_tokens: int, output_tokens: int, free_bytes: int,
                 cap: int | None = None, documents: int | None = None, max_pool: int | None = None,
                 shared_tokens: int = 0, merged: bool = True, decode_slots: int = 0,
                 max_tok_s: float | None = None) -> PoolPlan:
    """Pool sizes for documents of ``prompt_tokens`` prompts and ``output_tokens`` summaries.

    Args:
        free_bytes: memory for KV caches and step transients (after the model and
            its expert cache), bytes.
        cap: most sequences at once (the user's ``--batch-size``), ``None``: :data:`MAX_DECODE_POOL`.
        documents: how many documents the job has (a pool larger is not filled).
        max_pool: most prompt tokens a prefill step may carry (the memory split's
            workspace: :attr:`~mlx_tier.engine.footprint.MemoryBudget.prefill_step`).
        shared_tokens: tokens at the start of every prompt read once for the whole job
            (a shared prefix, its KV cache copied to each sequence): in each sequence's
            KV cache, not in the tokens a document's prompt reads.
        merged: prefill steps decode the sequences generating meanwhile (module doc);
            ``False``: prefill and decode steps apart.
        decode_slots: expert slots per layer a decode step holds beyond ``shape.slots``
            (lent by the prompt step's idle workspace:
            :meth:`~mlx_tier.engine.footprint.MemoryBudget.decode_slots`); decode steps
            are priced with them, prefill steps without.
        max_tok_s: the user's cap on generated tokens per second (``--max-tok-s``,
            :class:`~mlx_tier.job.throttle.Throttle`: each step lasts at least its tokens
            over the cap), ``None``: none.

    Returns:
        :class:`PoolPlan`. The decode pool is at least 1 even when one
        sequence does not fit (the scheduler then splits the document).
    """
    seq = prompt_tokens + output_tokens
    ctx_prefill = prompt_tokens / 2  # average context of a prompt token
    candidates = [t for t in POOL_CANDIDATES if max_pool is None or t <= max_pool] or [max(1, max_pool or 1)]
    fits = [t for t in candidates
            if prefill_transient(shape, t, min(seq, MAX_CHUNK)) + shape.kv_bytes * seq * math.ceil(t / seq)
            <= free_bytes / 2] or candidates[:1]
    read = max(1, prompt_tokens - shared_tokens)  # prompt tokens a document reads
    rate = {t: 1 / seconds_per_token(shape, rates, t, ctx_prefill, math.ceil(t / read)) for t in fits}
    best = max(rate.values())
    near = [t for t in fits if rate[t] >= NEAR_BEST * best]
    prefill_tokens = max(t for t in near if t <= 2 * min(near))  # a near tie: one size up at most
    limit = cap or MAX_DECODE_POOL
    room = max(1, int((free_bytes - prefill_transient(shape, prefill_tokens, min(seq, MAX_CHUNK)))
                      // max(1.0, shape.kv_bytes * (seq + KV_STEP))))
    pool, limited_by = min(room, limit), "memory" if room < limit else ("batch size" if cap else "cap")
    if documents is not None and documents < pool:
        pool, limited_by = max(1, documents), "documents"
    # The prompts a pool's tokens cover, and one more: a prompt that ends inside a step
    # leaves the rest of the pool to the next one (mlx_tier.job.pool_engine).
    prefill_batch = max(1, min(pool, math.ceil(prefill_tokens / read) + 1))
    ctx_decode = prompt_tokens + output_tokens / 2
    decoding = replace(shape, slots=min(shape.experts, shape.slots + max(0, decode_slots)))
    cap_s = 1 / max_tok_s if max_tok_s else 0.0  # the least a generated token takes under the cap
    decode_s = max(seconds_per_token(decoding, rates, pool, ctx_decode), cap_s)
    prompt_s = 1 / rate[prefill_tokens]
    riding = max(1, pool - prefill_batch)  # tokens decoded in a prefill step: one output-layer row each
    merged_tokens = min(output_tokens, read / prefill_tokens * max(0, pool - prefill_batch)) if merged else 0.0
    merged_s = prompt_s + (ctx_decode * (shape.kv_read_bytes or shape.kv_bytes) / (rates.kv_read_gbps * 1e9)
                           if rates.kv_read_gbps > 0 else 0.0) + head_seconds(shape, rates, riding) / riding
    decode_all_s = merged_tokens * merged_s + (output_tokens - merged_tokens) * decode_s
    # the prefill steps carrying merged tokens last at least those tokens over the cap
    decode_all_s += max(0.0, merged_tokens * cap_s - read * prompt_s - merged_tokens * merged_s)
    doc_s = read * prompt_s + decode_all_s
    one_s = (read * seconds_per_token(shape, rates, min(prefill_tokens, read), ctx_prefill, 1)
             + output_tokens * max(seconds_per_token(decoding, rates, 1, ctx_decode), cap_s))
    return PoolPlan(prefill_tokens, prefill_batch, pool, 1 / prompt_s, output_tokens / max(decode_all_s, 1e-12),
                    3600 / doc_s, 3600 / one_s, limited_by, prompt_tokens, output_tokens, merged_tokens)


def choose_slots(shape: Shape, rates: Rates, prompt_tokens: int, output_tokens: int, room: int, slot_row: int,
                 most: int, documents: int | None = None, cap: int | None = None,
                 max_pool: int | None = None,
                 decode_slots: Callable[[int], int] | None = None,
                 max_tok_s: float | None = None) -> tuple[int, PoolPlan, PoolPlan]:
    """Expert slots per layer for a run whose expert cache and KV caches share ``room`` bytes.

    Under a memory cap the two compete: every slot row taken from the KV caches
    shrinks the pools (:func:`choose_pools`), every slot row given back adds
    reads. Each count from 1 to ``most`` is priced by the pool model with the KV
    caches left beside it, less :data:`ROOM_MARGIN` (a pool at the edge of fitting
    in the room the split foresees may not fit in the room the run measures when it
    starts, and falls to the next size down); the largest count within
    :data:`NEAR_BEST` of the best predicted documents/hour wins (a larger cache is
    the safer side: the hit rate it buys is measured in runs, the pools' gain
    modelled). With room to spare, ``most``.

    Args:
        room: bytes for the expert cache and the KV caches together.
        slot_row: bytes of one slot in every MoE layer.
        most: the most slots per layer to consider (the memory split's default cache).
        documents, cap, max_pool, max_tok_s: as :func:`choose_pools` takes them.
        decode_slots: ``decode_slots(n)``, the slots a decode step borrows beside ``n``
            (:func:`choose_pools`' ``decode_slots``); ``None``: none.

    Returns:
        ``(slots, the pools they leave, the pools ``most`` slots leave)``.

    Raises:
        ValueError: ``most`` < 1 or no slot row fits in ``room``.
    """
    plans = {n: choose_pools(replace(shape, slots=n), rates, prompt_tokens, output_tokens,
                             int((room - n * slot_row) * (1 - ROOM_MARGIN)), cap, documents, max_pool,
                             decode_slots=decode_slots(n) if decode_slots else 0, max_tok_s=max_tok_s)
             for n in range(1, most + 1) if room - n * slot_row > 0}
    if not plans:
        raise ValueError(f"no expert slot row ({slot_row} bytes) fits in {room} bytes (most {most})")
    best = max(p.docs_per_hour for p in plans.values())
    n = max(n for n, p in plans.items() if p.docs_per_hour >= NEAR_BEST * best)
    return n, plans[n], plans[max(plans)]


def job_attention(kernel: str) -> str:
    """The attention a run with expert kernel ``kernel`` computes with (:func:`probe_rates`'
    ``attention``): ``"cpu"`` (:mod:`mlx_tier.kernels.cpu_attention`) with the CPU kernel on
    MLX's CPU backend, as the load serves it; else ``"mlx"``."""
    import mlx.core as mx

    return "cpu" if kernel == "cpu" and mx.default_device() == mx.cpu else "mlx"


def probe_rates(disk_gbps: float, expert_shape: tuple[int, int] = (768, 2048), bits: int = 4,
                group_size: int = 64, heads: int = 16, head_dim: int = 64, attention: str = "mlx",
                kv_heads: int | None = None, kernel: str = "cpu", mode: str = "affine") -> Rates:
    """Measure :class:`Rates` on this machine in a few seconds (the disk rate is given:
    :func:`mlx_tier.tools.plan.measure_disk_gbps`).

    The experts through ``kernel``, the expert kernel the run uses
    (:func:`mlx_tier.kernels.registry.choose`): ``"cpu"``, the CPU expert kernel
    (:func:`_cpu_expert_rates`), else the kernel's own call on a quantized ``SwitchGLU``
    (:func:`_block_expert_rates`: MLX's ``gather_qmm`` for ``"mlx"``, on the default
    device, quantized in ``mode``), each on random experts whose gate matrix is
    ``expert_shape`` ``(out, in)`` (the inner width, the hidden width);
    attention (``attention``: ``"mlx"``, MLX's
    ``scaled_dot_product_attention`` on the default device, or ``"cpu"``,
    :func:`mlx_tier.kernels.cpu_attention.sdpa`) as the job runs it: ``heads`` query
    heads over ``kv_heads`` key/value heads (``None``: as many), a prompt chunk of 256
    queries over a cache of 768 keys and its own (mlx-lm's causal mask of a batch),
    and a decode step of a pool (8 sequences, or twice the kernel's threads) of one
    query over 1024 keys (a decode pool's mask: the KV caches' read rate).
    Medians of at least a few repetitions, repeated until each probe has run
    :data:`PROBE_SECONDS` (a probe of a few milliseconds moved by half between runs).

    Raises:
        ValueError: an unknown kernel, or one not available here.
    """
    if kernel == "cpu":
        experts = _cpu_expert_rates(expert_shape, bits, group_size)
    else:
        experts = _block_expert_rates(kernel, expert_shape, bits, group_size, mode)
    att_gflops, kv_gbps = _attention_rates(_median, heads, kv_heads or heads, head_dim, attention)
    return Rates(disk_gbps=disk_gbps, attention_gflops=att_gflops, kv_read_gbps=kv_gbps, **experts)


def _median(fn, reps: int = 5) -> float:
    """Median seconds of ``fn()`` after one warm-up call: at least ``reps`` calls, more until
    they have run :data:`PROBE_SECONDS`."""
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < reps or (spent < PROBE_SECONDS and len(times) < 10_000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return sorted(times)[len(times) // 2]


def _loop_gbps(packed: float, t_mv: float, t_rows: float, rows: int) -> float:
    """The loops' rate at many rows a slot, GB/s of packed bytes a pair, from a pair's
    seconds at one row (``t_mv``) and at ``rows`` rows (``t_rows``): a pair at r rows
    costs loop + (matvec - loop) / r (:meth:`Rates.pair_seconds`), solved for loop."""
    t_loop = max((rows * t_rows - t_mv) / (rows - 1), 0.2 * t_rows) if rows > 1 else t_rows
    return packed / t_loop / 1e9


def _cpu_expert_rates(expert_shape: tuple[int, int], bits: int, group_size: int) -> dict:
    """:class:`Rates`' expert fields for the CPU expert kernel (:mod:`mlx_tier.kernels.cpu`)
    on a random quantized expert of ``expert_shape`` ``(out, in)``: GEMM, dequantisation and
    the loops (one row a slot, and :data:`LOOP_PROBE_ROWS` rows a slot)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from mlx_tier.kernels import cpu

    out_dim, in_dim = expert_shape
    n = 2 * cpu.THREADS  # experts in the GEMM probe: every kernel thread busy, as in a pool step
    leaf = QuantizedSwitchLinear(in_dim, out_dim, n, bias=False, group_size=group_size, bits=bits)
    leaf.set_dtype(mx.float32)
    mx.eval(leaf.parameters())
    packed = sum(leaf[name].nbytes for name in ("weight", "scales", "biases")) / n  # one expert
    quant = cpu._Quant(leaf, stacked=True)
    rows = max(64, quant.gemm_min_rows)  # per expert: the GEMM path
    x = np.random.default_rng(0).standard_normal((rows * n, in_dim)).astype(np.float32)
    slots = np.repeat(np.arange(n), rows)
    t_gemm = _median(lambda: cpu.switch_linear(leaf, x, np.arange(rows * n), slots))
    t_deq = _median(lambda: quant.dense(0)) / cpu.THREADS  # one expert, spread over the threads
    pairs = np.arange(2 * cpu.THREADS)  # decode: a few pairs, one row each
    t_mv = _median(lambda: cpu.switch_linear(leaf, x[pairs], pairs, pairs % n)) / len(pairs)
    many = np.arange(n * max(1, min(LOOP_PROBE_ROWS, quant.gemm_min_rows - 1)))  # a prompt pool's small slots
    t_rows = _median(lambda: cpu.switch_linear(leaf, x[many], many, many * n // len(many))) / len(many)
    gemm_s = max(t_gemm - n * t_deq, 1e-6) / n  # one expert's GEMM
    return {"gemm_gflops": 2 * rows * in_dim * out_dim / gemm_s / 1e9, "matvec_gbps": packed / t_mv / 1e9,
            "dequant_gbps": packed / t_deq / 1e9, "gemm_min_rows": quant.gemm_min_rows,
            "loop_gbps": _loop_gbps(packed, t_mv, t_rows, len(many) // n)}


# Rows an expert in _block_expert_rates' two GEMM probes (its GEMM price holds from the first).
BLOCK_GEMM_ROWS = (64, 128)
# Experts in _block_expert_rates' loop probes, one in its GEMM probes: pairs enough that a call's
# fixed cost (a GPU's sync, priced in Rates.overhead_s) is not charged to a pair (MLX's gather_qmm
# on MLX's CPU backend computes each row on its own: about a millisecond a row and matrix).
BLOCK_PROBE_EXPERTS = 8
# The GEMM line's intercept is taken as an expert's fixed cost only above this share of the
# first count's time (below it, the difference of two timings is their noise).
FIT_NOISE = 0.1


def _block_expert_rates(kernel: str, expert_shape: tuple[int, int], bits: int, group_size: int,
                        mode: str = "affine") -> dict:
    """:class:`Rates`' expert fields for an expert kernel that computes a whole block
    (:func:`mlx_tier.kernels.registry.kernel_for`: ``"mlx"``, ``"metal"``) on a random
    ``SwitchGLU`` quantized like the checkpoint's experts (``bits``, ``group_size``,
    ``mode``; affine 4-bit where MLX refuses that combination) in the run's compute dtype
    (:func:`mlx_tier.engine.dtypes.job_compute_dtype`, bfloat16 on a GPU), whose gate and up
    matrices are ``expert_shape`` ``(out, in)`` (the inner width, the hidden width), called
    as a tiered layer calls it (sorted slots). The loops' fields from one row and
    :data:`LOOP_PROBE_ROWS` rows a slot; the GEMM's from two row counts of one expert
    (:data:`BLOCK_GEMM_ROWS`), a straight line: its intercept an expert's fixed cost
    (priced as ``dequant_gbps``; none within :data:`FIT_NOISE`), its slope a row's FLOPs
    (``gemm_gflops``), used from the first count (``gemm_min_rows``).

    Raises:
        ValueError: an unknown kernel, or one not available here.
    """
    import mlx.core as mx
    from mlx import nn

    from mlx_tier.engine.dtypes import job_compute_dtype
    from mlx_tier.kernels.registry import kernel_for
    from mlx_tier.tools.kernel_probe import quantized_glu

    fn = kernel_for(kernel)
    inner, hidden = expert_shape
    n, dtype = BLOCK_PROBE_EXPERTS, job_compute_dtype() or mx.bfloat16
    try:
        block = quantized_glu(hidden, inner, n, {"bits": bits, "group_size": group_size, "mode": mode}, dtype)
    except (ValueError, RuntimeError):  # a combination this MLX refuses: priced as affine 4-bit
        block = quantized_glu(hidden, inner, n, {"bits": 4, "group_size": 64}, dtype)
    packed = sum(v.nbytes for _, v in nn.utils.tree_flatten(block.parameters())) / n  # one expert
    flops = 2.0 * 3 * inner * hidden  # a row through one expert

    def pair_seconds(rows: int, experts: int = n, reps: int = 5) -> float:
        x = mx.random.normal((rows * experts, hidden)).astype(dtype)
        slots = (mx.arange(rows * experts) // rows).astype(mx.uint32)[:, None]  # sorted, ``rows`` an expert
        mx.eval(x, slots)
        return _median(lambda: mx.eval(fn(block, x, slots)), reps) / (rows * experts)

    t_mv, t_rows = pair_seconds(1), pair_seconds(LOOP_PROBE_ROWS, reps=3)
    (r0, r1), (t0, t1) = BLOCK_GEMM_ROWS, [pair_seconds(r, 1, reps=3) * r for r in BLOCK_GEMM_ROWS]
    per_row, fixed = (t1 - t0) / (r1 - r0), 0.0
    if per_row > 0 and t0 - r0 * per_row > FIT_NOISE * t0:
        fixed = t0 - r0 * per_row
    else:  # no fixed cost the timings can tell: a row's cost from the larger count
        per_row = t1 / r1
    return {"gemm_gflops": flops / per_row / 1e9, "matvec_gbps": packed / t_mv / 1e9,
            "dequant_gbps": packed / max(fixed, packed / 1e13) / 1e9,  # a 10 TB/s floor: no fixed cost
            "gemm_min_rows": r0, "loop_gbps": _loop_gbps(packed, t_mv, t_rows, LOOP_PROBE_ROWS)}


def _attention_rates(med, heads: int, kv_heads: int, head_dim: int, attention: str) -> tuple[float, float]:
    """:func:`probe_rates`' attention probes, timed with ``med(fn, reps)``: ``(GFLOP/s of a
    256-query chunk over 1024 keys with mlx-lm's causal mask, GB/s of KV read by a decode
    pool's step)``, through ``attention`` (``"cpu"`` or ``"mlx"``)."""
    import mlx.core as mx

    from mlx_tier.kernels import cpu

    if attention == "cpu":
        from mlx_tier.kernels.cpu_attention import sdpa

        def attend(q, k, v, mask):
            return sdpa(q, k, v, 0.1, mask)
    else:
        def attend(q, k, v, mask):
            return mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mask))

    from mlx_lm.models.base import create_causal_mask

    q, k = mx.random.normal((1, heads, 256, head_dim)), mx.random.normal((1, kv_heads, 1024, head_dim))
    chunk = create_causal_mask(256, offset=768, left_padding=mx.array([0]))  # [1, 1, 256, 1024]
    seqs = max(8, 2 * cpu.THREADS)  # a decode pool's sequences
    one, keys, values = (mx.random.normal((seqs, n_heads, n, head_dim))
                         for n_heads, n in ((heads, 1), (kv_heads, 1024), (kv_heads, 1024)))
    pool = create_causal_mask(1, offset=1023, left_padding=mx.zeros((seqs,), mx.int32))
    mx.eval(q, k, one, keys, values, chunk, pool)
    t_att = med(lambda: attend(q, k, k, chunk), reps=3)
    t_kv = med(lambda: attend(one, keys, values, pool), reps=3)
    return (4 * heads * 256 * (768 + 128.5) * head_dim / t_att / 1e9,  # keys attended
            (keys.nbytes + values.nbytes) / t_kv / 1e9)


def measure_read_gbps(files: list, total_mb: int = 64, chunk_mb: int = 2, warm: bool = True) -> float:
    """Positioned reads of ``chunk_mb`` MiB at random offsets of ``files``, GB/s.

    ``warm``: pages as they are (a checkpoint that fits in memory is read from the
    page cache after its first pass, and that is the rate its misses see);
    else dropped first (:func:`mlx_tier.tools.plan.measure_disk_gbps`).
    """
    import os
    import random

    from mlx_tier.tools.plan import measure_disk_gbps

    if not warm:
        return measure_disk_gbps(files, total_mb, chunk_mb)
    chunk = min(chunk_mb * 2**20, max((f.stat().st_size for f in files), default=0))
    files = [f for f in files if chunk and f.stat().st_size >= chunk]
    rng, buf, done, t = random.Random(0), bytearray(chunk), 0, 0.0
    while files and done < total_mb * 2**20:
        f = rng.choice(files)
        fd = os.open(f, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            done += os.preadv(fd, [buf], rng.randrange(0, f.stat().st_size - chunk + 1) // 4096 * 4096)
            t += time.perf_counter() - t0
        finally:
            os.close(fd)
    return done / t / 1e9 if t else 0.0


def _unpacked_in(leaf) -> int:
    """Input features of a (quantized) switch linear layer."""
    w = leaf["weight"]
    return w.shape[-1] * 32 // leaf.bits if getattr(leaf, "bits", None) else w.shape[-1]


def attention_terms(hidden: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """A layer's dense terms of :class:`Shape`: ``dense_bytes`` (its q, k, v and o projections
    at ~0.6 bytes a weight: 4-bit codes with their group scales and biases), ``dense_flops``
    per token and ``attn_flops`` per token per context token."""
    dense = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    return {"dense_bytes": int(dense * 0.6), "dense_flops": 2.0 * dense, "attn_flops": 4.0 * heads * head_dim}


def shape_of(model, kv_bytes: float) -> tuple[Shape, dict] | None:
    """The :class:`Shape` of a model loaded by :func:`mlx_tier.load`, and what
    :func:`probe_rates` needs to measure its kernels (``expert_shape``, ``bits``,
    ``group_size``, ``heads``, ``head_dim``, ``kv_heads``); ``None`` without an expert cache.

    ``kv_bytes``: KV-cache bytes per token (measured on a filled prompt cache).
    """
    from mlx.utils import tree_flatten

    cache = getattr(model, "expert_cache", None)
    args = getattr(model, "args", None)
    if cache is None or args is None:
        return None
    layer = cache.layers[0]
    leaves = {id(t.module): t.module for t in layer.tensors.values()}.values()
    E = layer.num_experts
    expert_bytes = sum(t.info.nbytes for t in layer.tensors.values()) // E
    params = sum(leaf["weight"].shape[-2] * _unpacked_in(leaf) for leaf in leaves)
    hidden = int(args.hidden_size)
    # the largest matrix; of equal ones the gate's (in: the hidden width), as plan probes it
    big = max(leaves, key=lambda leaf: (leaf["weight"].shape[-2] * _unpacked_in(leaf), _unpacked_in(leaf) == hidden))
    heads = int(args.num_attention_heads)
    kv_heads = int(getattr(args, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(args, "head_dim", None) or hidden // heads)
    top_k = next((int(getattr(args, k)) for k in ("num_experts_per_tok", "top_k", "moe_k")
                  if isinstance(getattr(args, k, None), int)), 2)
    head = output_layer_bytes((name, a.nbytes) for name, a in tree_flatten(model.parameters()))
    shape = Shape(layers=len(cache.layers), experts=E, top_k=top_k, slots=min(cache.layer_slots),
                  expert_bytes=expert_bytes, expert_flops=2.0 * params,
                  **attention_terms(hidden, heads, kv_heads, head_dim),
                  kv_bytes=kv_bytes, heads=heads, hidden=hidden, inner=int(params / (3 * hidden)) if hidden else 0,
                  read_ahead=getattr(layer, "reader", None) is not None, width=layer.width,
                  **head_terms(head, int(getattr(args, "vocab_size", 0) or 0), hidden))
    probe = {"expert_shape": (big["weight"].shape[-2], _unpacked_in(big)), "bits": getattr(big, "bits", 4) or 4,
             "group_size": getattr(big, "group_size", 64) or 64, "mode": getattr(big, "mode", None) or "affine",
             "heads": heads, "head_dim": head_dim, "kv_heads": kv_heads}
    return shape, probe


_RATES: dict = {}


def rates_for(model, probe: dict) -> Rates:
    """:func:`probe_rates` for ``model`` (its kernels' shapes, its checkpoint's read
    rate, its expert kernel and attention), measured once per shape in a process."""
    from mlx_tier.engine.budgets import host_available

    cache = model.expert_cache
    files = sorted({t.info.file for layer in cache.layers for t in layer.tensors.values()})
    size = sum(f.stat().st_size for f in files)
    served = any(getattr(type(m), "cpu_attention", False) for _, m in model.named_modules())
    kernel = getattr(cache, "kernel", "cpu")  # as the load chose it (mlx_tier.kernels.registry.choose)
    key = (tuple(sorted(probe.items())), served, kernel, size <= 0.8 * host_available())
    if key not in _RATES:
        disk = measure_read_gbps(files, warm=key[-1])
        _RATES[key] = probe_rates(disk, **probe, attention="cpu" if served else "mlx", kernel=kernel)
    return _RATES[key]
