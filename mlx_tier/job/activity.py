"""What a run says while it works: the :class:`Activity` after each step, the
:class:`Reporter` that receives it, the rates it shows (recent, achieved, predicted)
and the progress sent from inside a long prompt step.

Two things keep progress moving during a long step: :class:`LayerProgress` (the
throughput schedule's prompt pools: the activity sent again between MoE layers,
the prompt read advanced) and :class:`mlx_tier.job.heartbeat.Heartbeat` (a thread
that rewrites the progress file with how long the step has run and the memory left).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from mlx_tier.engine.footprint import kv_element_bytes
from mlx_tier.job.report import DocResult, JobReport
from mlx_tier.job.scheduler import Scheduler
from mlx_tier.rates import RunSpeed
from mlx_tier.units import count_text, percent_text, rate_text, seconds_text

# Least seconds between two progress updates sent from inside a long prompt step.
LAYER_PROGRESS_SECONDS = 2.0


@dataclass(frozen=True)
class Activity:
    """What the job is doing, after an engine step (for progress displays and ``mlx-tier status``).

    Attributes:
        in_flight: ids of the documents started and not finished.
        reading: ``(id, prompt tokens read, prompt length)`` of the prompt being read, or ``None``.
        writing: ``(id, tokens generated so far)`` of each document being written.
        decode_tok_s: generated tokens per second over recent decode steps (all documents).
        prompt_tok_s: prompt tokens read per second over recent steps.
        hit_rate: expert cache hit rate of this run so far, in [0, 1].
        eta_seconds: seconds this run has left (:class:`mlx_tier.job.eta.EtaTracker`), ``None``
            while still estimating (no prompt step or decode step measured yet).
        stopping: a first Ctrl-C (or SIGTERM) asked the run to stop: it finishes the
            summaries being written, then ends; the ETA no longer applies.
        also_reading: the other prompts the same step reads, as ``reading`` (a throughput
            run reads several at a time): being read, not waiting.
        read: ``{id: (prompt tokens read, prompt length)}`` of the documents in flight whose
            prompt a step has read from (a throughput run reads prompts in turns): how far
            one neither read nor written in this step got; a document not in it has not
            started.
        at: ``time.monotonic()`` when the rates and the ETA were measured (the step's end);
            an update sent again during a long step keeps it, so a reader ages the ETA
            from then, not from the update (``None``: unknown, the update's time).
    """

    in_flight: list[str]
    reading: tuple[str, int, int] | None
    writing: list[tuple[str, int]]
    decode_tok_s: float
    prompt_tok_s: float
    hit_rate: float
    eta_seconds: float | None = None
    stopping: bool = False
    at: float | None = None
    also_reading: tuple[tuple[str, int, int], ...] = ()
    read: dict[str, tuple[int, int]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"in_flight": self.in_flight, "reading": list(self.reading) if self.reading else None,
                "writing": [list(w) for w in self.writing], "decode_tok_s": round(self.decode_tok_s, 3),
                "prompt_tok_s": round(self.prompt_tok_s, 3), "hit_rate": round(self.hit_rate, 4),
                "eta_seconds": round(self.eta_seconds, 1) if self.eta_seconds is not None else None,
                "stopping": self.stopping, **({"measured_mono": round(self.at, 3)} if self.at is not None else {}),
                **({"also_reading": [list(r) for r in self.also_reading]} if self.also_reading else {}),
                **({"read": {i: list(r) for i, r in self.read.items()}} if self.read else {})}


class Reporter:
    """Receives progress events; the CLI shows them with Rich. Default: silent."""

    def message(self, text: str) -> None: ...
    def start(self, total: int, skipped: int, failed: int = 0) -> None:
        """``total`` documents in the job (less those a ``retry_failed`` run leaves for a plain
        rerun), ``skipped`` of them done by earlier runs and ``failed`` failed in earlier runs,
        not retried: the same count on every run of a job."""
    def working(self, activity: Activity) -> None:
        """After each engine step (a few seconds apart at most: :data:`~mlx_tier.job.batch_engine.STEP_SECONDS`).
        Documents are converted one ahead in a worker thread, beside the steps; only when
        a document's turn comes before its conversion ended (a large PDF behind a short
        text) do the steps wait for it."""
    def finished(self, result: DocResult, cache: dict) -> None: ...
    def close(self) -> None: ...


class Rate:
    """Generated tokens per second over the recent decode steps (exponential average)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.value, self._w = 0.0, weight

    def add(self, tokens: int, seconds: float) -> None:
        if tokens and seconds > 0:
            now = tokens / seconds
            self.value = now if not self.value else (1 - self._w) * self.value + self._w * now


class Speed:
    """A run's decode and prompt-reading rates, achieved and predicted: the prediction is the
    pool model the throughput schedule chooses its pools by (:mod:`mlx_tier.tools.pools`:
    the run's kernels' rates probed here, the model's routing calibrated on its first
    forward call), priced at this run's mean decode batch, prompt step, prompt length,
    slots lent to decode steps and read rate, so the two differ by what the model leaves
    out (waiting, the throttle, MLX's dispatch) and by its hit rate against the run's.
    Decode is counted over decode steps only: a token decoded in a prompt step (module
    batching) costs a row of it. A sequence is one call: a long document's parts each."""

    def __init__(self) -> None:
        self.decode_tokens = self.prompt_tokens = self.decode_steps = self.prompt_steps = 0
        self.decode_seconds = self.prompt_seconds = 0.0
        self.lengths: dict = {}  # a sequence's prompt tokens, by its engine key
        self.contexts = 0  # summed over the decode steps' sequences: each one's tokens then
        self.lent = 0  # expert slots lent to the decode steps, summed over their tokens

    def add(self, info, lent: int = 0) -> None:
        """One engine step (:class:`~mlx_tier.job.batch_engine.StepInfo`); ``lent``: expert slots
        per layer its cache held beyond its own (:meth:`~mlx_tier.engine.expert_cache.ExpertCache.lend_slots`)."""
        for key, length in info.sequences:
            self.lengths[key] = length
        if info.generated and not info.merged:
            self.decode_tokens += info.generated
            self.decode_seconds += info.decode_seconds
            self.decode_steps += 1
            self.contexts += sum(self.lengths.get(key, 0) + n for key, n in info.decoding)
            self.lent += lent * info.generated
        if info.prefill_tokens:
            self.prompt_tokens += info.prefill_tokens
            self.prompt_seconds += info.prefill_seconds
            self.prompt_steps += 1

    def compare(self, model, cache, report: JobReport, reporter: Reporter) -> None:
        """Record achieved and predicted rates in ``report.setup["speed"]`` and say them in one
        line. ``model``: the scheduler's ``(Shape, Rates)``
        (:meth:`~mlx_tier.job.scheduler.Scheduler.step_model`; ``None``: not priced);
        ``cache``: the model's :class:`~mlx_tier.engine.expert_cache.ExpertCache`."""
        if model is None or not (self.decode_seconds and self.prompt_seconds and self.lengths):
            return
        from mlx_tier.tools.pools import seconds_per_token

        shape, rates = model
        stats = cache.stats
        disk = stats.bytes_read / stats.read_seconds / 1e9 if stats.read_seconds else 0.0
        if disk > 0:  # this run's reads, not the probe's
            rates = replace(rates, disk_gbps=disk)
        batch = max(1, round(self.decode_tokens / self.decode_steps))
        step = max(1, round(self.prompt_tokens / self.prompt_steps))
        prompt = sum(self.lengths.values()) / len(self.lengths)  # a sequence's mean prompt tokens
        context = self.contexts / self.decode_tokens if self.contexts else prompt
        lent = round(self.lent / self.decode_tokens)  # decode steps priced with the slots they held
        decoding = replace(shape, slots=min(shape.experts, shape.slots + lent))
        want = (1 / seconds_per_token(decoding, rates, batch, context),
                1 / seconds_per_token(shape, rates, step, prompt / 2, max(1, math.ceil(step / prompt))))
        got = (self.decode_tokens / self.decode_seconds, self.prompt_tokens / self.prompt_seconds)
        report.setup["speed"] = {
            "decode_tok_s": round(got[0], 3), "prompt_tok_s": round(got[1], 3), "read_gbps": round(disk, 3),
            "predicted": {"decode_tok_s": round(want[0], 3), "prompt_tok_s": round(want[1], 3), "batch": batch,
                          "prompt_step": step, "lent_slots": lent, "hit_rate": round(stats.hit_rate, 4)},
            "rates": rates.as_dict()}
        reporter.message(f"speed: decode {got[0]:.2f} tok/s (predicted {want[0]:.2f}), prompt reading "
                         f"{got[1]:.1f} tok/s (predicted {want[1]:.1f}): the pool model with the {cache.kernel} "
                         f"kernel's rates probed here and this run's {disk:.2f} GB/s reads, batch {batch}, "
                         f"{step}-token prompt steps ({percent_text(stats.hit_rate)} hit rate)")


def announce(scheduler: Scheduler, reporter: Reporter) -> None:
    """The schedule's sizes (and the throughput schedule's predicted documents/hour), at start."""
    info = scheduler.info
    source = info["batch_size_from"]
    why = "`batch_size`" if source == "batch_size" else source
    if source == "batch_size, memory headroom":
        why = f"`batch_size` {scheduler.config.batch_size:,} cut to what memory holds"
    if source == "batch_size, pool plan":  # the throughput schedule: more would only wait for memory
        why = f"`batch_size` {scheduler.config.batch_size:,} cut to the most a pool plan takes"
    reporter.message(f"batch size {scheduler.batch_size} ({why}), usable context {scheduler.context} tokens")
    asked = scheduler.config.context
    if asked and asked > scheduler.context:  # a user trial: --context 100000 became 8192 unsaid
        why = "the memory left allows" if info["context_limited_by_memory"] else "the model's context is"
        reporter.message(f"`context` {asked} lowered to {scheduler.context} tokens: {why} {scheduler.context}")
    pools = scheduler.pools
    if info["schedule"] == "throughput":
        predicted = (f"; predicted {rate_text(pools.docs_per_hour)} documents/hour for documents of ~{pools.prompt_tokens} "
                     f"prompt tokens and {pools.output_tokens}-token summaries") if pools is not None else ""
        if pools is not None and pools.calls > 1:  # a long document: its parts, then the calls combining them
            predicted = (f"; predicted {rate_text(pools.docs_per_hour)} documents/hour for documents of "
                         f"~{pools.document_tokens} tokens, each summarised in {pools.calls} calls of up to "
                         f"~{pools.prompt_tokens} prompt tokens and {pools.output_tokens}-token summaries")
        bits = scheduler.config.kv_bits
        reporter.message(f"throughput schedule: prompts read {scheduler.prefill_batch} at a time in pools of "
                         f"{scheduler.pool_tokens} tokens, up to {count_text(scheduler.batch_size, 'sequence')} decoding "
                         f"together{f' (KV caches at {bits} bits)' if bits else ''}{predicted}")
        if pools is not None and pools.limited_by == "memory" and bits is None:
            share = kv_element_bytes(8, scheduler.kv_itemsize) / scheduler.kv_itemsize
            reporter.message(f"memory bounds the pool at {count_text(pools.decode_pool, 'sequence')}: `kv_bits` 8 would store "
                             f"their KV caches in {share:.2f}x the bytes (summaries may then differ)")


def achieved(scheduler: Scheduler, run: RunSpeed, failed: int, reporter: Reporter) -> None:
    """Documents/hour this run achieved, beside the prediction: ``generation.achieved_docs_per_hour``
    in report.json and, with the throughput schedule's prediction, a message.

    The figure is ``run.documents_per_hour`` (:mod:`mlx_tier.rates`): the documents this run
    summarised (``done``; failed documents and refused batch requests are not counted, ``failed``
    of them are named beside it) over its generation time, from its model loaded to its last
    document (or its stop). So it is the summary line's "this run: N documents/hour", one number. The
    prediction (``scheduler.pools.docs_per_hour``) is documents per hour of generation too, but
    models the steps alone (and the ``--max-tok-s`` cap): what it leaves out (planning the pools
    before the first step, waiting for a conversion, the throttle's pauses for heat or
    battery) counts here, which a job of a few documents
    shows as an achieved rate well under the prediction. Nothing summarised: 0 recorded and
    said so; no time measured (no document finished): nothing."""
    if run.generation_seconds <= 0:
        return
    scheduler.info["achieved_docs_per_hour"] = run.documents_per_hour
    if scheduler.pools is None:
        return
    predicted = f"predicted {rate_text(scheduler.pools.docs_per_hour)}"
    if not run.documents:
        reporter.message(f"achieved 0 documents/hour: none summarised, {failed} failed ({predicted})")
        return
    counted = f"{run.documents} summarised over {seconds_text(run.generation_seconds)} of generation" \
        + (f"; {failed} failed, not counted" if failed else "")
    reporter.message(f"achieved {rate_text(run.documents_per_hour)} documents/hour ({counted}; {predicted})")


class LayerProgress:
    """Progress during a long prefill step: before MoE layers, at most every
    :data:`LAYER_PROGRESS_SECONDS`, the last step's activity is sent again with the
    step's latest prompt shown as read up to the layers done (an estimate), the
    hit rate so far and whether a stop was asked. The step's own prompts are
    shown, so the first step of a run and a step that starts a new prompt show
    what they read."""

    def __init__(self, reporter: Reporter, progress, layers: int, hit_rate=lambda: 0.0, stopping=lambda: False):
        self.reporter, self.progress, self.layers, self.hit_rate = reporter, progress, max(1, layers), hit_rate
        self.stopping = stopping
        self.last = Activity([], None, [], 0.0, 0.0, 0.0)
        self.sent = time.monotonic()

    def step_done(self, activity: Activity) -> None:
        self.last, self.sent = activity, time.monotonic()

    def layer(self, layer: int, reading: list[tuple[str, int, int, int]]) -> None:
        """Before MoE layer ``layer`` of a prefill step reading ``reading``: ``(document id,
        prompt tokens read before the step, tokens in this step, prompt length)`` each."""
        now = time.monotonic()
        if not reading or now - self.sent < LAYER_PROGRESS_SECONDS:
            return
        self.sent = now
        shown = [(doc, min(total, before + chunk * layer // self.layers), total) for doc, before, chunk, total in reading]
        in_flight = list(dict.fromkeys(self.last.in_flight + [d for d, *_ in reading]))  # a document's parts: once
        activity = replace(self.last, in_flight=in_flight, hit_rate=self.hit_rate(), stopping=self.stopping(),
                           reading=shown[-1], also_reading=tuple(shown[:-1]))
        self.reporter.working(activity)
        self.progress.update(activity)
