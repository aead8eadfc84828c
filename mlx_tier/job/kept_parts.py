"""A run's store of long documents' finished calls (:mod:`mlx_tier.outdir.parts`): what
identifies a call, and the store opened at a run's start with the lines of documents
finished since dropped.

A call's result depends on its prompt tokens and on what computes them: the model
(weights, config, tokenizer), the instruction, the KV bits and generation options
(:meth:`~mlx_tier.job.provenance.Settings.fields`), and the expert kernel, its dense
and attention kernels and the dtype (with the ``cpu`` kernel tokens agree with MLX's
only within its stated bound). The schedule, pools, batch and cache sizes do not
change a call's tokens on the MLX path (the engine's exactness), so a call finished
under the paced schedule is reused under the throughput one.
"""

from __future__ import annotations

from collections.abc import Iterable

from mlx_tier.job.config import JobConfig
from mlx_tier.job.provenance import Settings
from mlx_tier.outdir.layout import rank_parts
from mlx_tier.outdir.parts import PartStore


def call_identity(settings: Settings, tier) -> dict:
    """What decides a call's tokens besides its prompt (JSON-able): ``settings``'
    record fields and ``tier``'s (:class:`~mlx_tier.engine.load.TierConfig`) kernels and dtype."""
    dtype = getattr(tier, "dtype", None)
    return {**settings.fields(), "kernel": getattr(tier, "kernel", None),
            "dense_kernel": getattr(tier, "dense_kernel", None),
            "attention_kernel": getattr(tier, "attention_kernel", None),
            "dtype": str(dtype) if dtype is not None else None}


def open_parts(config: JobConfig, settings: Settings, journal_name: str, records: dict[str, dict],
               pending: Iterable[str], part: bool) -> tuple[PartStore, list[str]]:
    """The store this run keeps its calls in and finds an earlier run's in, and lines for
    people: the calls kept for the ``pending`` documents, and what :func:`forget_finished`
    says (it runs first, on the job's journal ``records``)."""
    store = PartStore(config.out_dir, call_identity(settings, config.tier), rank_parts(journal_name))
    notes = forget_finished(store, records, part)
    pending = set(pending)
    kept = {i: n for i, n in store.docs().items() if i in pending}
    if kept:
        calls = sum(kept.values())
        notes.append(f"{len(kept)} long document(s) resume from {calls} finished call{'s' * (calls != 1)} "
                     "an earlier run kept (each reused where the document and settings are unchanged)")
    return store, notes


def forget_finished(store: PartStore, records: dict[str, dict], part: bool) -> list[str]:
    """Rewrite the job's ``parts.jsonl`` without the lines of the documents whose latest
    journal record (``records``) is ``done`` (not by a rank, ``part``: only the job's
    runs rewrite it). Returns a line for people when it cannot be rewritten (not raised)."""
    if part:
        return []
    try:
        store.forget(i for i, rec in records.items() if rec.get("status") == "done")
    except OSError as e:
        return [f"parts: cannot rewrite {e.filename}: {e.strerror or e}"]
    return []
