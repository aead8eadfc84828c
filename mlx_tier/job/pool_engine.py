"""The throughput schedule's executor: large token pools per layer step.

An MoE layer step that carries few tokens sends a token or less to each expert
it reads (128 experts, top-8, 8 sequences: ~0.5), so every expert read and
every expert's dequantised weights serve almost nothing. Offline engines get
their throughput from large pools instead: MoE-Gen (arXiv 2503.09716)
accumulates tokens and runs the expert modules on large batches of their own
size; FlexGen's zig-zag schedule loads a layer once for a block of sequences;
MoE-Lightning (arXiv 2411.11217) sizes those batches with a roofline model.
Here, on mlx-lm's own batch primitives (``PromptProcessingBatch``,
``GenerationBatch``: its masks, caches and sampling, not a fork of them), run
side by side with their expert blocks merged (MoE-Gen's module batching:
:mod:`mlx_tier.engine.module_batch`; attention runs per pass on its own KV
caches, each tiered expert block once on the rows of every pass), a step is
one of:

- a **prefill step**: ``pool_tokens`` prompt tokens, taken from the prompts
  being read in the order they started and then from waiting ones (at most
  ``prefill_batch`` read at once): a prompt that ends inside a step leaves the
  rest of the pool to the next one, so steps stay full. Each prompt's chunk is
  its own pass (no padding: prompts of different lengths never share a padded
  batch), and each expert the tiered layer fetches is computed once for the
  whole pool (the CPU kernel's GEMM path: rows grouped by expert, dequantised
  once);
- a **decode step**: every generating sequence (up to ``batch_size``) decodes
  one token together.

With ``merge`` (the default) a prefill step also decodes every generating
sequence, as one more pass: the decode pool's experts ride on the prompt
pool's reads and GEMMs instead of being fetched again in a decode step of
their own. A merged step's time is split between its prompt tokens and its
generated tokens by their count (its rows in the expert blocks).

Which step comes next (:meth:`PoolEngine.step`): prompts being read are read
to their end. With ``merge``, waiting prompts are read at once (the pool
decodes in the same steps). Without, the decode pool is filled before it
decodes: waiting prompts are read once a whole prefill batch waits, or when the
decode pool has fallen below half its size (or is empty); otherwise the pool
decodes. So decode steps run on a pool near its chosen size instead of on each
prompt batch as it arrives (alternating steps decoded 3, 6, 9... sequences
while a folder's first prompts were read: a generated token cost ~2x a full
pool's). Sizes come from :mod:`mlx_tier.tools.pools`; this module only
executes them.

Decode steps borrow slots: a layer of a prompt pool reads nearly every expert
whatever the slots hold, while a decode pool's few sequences each keep to a
few experts from token to token (routing is sticky: ~0.9 of a token's experts
were its previous token's on the 8 GB synthetic), so slots pay in decode steps,
and the workspace a prompt step needs sits idle in them. ``decode_slots``
lends that room to the expert cache as extra slots before a decode step and
takes it back before the next prefill step
(:meth:`~mlx_tier.engine.expert_cache.ExpertCache.lend_slots`; MoE-Gen, arXiv
2503.09716, sizes prefill and decode apart). With kernel ``mlx`` the tokens do not
depend on it; with the CPU kernel a layer's rounds follow its slots, so the
experts' outputs are summed in another order (within its stated bound).

Long steps stay responsive: a prefill step carries at most the prompt tokens
whose layer step takes about :data:`LAYER_SECONDS`, as measured on this
machine's steps (:class:`~mlx_tier.job.batch_engine.PrefillPacer`; the first
step carries :data:`FIRST_POOL_TOKENS`, each next one at most twice the last),
so the pool planned from the probes is reached in a few steps where it is
quick enough, and a model slower than they say gets smaller pools. During a
prefill step ``interrupt(layer)`` is asked before each tiered MoE layer; true
abandons the prompt passes there, and
the prompts being read are dropped (returned by
:meth:`PoolEngine.take_interrupted`), as a stop drops prompts still being read
in the paced schedule. Decode steps are never interrupted (a token half
computed would be lost): in a merged step the decode pass finishes its layers
alone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_tier.defaults import DEFAULT_PREFILL_STEP
from mlx_tier.engine.footprint import KV_STEP, check_kv_bits
from mlx_tier.engine.module_batch import Pass, run_together
from mlx_tier.engine.sizes import release_freed_memory
from mlx_tier.job.batch_engine import (
    Finished,
    PrefillPacer,
    PrefixCache,
    StepInfo,
    Task,
    check_add,
    start_of,
)
from mlx_tier.job.pool_kv import (
    ROOM_SLACK,
    in_place_pool,
    make_room,
    make_roomy,
    settle,
)
from mlx_tier.job.quantized_kv import quantizing

# Module batching on by default (module doc); benches/throughput.py turns it off to
# measure what it buys.
MODULE_BATCHING = True
# Wall time one layer step of a prefill step should take at most: a stop is asked
# between layers, so it acts within about this. The benches' planned pools (the demo's
# and the synthetic's under a 2 GiB cap) take a small fraction of it a layer here.
LAYER_SECONDS = 4.0
# Prompt tokens of the first prefill step, before any step is measured.
FIRST_POOL_TOKENS = 256


@dataclass(eq=False)
class _Seq:
    """One sequence in the engine.

    ``rest`` is the prompt still to read except its last token (``last``),
    which mlx-lm feeds as the first decode input.
    """

    uid: int
    task: Task
    rest: list[int]
    last: int
    cache: list
    seen: list[int]
    processors: list
    prefix_tokens: int
    started: float
    read: int = 0  # prompt tokens read so far, the shared prefix not counted
    batch: object = None  # its PromptProcessingBatch while its prompt is read
    tokens: list[int] = field(default_factory=list)


class PoolEngine:
    """Prefill pools and decode pools over mlx-lm's batch primitives (greedy).

    Same interface as :class:`~mlx_tier.job.batch_engine.BatchEngine`
    (:meth:`add` while :attr:`free` > 0, then :meth:`step`), so the scheduler
    drives either.

    Args:
        model, tokenizer: from :func:`mlx_tier.load` (or ``mlx_lm.load``).
        stop_ids: end-of-sequence token ids.
        batch_size: most sequences in the engine (the decode pool), >= 1.
        prefill_batch: most prompts read at once (in one prefill step), >= 1.
        pool_tokens: prompt tokens per prefill step, over all its prompts.
        repetition_penalty: mlx-lm's (its context includes the prompt).
        prefix: a shared prefix's KV cache, copied into each prompt that starts with it.
        kv_bits: store the pools' KV caches quantized to these bits
            (:mod:`mlx_tier.job.quantized_kv`: ~0.28x float32's bytes at 8;
            tokens may differ from an unquantized cache); ``None``: as mlx-lm
            stores them.
        merge: decode the generating sequences in each prefill step's layer
            steps (module doc); ``False``: prefill and decode steps apart;
            ``None``: :data:`MODULE_BATCHING`.
        layer_seconds: aim of a prefill step's time per decoder layer (module doc);
            ``None``: every prefill step carries ``pool_tokens`` (unpaced).
        decode_slots: expert slots per layer lent to the expert cache for decode steps,
            taken back before a prefill step (module doc); 0: none.

    Raises:
        ValueError: a size below 1.
        ConfigError: ``kv_bits`` not one of :data:`~mlx_tier.defaults.KV_BITS`.
    """

    def __init__(self, model, tokenizer, stop_ids, *, batch_size: int = 32, prefill_batch: int = 8,
                 pool_tokens: int = DEFAULT_PREFILL_STEP, repetition_penalty: float = 1.0,
                 prefix: PrefixCache | None = None, kv_bits: int | None = None, merge: bool | None = None,
                 layer_seconds: float | None = LAYER_SECONDS, decode_slots: int = 0):
        from mlx_lm.generate import GenerationBatch, StopSequences
        from mlx_lm.sample_utils import greedy_sampler

        check_kv_bits(kv_bits)

        if min(batch_size, prefill_batch, pool_tokens) < 1:
            raise ValueError(f"pool sizes must be >= 1, got batch {batch_size}, prefill batch {prefill_batch}, "
                             f"pool tokens {pool_tokens}")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.prefill_batch, self.pool_tokens = batch_size, prefill_batch, pool_tokens
        self.repetition_penalty, self.prefix, self.kv_bits = repetition_penalty, prefix, kv_bits
        self.merge = MODULE_BATCHING if merge is None else merge
        self.pacer = None if layer_seconds is None else PrefillPacer(
            pool_tokens, layer_seconds * _layers(model), min_tokens=16, first_tokens=FIRST_POOL_TOKENS)
        self._asked = pool_tokens  # prompt tokens the last prefill step was given room for
        self.decode_slots = max(0, decode_slots)
        self._lend_cap = 1 << 30  # most slots a growth may lend (lowered when one fails: _lend_slots)
        self._stops = StopSequences([[t] for t in sorted(stop_ids)])
        self._sampler = greedy_sampler
        self._gen = GenerationBatch.empty(model, greedy_sampler)
        in_place_pool(self._gen)  # finishes move one KV row each (job/pool_kv.py)
        self._waiting: deque[_Seq] = deque()
        self._reading: list[_Seq] = []  # prompts being read, in the order they started
        self._starting: list[_Seq] = []  # prompts read to their end: they start generating next step
        self._generating: dict[int, _Seq] = {}
        self._interrupted: list[Task] = []
        # The prefill step under way: (task key, prompt tokens read before it, its chunk's
        # tokens, prompt length) of each prompt it reads; empty between steps.
        self.reading_now: list[tuple[tuple, int, int, int]] = []
        self._uid = 0

    @property
    def free(self) -> int:
        return self.batch_size - self.active

    @property
    def active(self) -> int:
        return len(self._waiting) + len(self._reading) + len(self._starting) + len(self._generating)

    def add(self, task: Task) -> None:
        """Queue ``task``; its prompt is read in a coming prefill step.

        Raises:
            ValueError: no free place, or an empty prompt.
        """
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.sample_utils import make_logits_processors

        check_add(self.free, task)
        prompt, cache, seen, used = start_of(self.prefix, task.prompt)
        procs = make_logits_processors(repetition_penalty=self.repetition_penalty) \
            if self.repetition_penalty != 1.0 else []
        cache = quantizing(cache if cache is not None else make_prompt_cache(self.model), self.kv_bits)
        self._waiting.append(_Seq(self._uid, task, list(prompt[:-1]), prompt[-1], cache, seen, procs, used,
                                  time.perf_counter()))
        self._uid += 1

    def _prefill_next(self) -> bool:
        """Whether the next step reads prompts (module doc: the pool is filled, then decoded)."""
        if self._reading:
            return True
        if not self._waiting:
            return False
        if self.merge:
            return True
        return (len(self._waiting) >= self.prefill_batch or not self._generating
                or len(self._generating) < self.batch_size / 2)

    def step(self, interrupt: Callable[[], bool] | None = None) -> StepInfo:
        """One prefill step or one decode step (:meth:`_prefill_next` chooses).

        Args:
            interrupt: ``interrupt(layer index)``, asked before each tiered MoE layer
                of a prefill step; true abandons the step (its prompts go to
                :meth:`take_interrupted`).
        """
        from mlx_lm.generate import generation_stream

        with mx.stream(generation_stream):
            return self._prefill_step(interrupt) if self._prefill_next() else self._decode_step()

    def _lend_slots(self, extra: int) -> None:
        """Lend the expert cache ``extra`` slots a layer (module doc), the memory the last
        steps freed handed back first where slots grow, the lent slabs' after they shrink.
        Slots lent are spare: a growth that fails for memory leaves those lent before, and
        no later step asks for more than that. Called inside the step it serves: its time
        is the step's."""
        cache = getattr(self.model, "expert_cache", None)
        extra = min(extra, self._lend_cap)
        if cache is None or not getattr(cache, "can_lend", False) or cache.lent == extra:
            return
        if extra < cache.lent:
            cache.lend_slots(extra)
            release_freed_memory()
            return
        release_freed_memory()
        try:
            cache.lend_slots(extra)
        except (MemoryError, RuntimeError):  # the layers are back as lent before (ExpertCache.lend_slots)
            self._lend_cap = cache.lent

    def _begin(self, s: _Seq) -> None:
        """Start reading ``s``'s prompt: its own ``PromptProcessingBatch`` (one prompt: no padding)."""
        from mlx_lm.generate import PromptProcessingBatch

        s.batch = PromptProcessingBatch(
            self.model, [s.uid], [s.cache], tokens=[list(s.seen)], prefill_step_size=1 << 30,
            fallback_sampler=self._sampler, samplers=[None], logits_processors=[s.processors],
            stop_sequences=[self._stops], max_tokens=[s.task.max_tokens])
        self._reading.append(s)

    def _chunks(self) -> list[tuple[_Seq, list[int]]]:
        """This step's prompt chunks: the prompts being read, in the order they started, then
        waiting ones (started here while fewer than ``prefill_batch`` are read), each as
        many tokens as the pool has left."""
        left = self._asked = self.pool_tokens if self.pacer is None else self.pacer.size()
        chunks = []
        for s in self._reading:
            if left > 0 and s.rest:
                chunks.append((s, s.rest[:left]))
                left -= len(chunks[-1][1])
        while left > 0 and self._waiting and len(self._reading) < self.prefill_batch:
            s = self._waiting.popleft()
            self._begin(s)
            if s.rest:
                chunks.append((s, s.rest[:left]))
                left -= len(chunks[-1][1])
        return chunks  # a prompt of one token is started with no chunk: nothing to read

    def _prefill_step(self, interrupt) -> StepInfo:
        """Read the pool's prompt chunks (with ``merge``, decoding the generating sequences in
        the same layer steps); prompts read to their last token start generating in the next step."""
        info = StepInfo()
        t0 = time.perf_counter()
        self._lend_slots(0)
        t1 = time.perf_counter()  # the pacer sizes the layers' time, not the slots' hand-back
        chunks = self._chunks()
        self.reading_now = [(s.task.key, s.read, len(c), len(s.task.prompt) - s.prefix_tokens) for s, c in chunks]
        try:
            done = self._run(chunks, self.merge, interrupt, info)
        finally:
            self.reading_now = []
        if done:
            info.prefill_tokens = sum(len(c) for _, c in chunks)
            if self.pacer is not None and info.prefill_tokens == self._asked:
                # only full steps: one cut short by the prompts left (a prompt's tail) would
                # hold the next ones to twice its size
                self.pacer.observe(self._asked, time.perf_counter() - t1)
            for s, chunk in chunks:
                del s.rest[: len(chunk)]
                s.read += len(chunk)
            info.prefill = [(s.task.key, s.read, len(s.task.prompt) - s.prefix_tokens) for s in self._reading]
            self._starting += [s for s in self._reading if not s.rest]
            self._reading = [s for s in self._reading if s.rest]
        _split_time(info, time.perf_counter() - t0)
        return info

    def _decode_step(self) -> StepInfo:
        info = StepInfo()
        t0 = time.perf_counter()
        self._lend_slots(self.decode_slots)
        self._run([], True, None, info)
        info.seconds = info.decode_seconds = time.perf_counter() - t0
        return info

    def _run(self, chunks: list[tuple[_Seq, list[int]]], decode: bool, interrupt, info: StepInfo) -> bool:
        """One step's forward passes, their expert blocks computed together
        (:func:`~mlx_tier.engine.module_batch.run_together`): one for each prompt chunk, the
        decode pool's step (``decode`` and sequences generating: its tokens go to ``info``),
        and the first decode input of each sequence whose prompt the last step read to its
        end (mlx-lm's ``GenerationBatch`` computes it as it starts; it joins the pool then).
        ``False``: interrupted (every prompt being read is dropped; the other passes complete)."""
        stop = _LayerStop(interrupt)
        # The pool's targets for a growth: rows for the sequences the engine holds now (those the
        # scheduler admitted, not the planned pool), room for the longest (finishes lower them).
        make_roomy(self._gen.prompt_cache or [], self.active, self._longest())
        reads = [Pass(lambda s=s, c=c: s.batch.prompt([c]), stop=stop) for s, c in chunks]
        starts = [Pass(lambda s=s: s.batch.generate([[s.last]])) for s in self._starting]
        step = None
        if decode and self._generating:
            make_room(self._gen)  # between steps: the pool's rows may move left (job/pool_kv.py)
            step = Pass(self._gen.next)
        run_together(reads + starts + ([step] if step is not None else []))
        for s, started in zip(self._starting, starts):
            settle(self._gen)  # a join writes into the pool's KV cache in place
            self._gen.extend(started.result)  # a growth sized by the targets set above
            make_roomy(self._gen.prompt_cache, self.active, self._longest())  # the first join made the buffer
            s.batch = None
            self._generating[s.uid] = s
        if starts:  # the joins' copies made now: until then they keep the joiners' caches (and a grown-from buffer)
            mx.eval([a for c in self._gen.prompt_cache for a in _kv_arrays([c])])
        self._starting = []
        if step is not None:
            self._take(step.result, info)
            info.merged = bool(chunks)
        if not stop.stopped:
            return True
        self._drop_reading()
        if step is None and not starts:  # nothing went on past the stop: the layers' last outputs are not needed
            for layer in getattr(getattr(self.model, "expert_cache", None), "layers", []):
                layer.discard_pending()
        return False

    def _longest(self) -> int:
        """Tokens the longest sequence in the engine may reach (its prompt and ``max_tokens``):
        the decode pool's KV cache makes room for it once (job/pool_kv.py)."""
        seqs = [*self._waiting, *self._reading, *self._starting, *self._generating.values()]
        return max((len(s.task.prompt) + s.task.max_tokens for s in seqs), default=0)

    def kv_tokens(self, extra: Task | None = None) -> int:
        """The most KV slots (one sequence's keys and values at one token position, every
        layer) the engine's caches hold with its sequences and ``extra`` (a task that may be
        added): the decode pool's buffer as it is, or as a growth makes it anew (a row for
        each sequence, :data:`~mlx_tier.job.pool_kv.ROOM_SLACK` columns beyond the longest,
        or its last written column rounded up to :data:`~mlx_tier.engine.footprint.KV_STEP`
        if further; ``KV_STEP`` beyond the longest for a quantized pool, mlx-lm's growth),
        plus the own prompt caches of sequences not in the pool yet (each its prompt, grown
        in ``KV_STEP`` steps): at most ``2 x prefill_batch`` at once, those being read and
        those read that join in the next step, so the longest prompts of that many. Not
        counted: while a growth copies, one layer's old buffer; a quantized join's copy."""
        tasks = self.tasks() + ([extra] if extra is not None else [])
        if not tasks:
            return 0
        longest = max(len(t.prompt) + t.max_tokens for t in tasks)
        layer = next((c for c in self._gen.prompt_cache or [] if _kv_arrays([c])), None)
        keys = _kv_arrays([layer])[0] if layer is not None else None
        now = keys.shape[0] * keys.shape[2] if keys is not None else 0  # [rows, heads, columns, ...]
        columns = longest + (ROOM_SLACK if self.kv_bits is None else KV_STEP)
        written = getattr(layer, "_idx", 0) + 1  # the next step's column
        if written > columns:
            columns = -(-written // KV_STEP) * KV_STEP
        pool = max(now, len(tasks) * columns)
        unjoined = [s.task for s in self._unjoined()] + ([extra] if extra is not None else [])
        prompts = sorted((len(t.prompt) for t in unjoined), reverse=True)[: 2 * self.prefill_batch]
        return pool + sum(p + KV_STEP for p in prompts)

    def _unjoined(self) -> list[_Seq]:
        """Sequences not in the decode pool yet (waiting, being read, about to start)."""
        return [*self._waiting, *self._reading, *self._starting]

    def kv_bytes(self) -> int:
        """Bytes of the engine's KV cache arrays now: the decode pool's (their spare rows and
        columns included) and the prompt caches of the sequences not in it yet, by their
        shapes (a buffer an array only views, or one a lazy copy still reads, not seen:
        ``mx.get_active_memory`` sees those)."""
        seen, total = set(), 0
        caches = [self._gen.prompt_cache or [], *(s.batch.prompt_cache or [] for s in self._unjoined() if s.batch)]
        for cache in caches:
            for a in _kv_arrays(cache):
                if id(a) not in seen:
                    seen.add(id(a))
                    total += a.nbytes
        return total

    def _drop_reading(self) -> None:
        """Abandon the prompts being read (an interrupt): their tasks go to :meth:`take_interrupted`."""
        self._interrupted.extend(s.task for s in self._reading)
        self._reading = []

    def _take(self, responses, info: StepInfo) -> None:
        """A decode step's responses into ``info``: tokens kept, sequences finished."""
        info.generated = len(responses)
        for r in responses:
            s = self._generating[r.uid]
            if r.finish_reason != "stop":
                s.tokens.append(r.token)
            if r.finish_reason is None:
                info.generating.append((s.task.key, len(s.tokens)))
                continue
            del self._generating[r.uid]
            info.finished.append(Finished(s.task.key, s.tokens, self.tokenizer.decode(s.tokens), r.finish_reason,
                                          time.perf_counter() - s.started, s.prefix_tokens))

    def take_interrupted(self) -> list[Task]:
        """Tasks whose prompt reading an interrupt abandoned (since the last call)."""
        tasks, self._interrupted = self._interrupted, []
        return tasks

    def tasks(self) -> list[Task]:
        """The tasks in the engine."""
        return [s.task for s in (*self._waiting, *self._reading, *self._starting, *self._generating.values())]

    def cancel_unstarted(self) -> list[Task]:
        """Drop the sequences that have not produced a token yet (waiting, reading their
        prompt or about to start generating); returns their tasks."""
        tasks = [s.task for s in (*self._waiting, *self._reading, *self._starting)]
        self._waiting.clear()
        self._reading, self._starting = [], []
        return tasks

    def cancel(self) -> list[Task]:
        """Drop every sequence; returns their tasks."""
        from mlx_lm.generate import GenerationBatch

        tasks = self.cancel_unstarted() + [s.task for s in self._generating.values()]
        self._generating.clear()
        self._gen = GenerationBatch.empty(self.model, self._sampler)
        in_place_pool(self._gen)
        return tasks

    def close(self) -> None:
        self.cancel()
        self._lend_slots(0)


def _split_time(info: StepInfo, seconds: float) -> None:
    """``seconds`` of a prefill step into ``info``: split between its prompt tokens and its
    generated tokens (a merged step) by their count."""
    info.seconds = seconds
    done = info.prefill_tokens + info.generated
    info.prefill_seconds = seconds * info.prefill_tokens / done if done else seconds
    info.decode_seconds = seconds - info.prefill_seconds


def _kv_arrays(cache: list) -> list:
    """The key and value buffers of a prompt cache's layers (a quantized layer's codes,
    scales and biases; a ``CacheList``'s members)."""
    out = []
    for c in cache:
        if hasattr(c, "caches"):
            out += _kv_arrays(list(c.caches))
            continue
        for a in (getattr(c, "keys", None), getattr(c, "values", None)):
            out += [x for x in (a if isinstance(a, (tuple, list)) else [a]) if isinstance(x, mx.array)]
    return out


def _layers(model) -> int:
    """Decoder layers of ``model`` (an mlx-lm model, or one from :func:`mlx_tier.load`).

    Raises:
        ValueError: neither ``layers`` nor an expert cache to count them by.
    """
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = getattr(getattr(model, "expert_cache", None), "layers", None)
    if not layers:
        raise ValueError("the model has no `layers` to pace prompt pools by (pass layer_seconds=None)")
    return len(layers)


class _LayerStop:
    """A prompt pass's ``stop``: ``interrupt(layer)`` asked once a layer (for the first pass
    there); once true, every prompt pass stops."""

    def __init__(self, interrupt: Callable[[int], bool] | None):
        self.interrupt, self.asked, self.stopped = interrupt, set(), False

    def __call__(self, layer: int) -> bool:
        if not self.stopped and self.interrupt is not None and layer not in self.asked:
            self.asked.add(layer)
            self.stopped = bool(self.interrupt(layer))
        return self.stopped
