"""How long a job has left, from tokens rather than from documents finished.

Counting documents gives nothing until the first one finishes, then wild
figures: with every document of a batch written together, the first one
finishes late and the rest soon after (a trial run showed ``?`` for 50 s, then
5 min 6 s when 30 s were left). Here the work left is counted in tokens and
timed with rates measured in this run:

- prompt tokens left (each document being read: its length less what is
  read; one not started yet: its characters times the prompt tokens per
  character measured on the documents started, 1/4 before any), over the
  prompt tokens read per second of prefill so far;
- tokens still to write, each document its expected length less what it
  wrote: for one that wrote ``n`` tokens, the mean length of the documents
  finished (this run, and earlier runs of the same job: a resumed job starts
  from its summaries' lengths) that were longer than ``n``, with ``max_tokens`` counted
  as one more (the prior until documents finish, and what is left for a
  document already longer than every finished one: the short ones finish
  first, so a plain mean would expect the rest to end at once),
  decoded as a batch (continuous batching: a finished place is refilled at
  once) at a step time fitted as ``a + c * b`` seconds for ``b`` sequences
  (least squares over recent decode steps). While the batch size has not
  varied enough to separate ``a`` from ``c`` (the first steps decode one
  sequence), the two ends are bounds: all per sequence (``a = 0``: batching
  gains nothing, an upper bound) and all per step (``c = 0``: a step costs
  the same for any batch, a lower bound); their geometric mean is used;
- both scaled by the run's wall time over its step time (conversions,
  throttle pauses, the rest of the loop).

A long document not started yet counts every call it will take (``calls``:
its parts, then the calls combining their summaries, each writing up to the
expected length: :func:`mlx_tier.tools.calls.call_plan`); one being read in
parts counts what that plan, made from its first level's prompt, has left: its
prompts less those read, and its calls in proportion (a plan packs each part
into the whole room, so a document split at sentences far smaller than the
room takes more calls than planned, and its estimate runs short); a rank of a
job over several ranks counts every pending document, not only its share.

:class:`EtaTracker` is plain state fed by the runner with a clock passed in,
so it is tested with scripted step sequences; it is ``None`` ("estimating")
until a prompt step and a decode step have been measured.
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type only: this module needs no tokenizer
    from mlx_tier.tools.calls import CallPlan

CHARS_PER_TOKEN = 4.0  # prior for text not measured yet (English BPE: ~4 characters a token)
WINDOW = 64  # decode steps the step-time fit uses
MAX_OVERHEAD = 3.0  # the wall / step time factor is clamped to [1, this]
ETA_EVERY = 2.0  # seconds between estimates a run makes (its progress file is rewritten as often)


@dataclass
class _Doc:
    chars: int  # characters of its text (0: unknown, e.g. a PDF not converted yet)
    prompt: int | None = None  # prompt tokens, once the engine reports them
    read: int = 0  # prompt tokens read
    written: int = 0  # tokens generated
    limit: int | None = None  # most tokens it may generate (a request's own); None: the run's max_tokens
    n: int = 1  # sequences it generates (a request's choices), each reading its prompt and writing
    plan: CallPlan | None = None  # a long document's calls, planned when its first level is seen
    read_before: int = 0  # prompt tokens of its levels read before the current one


@dataclass
class EtaTracker:
    """Seconds a run has left, updated after every engine step (module doc).

    Args:
        docs: ``{document id: characters of its text}`` for every document this
            run will do (0 when unknown); order does not matter.
        max_tokens: most tokens generated per document.
        batch_size: documents decoded together.
        started: the clock (seconds) when the run began its work.
        earlier: tokens generated for each document earlier runs of the job
            finished in one call (a resumed job's summaries: what the next
            ones will likely take, instead of the ``max_tokens`` prior alone).
        calls: the calls a document of so many tokens of text takes
            (:meth:`~mlx_tier.job.scheduler.Scheduler.calls_for`); ``None``: one.
        max_tok_s: the throttle's cap on generated tokens per second (``--max-tok-s``):
            the tokens left take at least their number over it; ``None``: none.
        limits: ``{document id: most tokens it may generate}`` where that is its own (a
            batch request's ``max_tokens``), not ``max_tokens``: its prior and its cap.
        choices: ``{document id: sequences it generates}`` where more than one (a batch
            request's ``n``): each choice reads the prompt and writes its own answer.
    """

    docs: dict[str, int]
    max_tokens: int
    batch_size: int
    started: float
    earlier: list[int] = field(default_factory=list)
    calls: Callable[[int], CallPlan] | None = None
    max_tok_s: float | None = None
    limits: dict[str, int] = field(default_factory=dict)
    choices: dict[str, int] = field(default_factory=dict)
    _left: dict[str, _Doc] = field(init=False)
    _outputs: list[int] = field(default_factory=list, init=False)  # finished documents' lengths, sorted
    _suffix: list[int] | None = field(default=None, init=False)  # _suffix[i] = sum(_outputs[i:]); None: stale
    _prompt_tokens: int = field(default=0, init=False)
    _prompt_seconds: float = field(default=0.0, init=False)
    _steps: deque = field(default_factory=lambda: deque(maxlen=WINDOW), init=False)  # (batch, seconds)
    _step_seconds: float = field(default=0.0, init=False)
    _measured_chars: int = field(default=0, init=False)
    _measured_tokens: int = field(default=0, init=False)
    _last: tuple[float, float | None] | None = field(default=None, init=False)  # (clock, eta) of :meth:`every`

    def __post_init__(self) -> None:
        self._left = {i: _Doc(max(int(c), 0), limit=self.limits.get(i), n=self.choices.get(i, 1))
                      for i, c in self.docs.items()}
        self._outputs = sorted(int(n) for n in self.earlier)

    def step(self, prefill: list[tuple[str, int, int]], generating: list[tuple[str, int]], prefill_tokens: int,
             prefill_seconds: float, generated: int, decode_seconds: float, merged: bool = False) -> None:
        """Record one engine step (:class:`mlx_tier.job.batch_engine.StepInfo`, ids as document ids).

        Args:
            prefill: ``(id, prompt tokens read, prompt length)`` of prompts being read.
            generating: ``(id, tokens so far)`` of documents being written.
            prefill_tokens, prefill_seconds: prompt tokens read in the step and the time it took.
            generated, decode_seconds: tokens decoded in the step (over the batch) and the time.
            merged: the decode ran in the prefill's layer steps (module batching): its
                share of their time is not a decode step's, so it stays out of the
                step-time fit (the tokens left are priced at decode steps: erring long).
        """
        for doc_id, read, length in prefill:
            d = self._left.get(doc_id)
            if d is not None:
                if d.prompt is None and d.chars:  # calibrate tokens per character on real prompts
                    self._measured_chars, self._measured_tokens = self._measured_chars + d.chars, \
                        self._measured_tokens + length
                if d.prompt is None and self.calls is not None:  # its calls, from its first level's prompts
                    plan = self.calls(length)
                    d.plan = plan if plan.calls > 1 else None
                elif d.prompt is not None and length != d.prompt:  # a long document's next level
                    d.read_before += d.prompt
                d.prompt, d.read = length, read
        for doc_id, tokens in generating:
            d = self._left.get(doc_id)
            if d is not None:
                d.written = max(d.written, tokens)
                if d.prompt is not None and d.plan is None:  # one call: its prompt is read (a part's is not all)
                    d.read = d.prompt
        if prefill_tokens > 0 and prefill_seconds > 0:
            self._prompt_tokens += prefill_tokens
            self._prompt_seconds += prefill_seconds
        if generated > 0 and decode_seconds > 0 and not merged:
            self._steps.append((generated, decode_seconds))
        self._step_seconds += max(prefill_seconds, 0.0) + max(decode_seconds, 0.0)

    def finished(self, doc_id: str, output_tokens: int | None = None) -> None:
        """A document left the run: done (``output_tokens`` it wrote in all, a resumed long
        document's kept calls' too: a document's length; a request's over its choices, each
        choice counted as one sequence of its share) or failed (``None``)."""
        d = self._left.pop(doc_id, None)
        if d is not None and output_tokens is not None:
            for _ in range(d.n):
                insort(self._outputs, round(int(output_tokens) / d.n))
            self._suffix = None

    def expected_output(self, written: int = 0, limit: int | None = None) -> float:
        """Tokens a document that has written ``written`` is expected to generate in all: the
        mean of the documents finished (``earlier`` included) that were longer, with its
        ``limit`` (default ``max_tokens``) counted as one more (the prior while none has
        finished). O(log n) for n finished
        documents: a binary search in their sorted lengths and suffix sums (rebuilt once
        after documents finish)."""
        if self._suffix is None:
            self._suffix = list(accumulate(reversed(self._outputs), initial=0))[::-1]
        i = bisect_right(self._outputs, written)  # _outputs[i:] are the longer ones
        return (self._suffix[i] + (self.max_tokens if limit is None else limit)) / (len(self._outputs) - i + 1)

    def eta(self, now: float) -> float | None:
        """Seconds left at ``now`` (the same clock as ``started``); ``0.0`` when nothing is
        left; ``None`` while a rate it needs has not been measured yet. Time linear in the
        documents left (plus a log factor): ~10k documents take milliseconds, so callers
        still ask only when someone reads it (:meth:`every`)."""
        if not self._left:
            return 0.0
        left = self._left.values()
        per_char, typical = self._prompt_rates()
        expected = {(0, None): self.expected_output(0)}  # most documents left have written nothing
        prompt_left, writes = 0.0, []
        for d in left:
            if d.plan is not None:  # a long document being read: the calls of its plan not read yet
                prompt, calls = self._plan_left(d)
                prompt_left += prompt
                writes += [min(max(expected[0, None], 1.0), self.max_tokens)] * calls
                continue
            tokens = self._prompt_left(d, per_char, typical)
            plan = self.calls(int(tokens)) if self.calls is not None and d.prompt is None else None
            if plan is not None and plan.calls > 1:  # a long document not started: each of its calls
                prompt_left += plan.parts * plan.part_prompt + plan.combines * plan.combine_prompt
                writes += [min(max(expected[0, None], 1.0), self.max_tokens)] * plan.calls
                continue
            prompt_left += tokens * d.n
            cap = self.max_tokens if d.limit is None else d.limit
            total = _get(expected, (d.written, d.limit), lambda key: self.expected_output(*key))
            writes += [min(max(total - d.written, 1.0), max(cap - d.written, 0.0))] * d.n
        if prompt_left > 0 and not self._prompt_seconds or not self._steps:
            return None
        prompt_s = prompt_left / (self._prompt_tokens / self._prompt_seconds) if prompt_left > 0 else 0.0
        steps = list(self._steps)
        fitted = step_model(steps)
        if fitted is not None:
            decode_s = drain_seconds(writes, self.batch_size, *fitted)
        else:  # one batch size so far: between the per-sequence and the per-step bounds
            b = sum(n for n, _ in steps) / len(steps)
            t = sum(s for _, s in steps) / len(steps)
            decode_s = (drain_seconds(writes, self.batch_size, 0.0, t / b)
                        * drain_seconds(writes, self.batch_size, t, 0.0)) ** 0.5
        if self.max_tok_s:  # the throttle paces every step to the cap
            decode_s = max(decode_s, sum(writes) / self.max_tok_s)
        spent = max(now - self.started, 0.0)
        overhead = min(max(spent / self._step_seconds, 1.0), MAX_OVERHEAD) if self._step_seconds > 0 else 1.0
        return (prompt_s + decode_s) * overhead

    def every(self, now: float, seconds: float = ETA_EVERY) -> float | None:
        """:meth:`eta` at most once per ``seconds`` of the clock: in between, the last estimate
        less the time since it was made. For a runner that reports after every engine step
        while its readers (progress file, live line, log heartbeat) look every second or two."""
        if self._last is None or now - self._last[0] >= seconds:
            self._last = (now, self.eta(now))
        at, value = self._last
        return None if value is None else max(value - (now - at), 0.0)

    def _prompt_rates(self) -> tuple[float, float]:
        """``(prompt tokens per character, typical prompt tokens)`` for documents not read yet:
        measured on the prompts started (1/4 a character before any), and the mean prompt
        of the documents left whose prompt is known (for those of unknown size; 0 if none)."""
        per_char = self._measured_tokens / self._measured_chars if self._measured_chars else 1 / CHARS_PER_TOKEN
        known = [x.prompt for x in self._left.values() if x.prompt is not None]
        return per_char, sum(known) / len(known) if known else 0.0

    @staticmethod
    def _plan_left(d: _Doc) -> tuple[float, int]:
        """``(prompt tokens, calls)`` a long document in progress has left: its plan's prompts
        less those read (the current level's left at least), and its calls in proportion, the
        one being written at least (erring long: the tokens it has written are not taken off)."""
        plan = d.plan
        total = plan.parts * plan.part_prompt + plan.combines * plan.combine_prompt
        read = d.read_before + d.read
        left = max(total - read, (d.prompt or 0) - d.read, 0)
        return left, max(1, math.ceil(plan.calls * (1 - min(read / total, 1.0)))) if total > 0 else 1

    @staticmethod
    def _prompt_left(d: _Doc, per_char: float, typical: float) -> float:
        if d.prompt is not None:
            return max(d.prompt - d.read, 0)
        return d.chars * per_char if d.chars else typical


def _get(memo: dict, key, compute):
    """``memo[key]``, computed once with ``compute(key)``."""
    if key not in memo:
        memo[key] = compute(key)
    return memo[key]


def step_model(steps: list[tuple[int, float]]) -> tuple[float, float] | None:
    """``(a, c)``: a decode step for ``b`` sequences takes ``a + c * b`` seconds, fitted by
    least squares on ``(b, seconds)`` steps; ``None`` when the batch sizes did not vary
    enough (largest < 1.5x smallest, or no step) to tell ``a`` from ``c``. A fit with a
    negative part falls back to a per-token rate (``a = 0``)."""
    bs = [b for b, _ in steps]
    if not steps or max(bs) < 1.5 * min(bs):
        return None
    per_token = sum(s for _, s in steps) / sum(bs)
    n = len(steps)
    mb, ms = sum(bs) / n, sum(s for _, s in steps) / n
    var = sum((b - mb) ** 2 for b in bs)
    c = sum((b - mb) * (s - ms) for b, s in steps) / var
    a = ms - c * mb
    if a < 0 or c <= 0:
        return 0.0, per_token
    return a, c


def drain_seconds(writes: list[float], batch_size: int, a: float, c: float) -> float:
    """Seconds to generate ``writes`` (tokens each document still has to write) with up to
    ``batch_size`` of them decoded together, one token each per step of ``a + c * b``
    seconds for ``b`` sequences; a finished document's place is taken by the next at once."""
    queue = deque(sorted(writes, reverse=True))  # longest first: the usual order matters little
    active: list[float] = []
    seconds = 0.0
    while queue or active:
        while queue and len(active) < max(batch_size, 1):
            active.append(queue.popleft())
        m = min(active)
        seconds += m * (a + c * len(active))
        active = [w - m for w in active if w - m > 1e-9]
    return seconds
