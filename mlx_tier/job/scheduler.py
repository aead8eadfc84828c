"""Which prompts run next: documents in, summaries out, through one batched engine.

The job runner hands over the documents to do; this module turns each into
one prompt (or, when too long for the usable context, a map-reduce of parts,
:mod:`mlx_tier.job.longdoc`), keeps the batch full, and yields one
:class:`Outcome` per document as soon as it is finished — the runner then
writes and journals it. A batch request (a document with a ``request``,
:mod:`mlx_tier.job.batch_api`) runs as written instead: its own prompt, token
limit and sampling, one sequence per choice, in the same batches. The thermal throttle and progress run between steps
through ``on_step``; nothing here sleeps or runs inside a forward pass.

Failures: an exception inside a batched step cannot be pinned on one
sequence, so every document in flight is retried alone; a document that
fails alone is reported failed with its error and the job goes on.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx

from mlx_tier.defaults import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PREFILL_STEP,
    DEFAULT_PROMPT,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_SCHEDULE,
    SCHEDULES,
)
from mlx_tier.engine import footprint
from mlx_tier.engine.footprint import MemoryBudget, check_kv_bits
from mlx_tier.engine.sizes import release_freed_memory
from mlx_tier.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    JobError,
    RequestError,
    TooLong,
)
from mlx_tier.job import pool_engine
from mlx_tier.job.batch_api import CHAT, Choice, prompt_tokens
from mlx_tier.job.batch_engine import (
    MAX_AUTO_BATCH,
    BatchEngine,
    PrefixCache,
    StepInfo,
    Task,
    common_prefix,
    estimate_memory,
    kv_bytes_per_token,
    sequence_room,
    stop_token_ids,
)
from mlx_tier.job.doc_tokens import Sample, chars_per_token, predicted_tokens
from mlx_tier.job.documents import source_hash
from mlx_tier.job.longdoc import MAP_NOTE, EmptyCall, MapReduce
from mlx_tier.job.pool_engine import PoolEngine
from mlx_tier.job.prompts import (
    build_prompt,
    reasoning_format,
    strip_reasoning,
    trim_to_sentence,
)
from mlx_tier.job.quantized_kv import quantized_copy
from mlx_tier.outdir.parts import KeptCall, PartStore
from mlx_tier.tools.pools import MAX_DECODE_POOL

# Fewest tokens of document text one call must have room for.
MIN_TEXT_TOKENS = 16
# Least seconds between two releases of freed memory before a document waits for room
# (Scheduler._context_for): each costs ~45 ms, a decode step of a pool ~0.1-1 s.
WAIT_RELEASE_S = 5.0


@dataclass(frozen=True)
class GenerationConfig:
    """How summaries are generated.

    Attributes:
        instruction: placed before each document's text.
        max_tokens: most tokens per generated summary (and per part summary).
        repetition_penalty: mlx-lm's repetition penalty, 1.0 = plain greedy.
        batch_size: sequences decoded together (an upper bound with the
            throughput schedule); ``None``: the throughput schedule's pool
            model (:mod:`mlx_tier.tools.pools`: memory and measured rates), or
            for the paced schedule the memory headroom
            (:class:`~mlx_tier.job.batch_engine.MemoryPlan`), at most 8.
        context: usable context in tokens (prompt + output); ``None``: the
            model's. Documents longer than this are summarised by map-reduce.
        prefill_step_size: prompt tokens per forward call during prefill.
        reuse_prefix: prefill the instruction prefix shared by every prompt
            once and copy its KV cache into each sequence.
        schedule: ``"throughput"`` (default) or ``"paced"`` (:data:`SCHEDULES`).
        pool_tokens: throughput schedule: prompt tokens per prefill step, over
            the prompts read together; ``None``: from the pool model.
        prefill_batch: throughput schedule: prompts read together; ``None``: from the pool model.
        kv_bits: throughput schedule: store the KV caches quantized to these bits
            (:mod:`mlx_tier.job.quantized_kv`: more sequences fit in the same
            memory; tokens may differ from an unquantized cache); ``None``: not.

    Raises:
        ConfigError: an unknown ``schedule`` (``field``: ``schedule``); ``kv_bits``
            not one of :data:`~mlx_tier.defaults.KV_BITS`, or with the paced schedule.
    """

    instruction: str = DEFAULT_PROMPT
    max_tokens: int = DEFAULT_MAX_TOKENS
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY
    batch_size: int | None = None
    context: int | None = None
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    reuse_prefix: bool = True
    schedule: str = DEFAULT_SCHEDULE
    pool_tokens: int | None = None
    prefill_batch: int | None = None
    kv_bits: int | None = None

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"`schedule` must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}", "schedule")
        check_kv_bits(self.kv_bits)
        if self.kv_bits is not None and self.schedule != "throughput":
            raise ConfigError("`kv_bits` needs the throughput schedule (its pools hold the quantized KV caches)",
                              "kv_bits")


@dataclass
class Outcome:
    """One finished (or failed) document.

    ``parts`` > 0 marks a document summarised by map-reduce (its level-0 part
    count); ``reasoning`` holds any thinking the model did (kept in the
    journal, not in the summary). A batch request's answer is in ``choices``
    (``summary`` stays empty); a failed one's ``error_code`` and ``error_param``
    are the API's ``code`` and ``param`` (``None``: a failure while generating).
    """

    id: str
    status: str  # done | failed
    summary: str = ""
    reasoning: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    parts: int = 0
    levels: int = 0
    seconds: float = 0.0  # the document's own time: its prompt-reading steps plus the decode steps it took part in
    error: str | None = None
    choices: list[Choice] | None = None
    error_code: str | None = None
    error_param: str | None = None
    kept: int = 0  # map-reduce calls whose result a stopped run kept (not generated again)
    kept_tokens: int = 0  # of output_tokens, those of kept calls' results (an earlier run's or a copy's): not generated for it


def check_context(tokenizer, instruction: str, max_tokens: int, context: int, what: str = "a context of",
                  raisable: bool = True):
    """Refuse a context with no room for text in one call: the context less the
    output and the instruction with its part note (:mod:`mlx_tier.job.longdoc`).
    ``raisable``: ``False`` when the context is the model's own, which no setting raises.

    Raises:
        InputError: fewer than :data:`MIN_TEXT_TOKENS` tokens would be left
            (``field``: ``context``, or ``max_tokens`` when only it can help; settings
            named `like_this` in the message).
    """
    overhead = len(build_prompt(tokenizer, MAP_NOTE.format(i=99, n=99) + instruction, ""))
    if context - max_tokens - overhead < MIN_TEXT_TOKENS:
        fix = "raise `context` or lower `max_tokens`" if raisable else "lower `max_tokens`"
        raise InputError(
            f"{what} {context} tokens is not enough for `max_tokens` {max_tokens} plus the instruction "
            f"({overhead} tokens) plus text; {fix}", "context" if raisable else "max_tokens"
        )


def _by_document(prefill: list, generating: list = ()) -> list[tuple[str, int, int]]:
    """An engine step's ``(task key, prompt tokens read, prompt length)`` as ``(document id,
    read, length)``, one entry a document: a long document read in parts counts the
    prompts of all the calls of its current level (:meth:`MapReduce.level_tokens`), the
    finished ones and those being written (``generating``: ``(task key, tokens)``) as
    read, so its progress and ETA neither restart with each part nor fall back."""
    out: dict = {}
    writing = {key for key, _ in generating}
    for (d, i), done, total in prefill:
        if d.mr is None:
            out[d] = (done, total)
            continue
        finished, whole = d.mr.level_tokens(j for g, j in writing if g is d)
        read = out[d][0] if d in out else finished
        out[d] = (read + (0 if (d, i) in writing else done), whole)  # one being written: counted read
    return [(d.doc.id, read, total) for d, (read, total) in out.items()]


@dataclass(eq=False)
class _Doc:
    doc: object  # documents.Document
    started: float
    mr: MapReduce | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning: list[str] = field(default_factory=list)
    context: int = 0  # the usable context when it started
    finished: bool = False
    seconds: float = 0.0  # prompt reading + decode steps it was in (decode steps are shared with the batch)
    choices: list[Choice | None] | None = None  # a batch request's, by index, as they finish
    kept: int = 0  # map-reduce calls taken from the parts a stopped run kept
    kept_tokens: int = 0  # tokens of the kept calls it took (an earlier run's, or a copy's in this run)
    source: str | None = None  # the sha256 of its source (a map-reduce document's kept calls name it)
    empty: dict[int, str] = field(default_factory=dict)  # index -> finish reason of its level's empty results


class _Pulled:
    """Documents taken one at a time from an iterable: truth-testing pulls the next
    one (at most one ahead), so a generator runs each document's preparation
    only when the scheduler is about to start it."""

    def __init__(self, docs: Iterable) -> None:
        self._docs, self._head = iter(docs), deque()

    def __bool__(self) -> bool:
        if not self._head:
            self._head.extend(itertools.islice(self._docs, 1))
        return bool(self._head)

    def popleft(self):
        if not self:
            raise IndexError("no document left")
        return self._head.popleft()

    def put_back(self, doc) -> None:
        """Return ``doc`` to the front: it is the next one again."""
        self._head.appendleft(doc)


@dataclass(eq=False)
class _Queues:
    """What waits for a place in the engine, in the order it gets one.

    Attributes:
        waiting: documents not started, pulled one at a time.
        ready: calls of started documents (a map-reduce document's next parts): first.
        solo: documents in flight when a batched step failed: retried one at a time.
        alone: the document being retried; nothing else runs meanwhile.
    """

    waiting: _Pulled
    ready: deque = field(default_factory=deque)
    solo: deque = field(default_factory=deque)
    alone: _Doc | None = None

    def empty(self) -> bool:
        return not (self.ready or self.solo or self.waiting)


def _charge_time(info: StepInfo) -> None:
    """Add this step's time to each document's own: the prompt-reading part to the one being
    read, the decode part to each document decoding (once per document, whatever its calls)."""
    for d in dict.fromkeys(key[0] for key, *_ in info.prefill):
        d.seconds += info.prefill_seconds
    for d in dict.fromkeys([key[0] for key, _ in info.generating] + [f.key[0] for f in info.finished]):
        d.seconds += info.decode_seconds


class Scheduler:
    """Keeps one engine full of documents' prompts: a
    :class:`~mlx_tier.job.pool_engine.PoolEngine` (the throughput schedule) or a
    :class:`~mlx_tier.job.batch_engine.BatchEngine` (the paced one).

    Args:
        model, tokenizer: from :func:`mlx_tier.load` (or ``mlx_lm.load``).
        model_dir: the checkpoint (its config gives extra stop ids).
        model_context: the model's context length in tokens.
        config: :class:`GenerationConfig`.
        longest_chars: characters of the longest document to run, erring long
            (:func:`mlx_tier.job.documents.size_hint`); ``None``: as long as the
            usable context. Sizes the batch when ``config.batch_size`` is
            ``None``: once, here, from the memory plan.
        probes: token ids of a few of the prompts to come, whose common prefix is
            prefilled once and shared (batch requests with one system prompt);
            ``None``: the summarising instruction's prompts.
        typical_chars: characters of a typical document to run (the mean), and
        documents: how many: the throughput schedule's pools and its predicted
            documents/hour are for those (``None``: as long as the longest; unknown).
        samples: a few documents' texts (:data:`~mlx_tier.job.doc_tokens.Sample`), whose characters per token
            (:func:`mlx_tier.job.doc_tokens.chars_per_token`) turn ``typical_chars``
            into tokens for the pools; ``None``: the sizing estimate (3).
        memory: the run's memory split (:class:`~mlx_tier.engine.footprint.MemoryBudget`):
            sequences are sized within its KV share (:func:`~mlx_tier.job.batch_engine.sequence_room`);
            ``None``: within what the memory limit leaves.
        parts: where the calls of long documents are kept as they finish, and
            found again when a stopped run resumes (:class:`~mlx_tier.outdir.parts.PartStore`);
            ``None``: not kept.
        max_tok_s: the throttle's cap on generated tokens per second (``--max-tok-s``),
            which the throughput schedule's predicted documents/hour price; ``None``: none.

    Attributes:
        batch_size: sequences decoded together (fixed for the scheduler's life).
        pools: the throughput schedule's :class:`~mlx_tier.tools.pools.PoolPlan`
            (``None``: paced, or sizes all given, or a model without an expert cache).
        info: what was decided at start (batch size, usable context, shared
            prefix tokens and its prefill seconds, KV bytes per token, the pools
            and their predicted documents/hour), for the report.
    """

    def __init__(self, model, tokenizer, model_dir: Path, model_context: int, config: GenerationConfig,
                 longest_chars: int | None = None, probes: list[list[int]] | None = None,
                 typical_chars: int | None = None, documents: int | None = None,
                 memory: MemoryBudget | None = None, samples: list[Sample] | None = None,
                 parts: PartStore | None = None, max_tok_s: float | None = None):
        self.model, self.tokenizer, self.config, self.memory = model, tokenizer, config, memory
        self.max_tok_s = max_tok_s  # the throttle's cap, which the pools' prediction prices
        self.parts = parts
        self.stop_ids = stop_token_ids(tokenizer, model_dir)
        self.reasoning = reasoning_format(tokenizer, model_dir)  # None: output taken as it is
        self.vocab_size = getattr(getattr(model, "args", None), "vocab_size", None)
        if not probes or len(probes) < 2:
            probes = [build_prompt(tokenizer, config.instruction, t) for t in ("alpha beta", "zulu 9")]
        n = max(0, common_prefix(probes) - 1)  # the last shared token may merge with the text
        # The prefix is prefilled even when not reused: its cache measures KV bytes per token.
        # The throughput schedule's pool model calibrates on this first forward call.
        cache = getattr(model, "expert_cache", None) if config.schedule == "throughput" else None
        self.prefix, self._seen = self._measured_prefix(cache, probes[0][: max(n, 1)])
        self._priced = None  # step_model(), once
        self._call_overheads: tuple[int, int] | None = None  # calls_for's instruction tokens, once
        context = min(model_context, config.context or model_context)
        # Within a memory split the prompt step's transient is its workspace share, not each sequence's.
        step = config.prefill_step_size if memory is None else 0
        release_freed_memory()  # the room is measured once for the whole job: without what was freed
        self._released_at = -math.inf  # when _context_for last released freed memory
        self.plan = estimate_memory(self._stored(self.prefix.cache), getattr(model, "args", None), step,
                                    sequence_room(memory))
        keys = [c.keys for c in self.prefix.cache if isinstance(getattr(c, "keys", None), mx.array)]
        self.kv_itemsize = keys[0].dtype.size if keys else 4  # bytes of an unquantized KV element
        self.context = min(context, self.plan.max_tokens())
        check_context(tokenizer, config.instruction, config.max_tokens, self.context,
                      "the memory left allows only a context of" if self.context < context else "a context of")
        self.pools = None
        self.chars_per_token = None  # measured on the samples (the throughput schedule's pools)
        self.pool_tokens = config.pool_tokens or DEFAULT_PREFILL_STEP
        self.prefill_batch = config.prefill_batch or 1
        self._longest = (predicted_tokens(longest_chars, None) if longest_chars else self.context) + len(self.prefix) + 16
        # an asked batch is an upper bound: no more sequences than memory holds for these documents;
        # the throughput schedule admits a sequence when its KV cache fits (the others wait), so
        # there none beyond its plan's most or what memory could hold of the shortest sequences
        asked = min(config.batch_size, self._memory_batch(longest_chars, config.batch_size)
                    if config.schedule != "throughput" else self._most_pooled(config.batch_size)) \
            if config.batch_size else None
        if config.schedule == "throughput":
            self.batch_size = self._plan_pools(typical_chars or longest_chars, documents, samples, asked)
        else:  # paced admits no fewer
            self.batch_size = asked or self._memory_batch(longest_chars)
        if memory is not None:  # a pool's prompt step within the split's workspace
            self.pool_tokens = min(self.pool_tokens, memory.prefill_step)
        self._kv_room = self._pool_room(longest_chars)
        self.info = {
            "batch_size": self.batch_size,
            # the setting, or why (an asked batch memory cut: both)
            "batch_size_from": "memory headroom" if not config.batch_size
            else "batch_size" if self.batch_size == config.batch_size else "batch_size, memory headroom"
            if config.schedule != "throughput" or self.batch_size > MAX_DECODE_POOL else "batch_size, pool plan",
            "usable_context": self.context,
            "context_limited_by_memory": self.context < context,
            "shared_prefix_tokens": len(self.prefix) if self._prefix() else 0,
            "shared_prefix_prefill_seconds": round(self.prefix.seconds, 3),
            "kv_bytes_per_token": round(self.plan.kv_per_token),
            "prefill_step_size": config.prefill_step_size,
            "stop_token_ids": sorted(self.stop_ids),
            "schedule": config.schedule,
        }
        if config.schedule == "throughput":
            self.info |= {"pool_tokens": self.pool_tokens, "prefill_batch": self.prefill_batch,
                          "decode_slots": self._decode_slots(self.batch_size),
                          "pools": self.pools.as_dict() if self.pools is not None else None,
                          "chars_per_token": round(self.chars_per_token, 2) if self.chars_per_token else None}

    def _stored(self, cache: list) -> list:
        """A filled prompt cache as the engine stores its sequences' (quantized with
        ``kv_bits``), to measure KV bytes per token.

        Raises:
            ConfigError: a head dim the KV group size does not divide.
        """
        return quantized_copy(cache, self.config.kv_bits)

    def _measured_prefix(self, cache, tokens: list[int]):
        """``(the shared prefix's cache, its prefill as the pool model's calibration point)``:
        :class:`mlx_tier.tools.pools.Observed` when ``cache`` (the tiered model's expert
        cache, ``None`` outside the throughput schedule) saw it as one forward call: its
        counters, its experts' uses, and the median of its MoE layers' times less their read
        stalls (timed between the layers' starts: the first layer also pays the call's
        one-time costs)."""
        from statistics import median

        from mlx_tier.tools.pools import Observed, popularity

        if cache is None:
            return PrefixCache(self.model, tokens, self.config.prefill_step_size), None
        before, uses, starts = cache.snapshot(), cache.profile_counts(), []
        cache.set_layer_hook(lambda layer: starts.append((time.perf_counter(), cache.stats.stall_seconds)))
        try:
            prefix = PrefixCache(self.model, tokens, self.config.prefill_step_size)
        finally:
            cache.set_layer_hook(None)
        phase, uses, layers = cache.snapshot() - before, cache.profile_counts() - uses, len(cache.layers)
        if len(prefix) > self.config.prefill_step_size or not layers:
            return prefix, None
        steps = [(t1 - t0) - (s1 - s0) for (t0, s0), (t1, s1) in itertools.pairwise(starts)]
        # A fully resident layer stays lazy (its hook fires as its graph is built, its compute
        # lands in the next layer's interval): then the layers' own times are not measured.
        timed = len(steps) >= 2 and not any(layer.all_resident() for layer in cache.layers)
        rows = [u[: layer.num_experts] for u, layer in zip(uses, cache.layers, strict=True)]  # unpadded
        return prefix, Observed(len(prefix), prefix.seconds, (phase.hits + phase.misses) / layers,
                                phase.stall_seconds, popularity(rows), phase.misses / layers,
                                median(steps) if timed else None)

    def _plan_pools(self, chars: int | None, documents: int | None, samples: list[Sample] | None,
                    batch_size: int | None) -> int:
        """The throughput schedule's pools (:func:`mlx_tier.tools.pools.choose_pools`), each
        size the user gave kept (``batch_size``: the asked one as memory holds it), for
        documents of ``chars`` characters at the ``samples``' characters per token; returns the
        decode pool (the engine's batch size)."""
        from mlx_tier.tools.pools import choose_pools

        c = replace(self.config, batch_size=batch_size)
        priced = None if c.batch_size and c.pool_tokens and c.prefill_batch else self.step_model()
        if priced is not None:
            self.chars_per_token = chars_per_token(self.tokenizer, samples or [])
            # unknown sizes (a document not converted yet): one call as long as the context allows
            doc = (predicted_tokens(chars, self.chars_per_token) if chars
                   else max(1, self.context - c.max_tokens - len(self.prefix) - 16))
            calls = self.calls_for(doc)  # a document longer than a call: its parts, then combining calls
            shape, rates = priced
            room = self.plan.free_bytes - self.plan.prefill_fixed
            shared = len(self.prefix) if self._prefix() else 0  # read once, not per document
            args = (shape, rates, max(1, calls.part_prompt), c.max_tokens, room, c.batch_size, documents,
                    self.memory.prefill_step if self.memory is not None else None, shared, pool_engine.MODULE_BATCHING)
            self.pools = choose_pools(*args, decode_slots=self._decode_slots(c.batch_size or MAX_DECODE_POOL),
                                      max_tok_s=self.max_tok_s)
            lend = self._decode_slots(c.batch_size or self.pools.decode_pool)  # what the engine will lend
            self.pools = choose_pools(*args, decode_slots=lend, max_tok_s=self.max_tok_s)
            if calls.calls > 1:
                combined = choose_pools(shape, rates, calls.combine_prompt, *args[3:], decode_slots=lend,
                                        max_tok_s=self.max_tok_s) if calls.combines else None
                self.pools = self.pools.of_calls(calls.parts, calls.combines, combined, doc)
            self.pool_tokens = c.pool_tokens or self.pools.prefill_tokens
            self.prefill_batch = c.prefill_batch or self.pools.prefill_batch
            return c.batch_size or self.pools.decode_pool
        return c.batch_size or min(MAX_DECODE_POOL, self.plan.batch_size(self.context, MAX_DECODE_POOL))

    def calls_for(self, doc: int):
        """The calls a typical document of ``doc`` tokens of text takes here
        (:func:`mlx_tier.tools.calls.call_plan`): one of its prompt (the instruction and the
        shared prefix's slack counted), or its parts and the calls combining them."""
        from mlx_tier.job.longdoc import MAP_NOTE, REDUCE_NOTE
        from mlx_tier.tools.calls import call_plan

        c = self.config
        limit = self.context - c.max_tokens
        if doc + len(self.prefix) + 16 <= limit:
            return call_plan(doc, limit, c.max_tokens, len(self.prefix) + 16, 0)
        if self._call_overheads is None:  # tokenized once: the ETA asks for every long document left
            self._call_overheads = tuple(len(build_prompt(self.tokenizer, note + c.instruction, ""))
                                         for note in (MAP_NOTE.format(i=999, n=999), REDUCE_NOTE))
        return call_plan(doc, limit, c.max_tokens, *self._call_overheads)

    def step_model(self):
        """``(Shape, Rates)`` of :mod:`mlx_tier.tools.pools` for this run's model: its kernels'
        rates probed here (once per process), calibrated by its first forward call where the
        throughput schedule measured it; ``None`` without an expert cache. What the pools are
        chosen by, and what the run's "speed:" line compares its steps with."""
        from mlx_tier.tools.pools import calibrate, rates_for, shape_of

        if self._priced is None:
            found = shape_of(self.model, self.plan.kv_per_token)
            if found is None:
                return None
            shape, rates = calibrate(found[0], rates_for(self.model, found[1]), self._seen)
            if self.config.kv_bits:  # read dequantised: priced at the unquantized prefix cache's bytes
                shape = replace(shape, kv_read_bytes=kv_bytes_per_token(self.prefix.cache)[0])
            self._priced = shape, rates
        return self._priced

    def _held_bytes(self, engine: PoolEngine, task: Task | None = None) -> int:
        """KV-cache bytes the pool engine's sequences, and ``task`` if added, hold at most
        (:meth:`~mlx_tier.job.pool_engine.PoolEngine.kv_tokens`: the decode pool's buffer,
        every sequence at the longest's length, and the prompt caches of those being read or
        about to join it)."""
        sequences = engine.active + (task is not None)
        return int(self.plan.kv_per_token * engine.kv_tokens(task)) + sequences * self.plan.fixed_per_seq

    def _fits(self, task: Task, engine) -> bool:
        """Throughput schedule: whether ``task``'s KV cache fits beside those in flight (a task
        that does not waits for others to finish; alone, it runs: it was sized to fit)."""
        if self.config.schedule != "throughput" or not engine.active:
            return True
        return self._held_bytes(engine, task) <= self._kv_room

    def _pool_room(self, longest_chars: int | None) -> int:
        """Bytes for the KV caches of the sequences in flight: the memory plan's, less one
        prefill pool's transient against the longest prompt
        (:func:`mlx_tier.tools.pools.prefill_transient`)."""
        from mlx_tier.tools.pools import prefill_transient, shape_of

        longest = min(self.context, (predicted_tokens(longest_chars, None) if longest_chars else self.context)
                      + len(self.prefix) + 16)
        found = shape_of(self.model, self.plan.kv_per_token)
        if found is None:
            heads = int(getattr(getattr(self.model, "args", None), "num_attention_heads", 1) or 1)
            return self.plan.free_bytes - self.plan.prefill_fixed - 4 * heads * min(self.pool_tokens, longest) * longest
        return int(self.plan.free_bytes - self.plan.prefill_fixed - prefill_transient(found[0], self.pool_tokens, longest))

    def _prefix(self) -> PrefixCache | None:
        return self.prefix if self.config.reuse_prefix and len(self.prefix) > 1 else None

    def _most_pooled(self, limit: int) -> int:
        """The most sequences the throughput schedule's engine is given (at most ``limit``): its
        pool plan's most (:data:`~mlx_tier.tools.pools.MAX_DECODE_POOL`), or more where memory
        could hold more sequences of the shortest prompt and ``max_tokens``."""
        shortest = len(self.prefix) + 16 + self.config.max_tokens
        return min(limit, max(MAX_DECODE_POOL, self.plan.batch_size(shortest, limit)))

    def _memory_batch(self, longest_chars: int | None, limit: int = MAX_AUTO_BATCH) -> int:
        """The batch memory allows for sequences as long as the documents need (at most
        ``limit``): the longest prompt (estimated at 3 characters a token, erring long) plus
        ``max_tokens``, at most the usable context."""
        if longest_chars is None:
            return self.plan.batch_size(self.context, limit)
        longest = predicted_tokens(longest_chars, None) + len(self.prefix) + 16  # the sizing estimate
        return self.plan.batch_size(min(self.context, longest + self.config.max_tokens), limit)

    def _new_engine(self, batch_size: int) -> BatchEngine | PoolEngine:
        c = self.config
        if c.schedule == "throughput":
            return PoolEngine(self.model, self.tokenizer, self.stop_ids, batch_size=batch_size,
                              prefill_batch=self.prefill_batch, pool_tokens=self.pool_tokens,
                              repetition_penalty=c.repetition_penalty, prefix=self._prefix(), kv_bits=c.kv_bits,
                              decode_slots=self._decode_slots(batch_size))
        return BatchEngine(self.model, self.tokenizer, self.stop_ids, batch_size=batch_size,
                           repetition_penalty=c.repetition_penalty, prefill_step_size=c.prefill_step_size,
                           prefix=self._prefix(), step_cap=self.memory.prompt_step if self.memory else None)

    def _lend_idle_kv(self, engine) -> None:
        """Set the slots the pool engine lends its next decode step: the prompt step's idle
        workspace (:meth:`_decode_slots`) and the KV room no sequence in flight will hold, in
        whole slot rows. The sequences' share is counted at their longest
        (:meth:`_held_bytes`: the decode pool at the longest's length, the prompts read and
        joining) plus one layer's pool buffer, copied while the pool grows or a sequence
        joins; each row lent also reads ahead its layer's share
        (:func:`~mlx_tier.engine.footprint.read_ahead_bytes`). A document started later
        gets the room back before its KV cache exists (the prefill step that reads it
        takes every lent slot back first). In a job's tail, with a document or two left
        decoding, most of the KV share is lent: a lone sequence keeps to few experts from
        token to token (benches/results/throughput/NOTES.md, rounds 20 and 21)."""
        if not isinstance(engine, PoolEngine) or not self._lends():
            return
        cache = self.model.expert_cache
        idle = 0
        if footprint.LEND_KV_ROOM:
            held, layers = self._held_bytes(engine), len(cache.layers)
            spare = self._kv_room - held - held // layers
            idle = max(0, spare) // max(1, cache.slot_row_bytes + cache.slot_row_bytes // layers)
        engine.decode_slots = max(0, min(cache.lendable, self._decode_slots(engine.batch_size) + idle))

    def _lends(self) -> bool:
        """Whether the expert cache lends slots to decode steps (:meth:`_decode_slots`' conditions)."""
        cache = getattr(self.model, "expert_cache", None)
        return (footprint.LEND_SLOTS and self.memory is not None and not self.memory.cache_given
                and cache is not None and cache.can_lend and cache.slots_per_layer is not None)

    def _decode_slots(self, batch_size: int) -> int:
        """Expert slots per layer the pool engine lends its decode steps
        (:meth:`~mlx_tier.engine.footprint.MemoryBudget.decode_slots`: the prompt step's
        workspace they leave idle, for sequences of the longest document's length), at
        most the experts a layer has beyond its slots; 0 without a memory split or an
        expert cache, with per-layer slot counts (given or adaptive), where the user gave the
        cache's size, or where :data:`~mlx_tier.engine.footprint.LEND_SLOTS` is off."""
        from mlx_tier.tools.pool_cache import lent_slots

        if not self._lends():
            return 0  # per-layer slots (given or adaptive) are kept as they are
        n = lent_slots(self.memory, batch_size, min(self.context, self._longest + self.config.max_tokens))
        return max(0, min(n, self.model.expert_cache.lendable))

    def _context_now(self) -> int:
        """The usable context for a sequence starting now: memory now (sequences in
        flight already hold theirs), so a document that would not fit is split
        smaller, a request refused, instead of failing the process."""
        cache = getattr(self.model, "expert_cache", None)
        lent = getattr(cache, "lent_bytes", 0)
        now = replace(self.plan, free_bytes=sequence_room(self.memory, lent))
        return min(self.context, now.max_tokens())

    def _context_for(self, need: int, can_wait: bool) -> int:
        """:meth:`_context_now`, measured again without what the process freed but still holds
        (:func:`~mlx_tier.engine.sizes.release_freed_memory`: a finished pool's KV caches,
        the kernels' temporaries, ~45 ms) when ``need`` tokens do not fit as first measured:
        always before a document would be read in parts (else it splits or not by chance),
        at most every :data:`WAIT_RELEASE_S` before it would wait (else it waits on memory
        that is free)."""
        context = self._context_now()
        if need <= context or context >= self.context:  # fits, or memory is not what bounds it
            return context
        now = time.perf_counter()
        if can_wait and now - self._released_at < WAIT_RELEASE_S:
            return context
        self._released_at = now
        release_freed_memory()
        return self._context_now()

    def _tasks(self, d: _Doc, can_wait: bool = False) -> list[Task] | None:
        """The first calls of a document (raises TooLong, RequestError, or the tokenizer's
        errors); ``None`` when ``can_wait`` and the memory left now is what makes it not
        fit whole (sequences in flight will free theirs)."""
        if d.doc.request is not None:
            return self._request_tasks(d, can_wait)
        c = self.config
        prompt = build_prompt(self.tokenizer, c.instruction, d.doc.text)
        d.input_tokens = len(prompt)
        context = d.context = self._context_for(len(prompt) + c.max_tokens, can_wait)
        if len(prompt) + c.max_tokens <= context:
            return [Task((d, 0), prompt, c.max_tokens)]
        if can_wait and context < min(self.context, len(prompt) + c.max_tokens):
            return None
        d.mr = MapReduce(self.tokenizer, c.instruction, d.doc.text, self._prompt_limit(d, context - c.max_tokens),
                         c.max_tokens)
        return self._calls(d, d.mr.prompts())

    def _prompt_limit(self, d: _Doc, limit: int) -> int:
        """The most prompt tokens a call of the long document ``d`` takes: ``limit``, or the
        smaller limit an earlier run split it with (its calls kept: :attr:`parts`), so that a
        resumed run finds the same calls whatever memory it starts with."""
        if self.parts is None:
            return limit
        d.source = source_hash(d.doc)
        kept = self.parts.limit(d.doc.id, d.source)
        return kept if kept is not None and kept <= limit else limit

    def _calls(self, d: _Doc, calls: list[tuple[int, list[int]]]) -> list[Task] | Outcome:
        """The tasks of a map-reduce document's ``calls`` (``(index, prompt)``). A call a
        stopped run finished (:attr:`parts`) is not run again: its kept result is added at
        once, which may complete the level (its next calls are taken the same way) or the
        whole document (its outcome is returned). Raises TooLong or EmptyCall (:meth:`MapReduce.add`)."""
        while True:
            tasks, more, reason = [], [], None
            for i, prompt in calls:
                kept = self.parts.get(prompt) if self.parts is not None else None
                if kept is None:
                    tasks.append(Task((d, i), prompt, self.config.max_tokens))
                    continue
                d.kept += kept.earlier  # an earlier run's (a copy's calls in this run are not counted)
                d.kept_tokens += kept.tokens
                d.reasoning.append(kept.reasoning)
                more, reason = d.mr.add(i, kept.text) or more, kept.finish_reason
            if d.mr.summary is not None:
                return self._finish(d, d.mr.summary, reason or "stop")  # kept results are trimmed
            if not more:
                return tasks
            calls = more

    def _request_tasks(self, d: _Doc, can_wait: bool = False) -> list[Task] | None:
        """A batch request's calls, one per choice, as written: its prompt, its token limit
        (else ``config.max_tokens``, at most what the context leaves), its sampling;
        ``None`` when ``can_wait`` and only the memory held by sequences in flight keeps
        it from fitting now (with no limit of its own: from ``config.max_tokens``, as far
        as the usable context allows it).

        Raises:
            RequestError: the request's own problem, a prompt that cannot be built, or
                prompt and token limit beyond the usable context.
        """
        req = d.doc.request
        prompt = prompt_tokens(self.tokenizer, req, self.vocab_size)
        limit = req.plan.max_tokens
        want = limit or max(1, min(self.config.max_tokens, self.context - len(prompt)))  # the job's, as room allows
        d.input_tokens, d.context = len(prompt), self._context_for(len(prompt) + want, can_wait)
        room = d.context - len(prompt)
        if can_wait and room < want and self.context - len(prompt) >= want:  # memory in flight: it frees
            return None
        if room < (limit or 1):
            raise RequestError(f"the prompt ({len(prompt)} tokens) plus the token limit ({limit or 1}) exceed the "
                               f"usable context of {d.context} tokens", "max_tokens" if limit else "messages",
                               "context_length_exceeded")
        d.choices = [None] * req.plan.n
        return [Task((d, i), prompt, limit or min(self.config.max_tokens, room), replace(req.plan.sampling, stream=i))
                for i in range(req.plan.n)]

    def _failed(self, d: _Doc, error: str, code: str | None = None, param: str | None = None) -> Outcome:
        d.finished = True
        return Outcome(d.doc.id, "failed", input_tokens=d.input_tokens, parts=d.mr.parts if d.mr else 0,
                       seconds=d.seconds, error=error, error_code=code, error_param=param, kept=d.kept)

    def _no_summary(self, d: _Doc, what: str, reason: str | None) -> str:
        """Why a document failed whose summary (or ``what``: one of its map-reduce calls) came
        out empty: the token limit spent (``reason`` "length"; in the reasoning, for a reasoning
        model), or the model ended its answer without one (a larger limit would not help)."""
        outside = " outside the reasoning" if any(d.reasoning) else ""
        if reason != "length":
            return f"no summary{what}{outside}: the model ended its answer without one"
        return (f"no summary{what}{outside} within `max_tokens` {self.config.max_tokens}; retry with a larger "
                "`max_tokens` and `retry_failed`")

    def _level_failed(self, d: _Doc, error: TooLong | EmptyCall) -> Outcome:
        """A map-reduce document that cannot go on: too long for the context, or a call of a
        finished level that came out empty (nothing of that part would reach the summary)."""
        if isinstance(error, EmptyCall):
            return self._failed(d, self._no_summary(d, f" of {error.what}", d.empty.get(error.index)))
        return self._failed(d, f"document too long for the usable context of {d.context} tokens: {error}")

    def _answered(self, d: _Doc, f, index: int) -> Outcome | None:
        """A batch request's choice ``index`` finished (``f``); its outcome once every choice has."""
        text, reasoning = strip_reasoning(f.text, self.reasoning) if d.doc.request.url == CHAT else (f.text, "")
        counted = len(f.tokens) + isinstance(f.stop_reason, int)  # a stop token counts, as the API counts it
        d.output_tokens += counted  # report.json's figure is usage.completion_tokens of output.jsonl
        d.choices[index] = Choice(text, f.finish_reason, counted, f.stop_reason, reasoning)
        if any(c is None for c in d.choices):
            return None
        d.finished = True
        return Outcome(d.doc.id, "done", input_tokens=d.input_tokens, output_tokens=d.output_tokens,
                       finish_reason=d.choices[0].finish_reason, seconds=d.seconds, choices=list(d.choices))

    def _finish(self, d: _Doc, text: str, reason: str) -> Outcome:
        """The document's outcome from its summary ``text``, already trimmed to its last whole
        sentence where the token limit cut it (once: trimming is not idempotent, a number's
        dot ending the last sentence left would be taken for a cut)."""
        summary = text.strip()
        if not summary:
            return self._failed(d, self._no_summary(d, "", reason))
        d.finished = True
        return Outcome(d.doc.id, "done", summary, "\n\n".join(r for r in d.reasoning if r), d.input_tokens,
                       d.output_tokens + d.kept_tokens, reason, d.mr.parts if d.mr else 0,
                       d.mr.level + 1 if d.mr else 0, d.seconds, kept=d.kept, kept_tokens=d.kept_tokens)

    def run(self, docs: Iterable, should_stop: Callable[[], bool] = lambda: False,
            on_step: Callable[[StepInfo, list[str]], None] = lambda info, ids: None,
            on_layer: Callable[[int, list[tuple[str, int, int, int]]], None] = lambda layer, reading: None,
            give_up: Callable[[], bool] = lambda: False) -> Iterator[Outcome]:
        """Summarise ``docs`` (:class:`~mlx_tier.job.documents.Document` or
        :class:`~mlx_tier.job.documents.FileDocument`: anything with ``id``, ``text``
        and ``error``), yielding each outcome when final.

        ``docs`` is pulled one document at a time, when a batch place is free
        (the job runner converts each document then, and may pass a generator).

        Once ``should_stop()`` is true no new document starts, calls still
        reading their prompt are dropped, and the calls already generating
        finish (a map-reduce document not yet complete stays undone), unless
        ``give_up()`` turns true first: then every call in flight is dropped and
        the run ends (their documents yield nothing: they stay pending).
        ``on_step(info, ids in flight)`` runs after every engine step
        (``info.prefill``: ``(document id, prompt tokens done, prompt length)``).
        With the throughput schedule, a prefill step (a minute, on a slow
        machine) also calls ``on_layer(layer index, reading)`` before each MoE layer, where
        ``reading`` lists the step's prompt chunks as ``(document id, prompt tokens read
        before the step, tokens in this step, prompt length)``, and checks ``should_stop()``
        there: a stop then abandons the step at once.
        """
        try:
            yield from self._run(docs, should_stop, on_step, on_layer, give_up)
        finally:  # an error or a generator closed early: the slots lent to decode steps go back
            cache = getattr(self.model, "expert_cache", None)
            if getattr(cache, "lent", 0):
                cache.lend_slots(0)

    def _run(self, docs, should_stop, on_step, on_layer, give_up) -> Iterator[Outcome]:
        """:meth:`run`'s loop."""
        q = _Queues(_Pulled(docs))
        engine = self._new_engine(self.batch_size)
        abandoned = False
        while True:
            stopping = should_stop()
            if stopping and not abandoned:
                # Documents still reading their prompt are left for the next run
                # (a long prefill would delay the stop); those already writing finish.
                engine.cancel_unstarted()
                abandoned = True
            if q.alone is not None and q.alone.finished:
                q.alone = None
            if not stopping:
                yield from self._admit(engine, q)
            if not engine.active or (stopping and give_up()):
                if stopping or q.empty():
                    break
                continue
            in_flight = [t.key[0] for t in engine.tasks()]
            self._lend_idle_kv(engine)
            try:
                info = self._step(engine, should_stop, on_layer)
            except (CheckpointError, OSError) as e:  # expert reads: no later document could run either
                raise JobError(f"the checkpoint became unreadable ({e}); the job stopped, documents not "
                               "finished stay pending") from e
            except Exception as e:  # noqa: BLE001 - e.g. MLX out of memory inside a batched step
                engine = yield from self._after_failed_step(engine, e, in_flight, q)
                continue
            _charge_time(info)
            info.sequences = [(key, total) for key, _, total in info.prefill]  # before grouping by document
            info.decoding = list(info.generating)
            info.prefill = _by_document(info.prefill, info.generating)
            info.generating = [(key[0].doc.id, n) for key, n in info.generating]
            on_step(info, [d.doc.id for d in dict.fromkeys(in_flight)])
            yield from self._take_finished(info.finished, q.ready)
        engine.close()

    def _step(self, engine, should_stop, on_layer) -> StepInfo:
        """One engine step; a pool engine's prefill step is abandoned between layers on a stop
        (its prompts are left for the next run, as :meth:`BatchEngine.cancel_unstarted` leaves them)."""
        if not isinstance(engine, PoolEngine):
            return engine.step()
        def interrupt(layer: int) -> bool:
            on_layer(layer, [(key[0].doc.id, read, n, total) for key, read, n, total in engine.reading_now])
            return should_stop()

        info = engine.step(interrupt)
        engine.take_interrupted()  # its tasks' documents are left for the next run
        return info

    def _admit(self, engine: BatchEngine, q: _Queues) -> Iterator[Outcome]:
        """Fill the engine's free places: calls of started documents first, then the next
        document (a retried one alone, nothing else beside it); yields documents that fail
        as they start."""
        while engine.free:
            if q.ready:
                if not self._fits(q.ready[0], engine):
                    return  # its KV cache would not fit yet: it waits for a sequence to finish
                engine.add(q.ready.popleft())
                continue
            source = q.solo if q.solo else q.waiting
            if not source or q.alone is not None or (q.solo and engine.active):
                return
            d = _Doc(source.popleft(), time.perf_counter())
            if source is q.solo:
                q.alone = d
            started = self._start(d, can_wait=source is q.waiting and engine.active > 0)
            if started is None:  # no room for it now: it waits for a sequence to finish
                q.waiting.put_back(d.doc)
                return
            if isinstance(started, Outcome):
                yield started
            else:
                q.ready.extend(started)

    def _start(self, d: _Doc, can_wait: bool = False) -> list[Task] | Outcome | None:
        """A document's first calls, its failed outcome (unreadable, too long, tokenizer
        error), or ``None``: it waits (``can_wait``, :meth:`_tasks`)."""
        if d.doc.error is not None:
            return self._failed(d, d.doc.error)
        try:
            return self._tasks(d, can_wait)
        except RequestError as e:
            return self._failed(d, e.prose, e.code, e.field)
        except (TooLong, EmptyCall) as e:
            return self._level_failed(d, e)
        except Exception as e:  # noqa: BLE001 - one document's failure must not stop the job
            return self._failed(d, f"{type(e).__name__}: {e}")

    def _after_failed_step(self, engine: BatchEngine, error: Exception, in_flight: list, q: _Queues):
        """A batched step raised: the error cannot be pinned on one sequence, so every document
        in flight is retried alone (one alone fails with the error). Yields that failure;
        returns a fresh engine (the failed one's state is unknown)."""
        docs_in_flight = list(dict.fromkeys(in_flight + [t.key[0] for t in q.ready]))
        try:
            engine.close()
        except Exception:  # noqa: BLE001, S110
            pass
        q.ready.clear()
        self._clear_pending()
        engine = self._new_engine(self.batch_size)
        if len(docs_in_flight) == 1:
            yield self._failed(docs_in_flight[0], f"{type(error).__name__}: {error}")
        else:
            q.solo.extend(d.doc for d in docs_in_flight)
        return engine

    def _take_finished(self, finished, ready: deque) -> Iterator[Outcome]:
        """Outcomes of the calls that finished in a step: a document's summary, or
        for a map-reduce document its next calls (queued first in ``ready``). Every
        map-reduce call of the step is kept (:attr:`parts`) before the first outcome is
        yielded: a stop or a crash while an outcome is written loses no finished call."""
        results = {}  # key -> (reasoning, the text: cut to its last sentence where the limit cut it)
        for f in finished:
            d, index = f.key
            if d.choices is None:
                summary, reasoning = strip_reasoning(f.text, self.reasoning)
                text = trim_to_sentence(summary) if f.finish_reason == "length" else summary
                results[f.key] = reasoning, text
                if d.mr is not None and self.parts is not None:  # an empty one is kept, never reused
                    self.parts.keep(d.mr.prompt(index), KeptCall(d.doc.id, text, reasoning, len(f.tokens),
                                                                 f.finish_reason, d.mr.prompt_limit, d.source))
        for f in finished:
            d, index = f.key
            if d.choices is not None:
                done = self._answered(d, f, index)
                if done is not None:
                    yield done
                continue
            d.output_tokens += len(f.tokens)
            reasoning, text = results[f.key]
            d.reasoning.append(reasoning)
            if d.mr is None:
                yield self._finish(d, text, f.finish_reason)
                continue
            if not text.strip():
                d.empty[index] = f.finish_reason
            try:
                more = d.mr.add(index, text)
                if d.mr.summary is not None:
                    yield self._finish(d, d.mr.summary, f.finish_reason)
                    continue
                tasks = self._calls(d, more) if more else []
            except (TooLong, EmptyCall) as e:
                yield self._level_failed(d, e)
                continue
            if isinstance(tasks, Outcome):
                yield tasks
            else:
                ready.extendleft(reversed(tasks))

    def _clear_pending(self) -> None:
        """Forget lazy expert outputs of a failed step (they would fail again when evaluated)."""
        cache = getattr(self.model, "expert_cache", None)
        for layer in getattr(cache, "layers", []):
            layer.discard_pending()
