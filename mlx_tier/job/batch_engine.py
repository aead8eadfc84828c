"""Batched generation for the job runner, on mlx-lm's ``BatchGenerator``.

Several prompts decode together (continuous batching: a finished sequence's
place is refilled at once), so each expert read from disk serves every
sequence in the batch. The shared instruction prefix of every prompt is
prefilled once and its KV cache copied into each sequence (mlx-lm prompt
caches). Decoding is greedy unless a task brings its own :class:`Sampling`
(a batch request's temperature, top_p, seed, stop strings: mlx-lm's
per-sequence samplers). Everything here is mlx-lm's; this module only feeds it
and collects the results, between decode steps — never inside a forward pass.

Also here: the stop-token set and the memory
estimates that pick a batch size and a usable context.
"""

from __future__ import annotations

import copy
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import psutil

from mlx_tier.defaults import DEFAULT_PREFILL_STEP
from mlx_tier.engine.footprint import MemoryBudget, room_now
from mlx_tier.engine.limits import probe_limit
from mlx_tier.job.sampling import Sampling
from mlx_tier.units import GIB

# Batch size when memory allows more: on a 2-core CPU more sequences add
# compute per step; mlx-lm's own default of 32 has run small Macs out of memory.
MAX_AUTO_BATCH = 8
# Memory kept free for the OS and everything not estimated here; under a cgroup
# limit (a container) the OS's share lies outside it, so less is kept.
HEADROOM_BYTES = 1 * GIB
CGROUP_HEADROOM_BYTES = 256 << 20
# Wall time one engine step should take at most (prompt reading + one decode
# step): progress, the throttle and a stop request are seen between steps.
STEP_SECONDS = 4.0


def stop_token_ids(tokenizer, model_dir: Path | None = None) -> set[int]:
    """End-of-sequence ids: the union of the tokenizer's and the checkpoint's.

    Reads ``eos_token_id`` (an int or a list) from ``config.json`` and
    ``generation_config.json`` in ``model_dir`` when present; chat models often
    list their end-of-turn token only in one of those.
    """
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((Path(model_dir) / name).read_text()).get("eos_token_id") if model_dir else None
        except (OSError, ValueError, AttributeError):
            continue
        ids.update([value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)])
    return ids


def kv_bytes_per_token(cache: list) -> tuple[float, int]:
    """KV-cache cost of a sequence, measured on a filled mlx-lm prompt cache.

    Args:
        cache: a prompt cache (``mlx_lm.models.cache.make_prompt_cache``) after
            at least one token was processed.

    Returns:
        ``(bytes per token, fixed bytes)``: attention caches grow per token
        (their allocated keys/values divided by allocated length; quantized
        ones: codes, scales and biases); other
        caches (SSM/linear-attention state) count as fixed.
    """
    per_token, fixed = 0.0, 0
    for c in cache:
        if hasattr(c, "caches"):  # CacheList
            p, f = kv_bytes_per_token(list(c.caches))
            per_token, fixed = per_token + p, fixed + f
            continue
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if isinstance(keys, (tuple, list)) and isinstance(values, (tuple, list)):  # quantized: codes, scales, biases
            per_token += sum(a.nbytes / a.shape[2] for a in (*keys, *values))
        elif isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == 4:
            per_token += keys.nbytes / keys.shape[2] + values.nbytes / values.shape[2]
        else:
            try:
                fixed += int(c.nbytes)
            except (NotImplementedError, AttributeError, TypeError):
                pass
    return per_token, fixed


