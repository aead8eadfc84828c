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

from collections.abc import Callable, Iterable
from pathlib import Path

from mlx_tier.job.config import JobConfig
from mlx_tier.job.provenance import Settings
from mlx_tier.job.triage import Triage
from mlx_tier.outdir.layout import rank_parts
from mlx_tier.outdir.parts import PartStore, forget
from mlx_tier.units import count_text


def call_identity(settings: Settings, computes: dict) -> dict:
    """What decides a call's tokens besides its prompt (JSON-able): ``settings``' record
    fields, the model by its fingerprints where known (not by the path it was given as),
    and ``computes``: the expert kernel and dtype as the load chose them (report.json's
    ``kernel`` and ``dtype``) and the dense and attention kernels asked for."""
    fields = settings.fields()
    fields.pop("compute", None)  # ``computes`` says it, as calls kept by earlier versions were named
    model = fields["model"]
    if model.get("weights"):
        fields["model"] = {k: v for k, v in model.items() if k != "name"}
    return {**fields, **computes}


def open_parts(config: JobConfig, identity: dict, journal_name: str, tri: Triage,
               source: Callable[[str], str | None], part: bool) -> tuple[PartStore, list[str]]:
    """The store this run keeps its calls in and finds an earlier run's in, and lines for
    people: the calls kept under this identity for the pending documents made from their
    source as it is now (``source``: ``id -> sha256``, ``None`` unknown; asked only of the
    documents with kept calls), and what forgetting the lines of documents done and current
    (:func:`current_done`) met (unless a rank, ``part``)."""
    notes = [] if part else forget_finished(config.out_dir, current_done(tri))
    store = PartStore(config.out_dir, identity, rank_parts(journal_name))
    kept = store.docs(dict.fromkeys(tri.pending))  # then hashed: only the documents with kept calls
    kept = store.docs({i: source(i) for i in kept}) if kept else {}
    if kept:
        calls = sum(kept.values())
        notes.append(f"{count_text(len(kept), 'long document')} resume{'s' * (len(kept) == 1)} from "
                     f"{count_text(calls, 'finished call')} an earlier run kept")
    return store, notes


def current_done(tri: Triage) -> set[str]:
    """The documents whose summary is written and current: done and kept (not stale, not
    kept with other settings: a redo of those may have been stopped), recovered, reused."""
    return (set(tri.done) - set(tri.stale) - set(tri.kept_changed)) | set(tri.recovered) | set(tri.reused)


def forget_finished(out_dir: Path, finished: Iterable[str]) -> list[str]:
    """Drop the kept lines of the documents ``finished`` (:func:`~mlx_tier.outdir.parts.forget`:
    only a run holding the output folder); a line for people when the files cannot be
    rewritten (not raised)."""
    try:
        forget(out_dir, finished)
    except OSError as e:
        return [f"parts: cannot rewrite {e.filename}: {e.strerror or e}"]
    return []
