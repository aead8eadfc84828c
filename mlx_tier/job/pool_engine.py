"""The throughput schedule's executor: large token pools per layer step.

An MoE layer step that carries few tokens sends a token or less to each expert
it reads (128 experts, top-8, 8 sequences: ~0.5), so every expert read and
every expert's dequantised weights serve almost nothing. Offline engines get
their throughput from large pools instead: MoE-Gen (arXiv 2503.09716)
accumulates tokens and runs the expert modules on large batches of their own
size; FlexGen's zig-zag schedule loads a layer once for a block of sequences;
MoE-Lightning (arXiv 2411.11217) sizes those batches with a roofline model.
Here, on mlx-lm's own batch primitives (``PromptProcessingBatch``,
``GenerationBatch``: its padding, masks and caches, not a fork of them), a
step is one of:

- a **prefill step**: up to ``prefill_batch`` prompts read together, each a
  chunk of ``pool_tokens / n`` tokens (right-padded by mlx-lm to one length),
  so a layer step carries ``pool_tokens`` prompt tokens and each expert the
  tiered layer fetches is computed once for all of them (the CPU kernel's
  GEMM path: rows grouped by expert, dequantised once);
- a **decode step**: every generating sequence (up to ``batch_size``) decodes
  one token together.

With ``merge`` (the default) a prefill step also decodes every generating
sequence, in the same layer steps: MoE-Gen's module batching
(:mod:`mlx_tier.engine.module_batch`). Attention runs per batch (the prompt
chunk's and the decode pool's own KV caches); each tiered expert block runs
once on the rows of both, so the decode pool's experts ride on the prompt
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
pool's), and prompt batches stay whole while finished sequences free their
places one by one. Sizes come from :mod:`mlx_tier.tools.pools`; this module
only executes them.

Long steps stay responsive: during a prefill step a hook runs before each
tiered MoE layer (:meth:`mlx_tier.engine.cache.ExpertCache.set_layer_hook`);
``interrupt()`` true there abandons the step, and the prompts being read
are dropped (returned by :meth:`PoolEngine.take_interrupted`), as a stop
drops prompts still being read in the paced schedule. Decode steps are never
interrupted (a token half computed would be lost): in a merged step the
decode pass finishes its layers alone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_tier.defaults import DEFAULT_PREFILL_STEP
from mlx_tier.engine.footprint import check_kv_bits
from mlx_tier.engine.module_batch import Pass, run_together
from mlx_tier.job.batch_engine import (
    Finished,
    PrefixCache,
    StepInfo,
    Task,
    check_add,
    start_of,
)
from mlx_tier.job.quantized_kv import quantizing

# Module batching on by default (module doc); benches/throughput.py turns it off to
# measure what it buys.
MODULE_BATCHING = True


class StepInterrupted(Exception):
    """Raised by the layer hook to abandon a prefill step (a stop request)."""


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
        prefill_batch: most prompts read together in one prefill step, >= 1.
        pool_tokens: prompt tokens per prefill step, over all its prompts
            (each prompt's chunk is ``pool_tokens // prompts``, at least 1).
        repetition_penalty: mlx-lm's (its context includes the prompt).
        prefix: a shared prefix's KV cache, copied into each prompt that starts with it.
        kv_bits: store the pools' KV caches quantized to these bits
            (:mod:`mlx_tier.job.quantized_kv`: ~0.28x float32's bytes at 8;
            tokens may differ from an unquantized cache); ``None``: as mlx-lm
            stores them.
        merge: decode the generating sequences in each prefill step's layer
            steps (module doc); ``False``: prefill and decode steps apart;
            ``None``: :data:`MODULE_BATCHING`.

    Raises:
        ValueError: a size below 1.
        ConfigError: ``kv_bits`` not one of :data:`~mlx_tier.defaults.KV_BITS`.
    """

    def __init__(self, model, tokenizer, stop_ids, *, batch_size: int = 32, prefill_batch: int = 8,
                 pool_tokens: int = DEFAULT_PREFILL_STEP, repetition_penalty: float = 1.0,
                 prefix: PrefixCache | None = None, kv_bits: int | None = None, merge: bool | None = None):
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
        self._stops = StopSequences([[t] for t in sorted(stop_ids)])
        self._sampler = greedy_sampler
        self._gen = GenerationBatch.empty(model, greedy_sampler)
        self._waiting: deque[_Seq] = deque()
        self._prompt = None  # PromptProcessingBatch of the prompts being read, or None
        self._reading: list[_Seq] = []  # aligned with self._prompt.uids
        self._generating: dict[int, _Seq] = {}
        self._interrupted: list[Task] = []
        self._uid = 0

    @property
    def free(self) -> int:
        return self.batch_size - self.active

    @property
    def active(self) -> int:
        return len(self._waiting) + len(self._reading) + len(self._generating)

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

    def _start_prompts(self) -> None:
        """Move up to ``prefill_batch`` waiting sequences into the prompt batch (when it is empty)."""
        from mlx_lm.generate import PromptProcessingBatch

        if self._reading or not self._waiting:
            return
        take = [self._waiting.popleft() for _ in range(min(self.prefill_batch, len(self._waiting)))]
        self._reading = take
        self._prompt = PromptProcessingBatch(
            self.model, [s.uid for s in take], [s.cache for s in take], tokens=[list(s.seen) for s in take],
            prefill_step_size=1 << 30, fallback_sampler=self._sampler, samplers=[None] * len(take),
            logits_processors=[s.processors for s in take], stop_sequences=[self._stops] * len(take),
            max_tokens=[s.task.max_tokens for s in take])

    def _prefill_step(self, interrupt) -> StepInfo:
        """Read one chunk of every prompt in the prompt batch (with ``merge``, decoding the
        generating sequences in the same layer steps); prompts read to their last token
        move to the generation batch."""
        info = StepInfo()
        self._start_prompts()
        t0 = time.perf_counter()
        chunk = max(1, self.pool_tokens // len(self._reading))
        parts = [s.rest[:chunk] for s in self._reading]
        if not any(parts) or self._read(parts, interrupt, info):
            for s, part in zip(self._reading, parts):
                del s.rest[: len(part)]
                s.read += len(part)
            info.prefill_tokens = sum(len(p) for p in parts)
            info.prefill = [(s.task.key, s.read, len(s.task.prompt) - s.prefix_tokens) for s in self._reading]
            self._to_generation()
        _split_time(info, time.perf_counter() - t0)
        return info

    def _read(self, parts: list[list[int]], interrupt, info: StepInfo) -> bool:
        """Read ``parts``; with ``merge`` and sequences generating, their decode step runs
        in the same layer steps (its tokens go to ``info``). ``False``: interrupted (the
        prompt batch is dropped; a merged decode step still completes)."""
        if not (self.merge and self._generating):
            return self._run_prompt(parts, interrupt)
        prompt = Pass(lambda: self._prompt.prompt(parts), stop=interrupt)
        decode = Pass(self._gen.next)
        run_together([prompt, decode])
        self._take(decode.result, info)
        info.merged = True
        if prompt.stopped_at is None:
            return True
        self._drop_reading()
        return False

    def _run_prompt(self, parts: list[list[int]], interrupt) -> bool:
        """``PromptProcessingBatch.prompt`` under the layer hook; an interrupt drops the prompt
        batch (returns ``False``)."""
        cache = getattr(self.model, "expert_cache", None)
        cache = cache if hasattr(cache, "set_layer_hook") else None
        hook = None
        if interrupt is not None:
            def hook(layer: int) -> None:
                if interrupt(layer):
                    raise StepInterrupted

        if cache is not None:
            cache.set_layer_hook(hook)
        try:
            self._prompt.prompt(parts)
            return True
        except StepInterrupted:
            self._drop_reading()
            for layer in getattr(cache, "layers", []):
                layer.discard_pending()
            return False
        finally:
            if cache is not None:
                cache.set_layer_hook(None)

    def _drop_reading(self) -> None:
        """Abandon the prompts being read (an interrupt): their tasks go to :meth:`take_interrupted`."""
        self._interrupted.extend(s.task for s in self._reading)
        self._reading, self._prompt = [], None

    def _to_generation(self) -> None:
        """Sequences whose prompt is read (all but the last token) start generating: their
        first decode input is computed now, as mlx-lm's batch generator does."""
        done = [i for i, s in enumerate(self._reading) if not s.rest]
        if not done:
            return
        keep = [i for i in range(len(self._reading)) if i not in done]
        moving = [self._reading[i] for i in done]
        batch = self._prompt.split(done).generate([[s.last] for s in moving])
        self._gen.extend(batch)
        for s in moving:
            self._generating[s.uid] = s
        self._reading = [self._reading[i] for i in keep]
        if not self._reading:
            self._prompt = None

    def _decode_step(self) -> StepInfo:
        info = StepInfo()
        t0 = time.perf_counter()
        self._take(self._gen.next(), info)
        info.seconds = info.decode_seconds = time.perf_counter() - t0
        return info

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
        return [s.task for s in (*self._waiting, *self._reading, *self._generating.values())]

    def cancel_unstarted(self) -> list[Task]:
        """Drop the sequences that have not produced a token yet (waiting or reading
        their prompt); returns their tasks."""
        tasks = [s.task for s in (*self._waiting, *self._reading)]
        self._waiting.clear()
        self._reading, self._prompt = [], None
        return tasks

    def cancel(self) -> list[Task]:
        """Drop every sequence; returns their tasks."""
        from mlx_lm.generate import GenerationBatch

        tasks = self.cancel_unstarted() + [s.task for s in self._generating.values()]
        self._generating.clear()
        self._gen = GenerationBatch.empty(self.model, self._sampler)
        return tasks

    def close(self) -> None:
        self.cancel()


def _split_time(info: StepInfo, seconds: float) -> None:
    """``seconds`` of a prefill step into ``info``: split between its prompt tokens and its
    generated tokens (a merged step) by their count."""
    info.seconds = seconds
    done = info.prefill_tokens + info.generated
    info.prefill_seconds = seconds * info.prefill_tokens / done if done else seconds
    info.decode_seconds = seconds - info.prefill_seconds