@dataclass(frozen=True)
class MemoryPlan:
    """How many sequences fit, and how long each may be.

    A sequence of T tokens holds ``kv_per_token * T + fixed_per_seq`` bytes
    of cache; while its prompt is prefilled it also needs a transient of
    ``prefill_fixed + prefill_per_token * T`` bytes (one step's attention
    scores against the T cached tokens, and activations). Each sequence of a
    batch may be prefilled at once (mlx-lm's ``prefill_batch_size``), so a
    batch of B needs B of both.

    Attributes:
        kv_per_token: KV-cache bytes per token of one sequence.
        fixed_per_seq: per-sequence bytes that do not grow with length.
        prefill_per_token: transient bytes per context token of a prefill step.
        prefill_fixed: transient bytes of a prefill step that do not grow with context.
        free_bytes: memory available for sequences now (:func:`sequence_room`).
    """

    kv_per_token: float
    fixed_per_seq: int
    prefill_per_token: float
    prefill_fixed: int
    free_bytes: int

    def sequence_bytes(self, tokens: int) -> int:
        """Peak bytes of one sequence of ``tokens`` tokens (prompt + output), prefill included."""
        per_token = self.kv_per_token + self.prefill_per_token
        return int(per_token * tokens) + self.fixed_per_seq + self.prefill_fixed

    def batch_size(self, tokens: int, limit: int = MAX_AUTO_BATCH) -> int:
        """Most sequences of ``tokens`` tokens that fit, in ``[1, limit]``."""
        return int(max(1, min(limit, self.free_bytes // max(1, self.sequence_bytes(tokens)))))

    def max_tokens(self) -> int:
        """Longest single sequence (prompt + output) that fits, in tokens (0 when none does)."""
        per_token = self.kv_per_token + self.prefill_per_token
        room = self.free_bytes - self.fixed_per_seq - self.prefill_fixed
        return max(0, int(room / per_token)) if per_token else 1 << 30


def headroom() -> int:
    """Bytes kept free: :data:`HEADROOM_BYTES`, or :data:`CGROUP_HEADROOM_BYTES` under a cgroup limit."""
    return CGROUP_HEADROOM_BYTES if probe_limit().limited else HEADROOM_BYTES


def sequence_room(budget: MemoryBudget | None = None, lent: int = 0) -> int:
    """Bytes new sequences may take now: within a run's memory split
    (:func:`mlx_tier.engine.footprint.room_now`), else what this process's memory
    limit leaves (its cgroup's or the host's, :mod:`mlx_tier.engine.limits`)
    less :func:`headroom`. ``lent``: bytes the expert cache holds now as slots lent to
    decode steps (the split's idle workspace and KV room), given back before the
    prompt step that would read a new sequence: room for it, not counted as in use."""
    available = probe_limit().available
    if budget is None:
        return available - headroom()
    return room_now(budget, psutil.Process().memory_info().rss - lent, available + lent)


def estimate_memory(cache: list, model_args, prefill_step: int, free_bytes: int | None = None) -> MemoryPlan:
    """A :class:`MemoryPlan` from a filled prompt cache and the model's shape.

    The prefill transient is ``heads x step`` float32 attention scores per
    context token plus ``step x hidden x 16`` bytes of activations — an
    estimate that errs high; MLX's memory is otherwise not predictable here.
    ``free_bytes``: the room for sequences (default :func:`sequence_room`).
    """
    per_token, fixed = kv_bytes_per_token(cache)
    heads = int(getattr(model_args, "num_attention_heads", 0) or 0)
    hidden = int(getattr(model_args, "hidden_size", 0) or 0)
    free = sequence_room() if free_bytes is None else free_bytes
    return MemoryPlan(per_token, fixed, float(heads * prefill_step * 4), prefill_step * hidden * 16, int(free))


def common_prefix(prompts: list[list[int]]) -> int:
    """Length of the longest common prefix of token lists."""
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts[1:]):
            return i
    return n


class PrefixCache:
    """The KV cache of a token prefix shared by many prompts, computed once.

    mlx-lm prompt caches (``make_prompt_cache``); each sequence gets a deep
    copy, so the shared one is never written.
    """

    def __init__(self, model, tokens: list[int], prefill_step: int = DEFAULT_PREFILL_STEP):
        from mlx_lm.models.cache import make_prompt_cache

        self.tokens = list(tokens)
        self.cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        for i in range(0, len(tokens), prefill_step):
            model(mx.array(tokens[i : i + prefill_step])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.seconds = time.perf_counter() - t0

    def __len__(self) -> int:
        return len(self.tokens)

    def applies(self, prompt: list[int]) -> bool:
        # At least one token must remain to be processed after the prefix.
        return len(self.tokens) > 0 and len(prompt) > len(self.tokens) and prompt[: len(self.tokens)] == self.tokens

    def copy(self) -> list:
        return copy.deepcopy(self.cache)


def start_of(prefix: PrefixCache | None, prompt: list[int]) -> tuple[list[int], list | None, list[int], int]:
    """How a prompt starts in an engine: ``(tokens to read, its KV cache or None for a
    fresh one, tokens already in that cache, prefix tokens used)``: after a copy of
    ``prefix``'s cache when the prompt starts with it."""
    if prefix is not None and prefix.applies(prompt):
        return prompt[len(prefix):], prefix.copy(), list(prefix.tokens), len(prefix)
    return prompt, None, [], 0


def check_add(free: int, task) -> None:
    """An engine's ``add`` precondition.

    Raises:
        ValueError: no free place, or an empty prompt.
    """
    if free <= 0:
        raise ValueError("batch is full")
    if not task.prompt:
        raise ValueError("empty prompt")


@dataclass
class Task:
    """One prompt to complete.

    Attributes:
        key: the caller's handle, returned with the result.
        prompt: token ids, ``[T]``.
        max_tokens: most tokens to generate.
        sampling: how its tokens are picked; ``None``: the engine's default
            (greedy, with the engine's repetition penalty).
    """

    key: object
    prompt: list[int]
    max_tokens: int
    sampling: Sampling | None = None


@dataclass
class Finished:
    """A completed :class:`Task`.

    Attributes:
        tokens: generated ids (a final stop token excluded).
        text: ``tokens`` decoded, untrimmed; cut before a stop string that ended it.
        finish_reason: ``"stop"`` (a stop token or string) or ``"length"`` (``max_tokens``).
        seconds: wall time from insertion to completion (shared with the
            batch's other sequences).
        prefix_tokens: prompt tokens served from the shared prefix cache.
        stop_reason: what stopped it: the stop token's id, the stop string
            (:attr:`Sampling.stop`), or ``None`` (``max_tokens``).
    """

    key: object
    tokens: list[int]
    text: str
    finish_reason: str
    seconds: float
    prefix_tokens: int = 0
    stop_reason: int | str | None = None


@dataclass
class StepInfo:
    """What one :meth:`BatchEngine.step` did.

    ``prefill_seconds`` and ``decode_seconds`` split ``seconds`` (mlx-lm's
    ``BatchGenerator.stats``): the part spent reading the prompt in
    ``prefill`` and the decode step shared by the sequences in ``generating``.
    """

    finished: list[Finished] = field(default_factory=list)
    generated: int = 0  # tokens decoded in this step, over the batch
    prefill: list[tuple] = field(default_factory=list)  # (task key, prompt tokens processed, prompt length)
    generating: list[tuple] = field(default_factory=list)  # (task key, tokens generated so far), still running
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt tokens read in this step
    # The decode ran in the prefill's layer steps (module batching, mlx_tier.job.pool_engine):
    # decode_seconds is its share of them, not a decode step's time.
    merged: bool = False
    # Each sequence as the engine ran it, where prefill and generating are regrouped by document
    # (a long document's calls are sequences of their own): (key, prompt length) of those read
    # in this step, and (key, tokens so far) of those still generating.
    sequences: list[tuple] = field(default_factory=list)
    decoding: list[tuple] = field(default_factory=list)


class PrefillPacer:
    """Prompt tokens per step, chosen from measured step times so that a step takes
    about ``target_seconds`` on this machine.

    A fixed token count is seconds on a GPU and minutes on a slow CPU (512
    tokens at ~4 tok/s); steps bounded in time keep progress, the throttle and
    stops responsive everywhere. A step of ``n`` prompt tokens is modelled as
    ``a + b * n`` seconds (``a``: per-step overhead such as expert reads and
    rounds; ``b``: seconds per token), least squares over the recent steps
    (``b`` grows with the context: attention reads every cached token). The
    step aims at the target but never lets the overhead exceed half of it
    (``n >= a / b``): when the overhead alone is near the target, steps run
    longer rather than wasting most of their time on it. The fit is used only
    when the recent sizes differ enough (largest >= 1.5x smallest) to separate
    ``a`` from ``b``, else a plain rate; and a step is at most twice the last
    one, so a noisy estimate cannot make one step much longer than the last.

    Args:
        max_tokens: the largest step (``--prefill-step``), >= 1.
        target_seconds: wall time per step to aim at, decode step included.
        seed: a first ``(tokens, seconds)`` observation (e.g. the shared prefix's prefill).
        min_tokens: the smallest step.
        window: how many recent steps the fit uses.
        first_tokens: the first step, before any is measured; ``None``: ``min_tokens``.
    """

    def __init__(self, max_tokens: int, target_seconds: float = STEP_SECONDS,
                 seed: tuple[int, float] | None = None, min_tokens: int = 4, window: int = 6,
                 first_tokens: int | None = None):
        self.max_tokens, self.target = max(1, max_tokens), target_seconds
        self.min_tokens = min(min_tokens, self.max_tokens)
        self.first_tokens = min(max(self.min_tokens, first_tokens or 0), self.max_tokens)
        self._seen: deque[tuple[int, float]] = deque(maxlen=window)
        if seed is not None:
            self.observe(*seed)

    def observe(self, tokens: int, seconds: float) -> None:
        """Record a step that read ``tokens`` prompt tokens in ``seconds`` (ignored when either is 0)."""
        if tokens > 0 and seconds > 0:
            self._seen.append((tokens, seconds))

    def model(self) -> tuple[float, float] | None:
        """``(a, b)``: seconds per step and per token, fitted; ``None`` before any step."""
        if not self._seen:
            return None
        ns, ts = zip(*self._seen)
        mean_n, mean_t = sum(ns) / len(ns), sum(ts) / len(ts)
        var = sum((n - mean_n) ** 2 for n in ns)
        if max(ns) >= 1.5 * min(ns) and var > 0:
            b = sum((n - mean_n) * (t - mean_t) for n, t in self._seen) / var
            a = mean_t - b * mean_n
            if b > 0 and a >= 0:
                return a, b
        return 0.0, mean_t / mean_n  # one size seen, or a fit that makes no sense: a pure rate

    def size(self, decode_seconds: float = 0.0) -> int:
        """Tokens for the next step, given the decode step's recent duration (it shares the step)."""
        fit = self.model()
        if fit is None:
            return self.first_tokens
        a, b = fit
        budget = max(self.target - decode_seconds, 0.25 * self.target)
        n = min(max((budget - a) / b, a / b), 2 * self._seen[-1][0])
        return int(min(self.max_tokens, max(self.min_tokens, n)))


@dataclass(eq=False)
class _Seq:
    """A task in flight: its tokens so far, when it started, the prefix it reused, and
    how much of its text was searched for stop strings."""

    task: Task
    tokens: list[int] = field(default_factory=list)
    started: float = 0.0
    prefix_tokens: int = 0
    searched: int = 0  # characters of the decoded text already searched for stop strings


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """``(index, stop)`` of the earliest stop string in ``text`` at or after ``start``, or ``None``."""
    found = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
    return min(found) if found else None


class BatchEngine:
    """Continuous batching of :class:`Task` s through mlx-lm's ``BatchGenerator``.

    Greedy (argmax) decoding with an optional repetition penalty (mlx-lm's
    ``make_logits_processors``, whose context includes the prompt as in
    ``stream_generate``), unless a task brings its own :class:`Sampling`
    (mlx-lm's per-sequence samplers; stop strings are searched here, in the
    decoded text, after each step). At most ``batch_size`` sequences are in
    flight; call :meth:`add` while :attr:`free` is positive, then :meth:`step`.

    Args:
        model, tokenizer: as returned by :func:`mlx_tier.load` (or ``mlx_lm.load``).
        stop_ids: end-of-sequence token ids (:func:`stop_token_ids`).
        batch_size: sequences decoded together, >= 1.
        repetition_penalty: for tasks without their own :class:`Sampling`.
        prefill_step_size: most prompt tokens per step (the step size follows
            the measured rate: :class:`PrefillPacer`).
        prefix: a shared prefix's cache; prompts starting with it reuse it
            (its prefill time gives the pacer its first rate estimate).
        step_seconds: wall time per step to aim at (:data:`STEP_SECONDS`);
            ``None``: every prompt step is ``prefill_step_size`` tokens (unpaced).
        step_cap: most prompt tokens a step may read when the prompt being read
            has this many tokens done (its attention grows with them), from the
            run's memory split (:meth:`mlx_tier.engine.footprint.MemoryBudget.prompt_step`);
            ``None``: no cap beyond ``prefill_step_size``.
    """

    def __init__(self, model, tokenizer, stop_ids, *, batch_size: int = 1, repetition_penalty: float = 1.0,
                 prefill_step_size: int = DEFAULT_PREFILL_STEP, prefix: PrefixCache | None = None,
                 step_seconds: float | None = STEP_SECONDS, step_cap: Callable[[int], int] | None = None):
        from mlx_lm.generate import BatchGenerator

        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.default = Sampling(repetition_penalty=repetition_penalty)
        self.prefix = prefix
        self._gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in sorted(stop_ids)],
            completion_batch_size=batch_size,
            # One document's prompt at a time (prefill_step_size tokens per
            # step), interleaved with the batch's decode steps: a step stays
            # short, so progress, the throttle and a stop request are seen
            # between steps, and only one prefill transient is in memory.
            prefill_batch_size=1,
            prefill_step_size=prefill_step_size,
        )
        self._active: dict[int, _Seq] = {}  # uid -> sequence
        seed = (len(prefix), prefix.seconds) if prefix is not None else None
        self.pacer = PrefillPacer(prefill_step_size, step_seconds, seed) if step_seconds is not None else None
        self._decode_seconds = 0.0  # the last decode step's duration
        self.prefill_step_size, self.step_cap = prefill_step_size, step_cap
        self._read = 0  # prompt tokens done of the prompt being read (one at a time)

    @property
    def free(self) -> int:
        return self.batch_size - len(self._active)

    @property
    def active(self) -> int:
        return len(self._active)

    def add(self, task: Task) -> None:
        """Queue ``task``; it starts prefill at the next :meth:`step`.

        Raises:
            ValueError: no free place, or an empty prompt.
        """
        check_add(self.free, task)
        sampling = task.sampling or self.default
        prompt, cache, seen, used = start_of(self.prefix, task.prompt)
        (uid,) = self._gen.insert([prompt], [task.max_tokens], caches=None if cache is None else [cache],
                                  all_tokens=None if cache is None else [seen],
                                  samplers=[sampling.sampler()], logits_processors=[sampling.processors()])
        self._active[uid] = _Seq(task, started=time.perf_counter(), prefix_tokens=used)

    def step(self) -> StepInfo:
        """One step of mlx-lm's batch generator: a decode step for the running
        sequences and/or one prefill step for new ones."""
        info = StepInfo()
        # mlx-lm reads this many prompt tokens in the coming step (BatchGenerator._next)
        size = self.pacer.size(self._decode_seconds) if self.pacer is not None else self.prefill_step_size
        self._gen.prefill_step_size = size if self.step_cap is None else max(1, min(size, self.step_cap(self._read)))
        t0 = time.perf_counter()
        with self._gen.stats() as stats:
            prompt_responses, responses = self._gen.next()
        info.seconds = time.perf_counter() - t0
        info.prefill_seconds, info.decode_seconds = stats.prompt_time, stats.decode_time
        info.prefill_tokens = stats.prompt_tokens
        if self.pacer is not None:
            self.pacer.observe(stats.prompt_tokens, stats.prompt_time)
        if responses:
            self._decode_seconds = stats.decode_time
        info.prefill = [(self._active[p.uid].task.key, *p.progress) for p in prompt_responses if p.uid in self._active]
        self._read = next((done for _, done, total in info.prefill if done < total), 0)
        info.generated = len(responses)
        for r in responses:
            self._take(r, info)
        return info

    def _take(self, r, info: StepInfo) -> None:
        """One sequence's token of this step: kept, and the sequence finished when a stop
        token, a stop string or ``max_tokens`` ends it (a stop string ends it here: it is
        removed from the generator)."""
        seq = self._active[r.uid]
        if r.finish_reason != "stop":
            seq.tokens.append(r.token)
        text, reason, why = None, r.finish_reason, (r.token if r.finish_reason == "stop" else None)
        stops = (seq.task.sampling or self.default).stop
        if stops:
            text = self.tokenizer.decode(seq.tokens)
            hit = find_stop(text, stops, max(0, seq.searched - max(map(len, stops)) + 1))
            seq.searched = len(text)
            if hit is not None:
                text, reason, why = text[: hit[0]], "stop", hit[1]
                if r.finish_reason is None:
                    self._gen.remove([r.uid])
        if reason is None:
            info.generating.append((seq.task.key, len(seq.tokens)))
            return
        del self._active[r.uid]
        text = self.tokenizer.decode(seq.tokens) if text is None else text
        info.finished.append(Finished(seq.task.key, seq.tokens, text, reason, time.perf_counter() - seq.started,
                                      seq.prefix_tokens, why))

    def tasks(self) -> list[Task]:
        """The tasks in flight."""
        return [seq.task for seq in self._active.values()]

    def cancel_unstarted(self) -> list[Task]:
        """Drop the sequences that have not produced a token yet (still reading
        their prompt); returns their tasks."""
        uids = [uid for uid, seq in self._active.items() if not seq.tokens]
        if uids:
            self._gen.remove(uids)
        return [self._active.pop(uid).task for uid in uids]

    def cancel(self) -> list[Task]:
        """Drop every sequence in flight; returns their tasks."""
        tasks = self.tasks()
        if self._active:
            self._gen.remove(list(self._active))
        self._active.clear()
        return tasks

    def close(self) -> None:
        self._gen.close()
