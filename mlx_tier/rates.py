"""A run's speeds, defined once: what "output tok/s" and "documents/hour" mean in
the terminal's summary, report.json, report.html (the watch page) and
``mlx-tier status``. Everything that shows a run's speed computes it here.

A run has two phases, timed on a monotonic clock (a step of the wall clock, by
NTP or by hand, changes neither):

- **loading**: from the run's start to its model loaded (building the demo
  model, reading a checkpoint from the hub cache, loading it), reported apart;
- **generation**: from the model loaded to the run's last document finished
  or failed (to now, while it runs; to its stop, when a stop left documents).
  Prompt reading, document conversion and throttle pauses happen inside it
  and count.

Output tok/s is the tokens the run generated over its generation time;
documents/hour is the documents it summarised (``done``) over the same time
(failed documents and refused batch requests are not counted); the achieved rate
said beside the throughput schedule's prediction is this figure
(:func:`mlx_tier.job.activity.achieved`).
Documents of a batch are written together, so neither is a sum of per-document
figures. Both are published rounded to 3 decimals, and every display formats
that one number (formatting the unrounded figure can round the other way:
135.1351 shows as 135.14, its published 135.135 as 135.13).
"""

from __future__ import annotations

from dataclasses import dataclass


def generated_tokens(record) -> int:
    """Tokens a run generated for one document: a done record's (a journal entry, or a
    :class:`~mlx_tier.job.report.DocResult`) ``output_tokens`` less its ``kept_tokens``
    (the calls of a long document an earlier run kept, or a copy's: written, not generated
    again); 0 for anything not done."""
    get = record.get if isinstance(record, dict) else lambda k, d=None: getattr(record, k, d)
    if get("status") != "done":
        return 0
    return int(get("output_tokens", 0) or 0) - int(get("kept_tokens", 0) or 0)


# One sentence, shown beside the figures (the page, `status`).
DEFINITION = ("over the run's generation time: from its model loaded to its last document finished "
              "(now, while it runs; its stop, if stopped early); loading is counted apart; prompt reading and "
              "throttle pauses count")


@dataclass(frozen=True)
class RunSpeed:
    """One run's speeds (module doc).

    Attributes:
        output_tokens: tokens the run generated.
        documents: documents the run summarised (done; failures excluded).
        generation_seconds: seconds from the model loaded to the last document
            finished or failed (to now while running; to the stop, a stop that left
            documents); monotonic.
        load_seconds: seconds from the run's start to its model loaded
            (``None``: unknown, e.g. a journal written before it was recorded).
    """

    output_tokens: int
    documents: int
    generation_seconds: float
    load_seconds: float | None = None

    @property
    def output_tok_per_s(self) -> float:
        """Output tokens per second of generation, to 3 decimals (0 when no time was measured)."""
        return round(self.output_tokens / self.generation_seconds, 3) if self.generation_seconds > 0 else 0.0

    @property
    def documents_per_hour(self) -> float:
        """Documents summarised per hour of generation, to 3 decimals (0 when no time was measured)."""
        return round(self.documents / self.generation_seconds * 3600, 3) if self.generation_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        """JSON-ready figures, rounded: seconds to ms, rates to 3 decimals."""
        return {"load_seconds": None if self.load_seconds is None else round(self.load_seconds, 3),
                "generation_seconds": round(self.generation_seconds, 3),
                "output_tok_per_s": self.output_tok_per_s, "documents_per_hour": self.documents_per_hour}
