"""What a rerun does with the summaries earlier runs left, decided before any model loads.

The facts :func:`~mlx_tier.job.triage.triage` needs beyond the journal: the hash
of each document's source now, and this run's model and prompt
(:mod:`mlx_tier.job.provenance`), the model found where it already is (nothing
downloaded or built to answer); and the runner's part after the decision:
judging outputs a crash left unrecorded by the record written before their
rename (:func:`doubt_unrecorded`), copying a reused summary under its new name,
and the lines that say what the run does with stale summaries (and a batch
request file's stale answers: :func:`request_hashes`) and with summaries
written under other settings. Before all that, a run whose documents would be
summarised over the finished summaries of other files (another input of the
same names, run into the same folder) is refused (:func:`refuse_other_files`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from mlx_tier.errors import CheckpointError, InputError
from mlx_tier.fsio import read_nofollow, write_atomic
from mlx_tier.job.documents import source_field, source_file
from mlx_tier.job.provenance import (
    GENERATION_KEYS,
    SETTINGS_FIELDS,
    Settings,
    generation_fields,
    prompt_hash,
    recorded_hash,
    request_stamp,
    rewritten_since_done,
    text_stamp,
    vouched,
    was_unreadable,
    writing_record,
)
from mlx_tier.job.triage import FIGURES, Triage
from mlx_tier.outdir.journal import Journal
from mlx_tier.outdir.layout import BATCH_OUTPUT
from mlx_tier.units import count_text

# What a reused summary's record takes from the record of the summary it copies.
_REUSED_KEEPS = (*FIGURES, *SETTINGS_FIELDS)


def current_hashes(docs, records: Mapping[str, dict]) -> dict[str, str | None]:
    """``id -> sha256`` of each document's source now (:attr:`~mlx_tier.job.documents.FileDocument.stamp`:
    a file is read once, not converted), or ``{}`` when no earlier summary or failure recorded
    a hash (a first run, or a journal of an older version: nothing to compare with).

    Hashed: every document with a summary (is it stale?) or a failure (was it fixed?), and a
    pending one only when its
    size equals a summarised source's (could it be one renamed or copied?); the others
    are ``None``, so that a rerun of a large job reads only what it compares."""
    stamped = [r for r in records.values() if r.get("status") == "done" and recorded_hash(r)]
    failed = {i for i, r in records.items()
              if r.get("status") == "failed" and (recorded_hash(r) or was_unreadable(r))}
    if not stamped and not failed:
        return {}
    sizes = {r["made_from"].get("size") for r in stamped}
    out = {}
    for d in docs:
        rec = records.get(d.id) or {}
        if (rec.get("status") == "done" and recorded_hash(rec)) or d.id in failed or _size(d) in sizes:
            out[d.id] = d.stamp.sha256 if d.stamp is not None else None
        else:
            out[d.id] = None
    return out


def request_hashes(docs, records: Mapping[str, dict]) -> dict[str, str]:
    """``id -> sha256`` of each batch request now (its stamp:
    :func:`~mlx_tier.job.provenance.request_stamp`, url and body), which
    :func:`~mlx_tier.job.triage.triage` compares with the hash its answer's record keeps.

    An answer recorded before requests were stamped whole keeps the hash of its
    messages' (or prompt's) text only (``"hashed": "text"``): while that text is as it
    was, the recorded hash is given back, so the answer is taken as current (the options
    it ran with were not recorded; redoing every such request once would run the whole
    batch again); a changed text gives the request's hash, so it is stale. What the
    rerun says of those: :func:`rerun_notes`. Likewise an answer of a request without its
    own token limit recorded before the run's default was stamped with it
    (:func:`~mlx_tier.job.documents.with_default_limit`): its request as it was is current."""
    out, unlimited = {}, set(limit_unstamped(docs, records))
    for d in docs:
        rec = records.get(d.id) or {}
        was = _text_hash(rec)
        if was is not None and was == text_stamp(d.request.text).sha256:
            out[d.id] = was
        elif d.id in unlimited:
            out[d.id] = recorded_hash(rec)  # stamped before the default limit was: the request is as it was
        else:
            out[d.id] = d.stamp.sha256
    return out


def limit_unstamped(docs, records: Mapping[str, dict]) -> list[str]:
    """Ids of the requests without a token limit of their own whose answer was recorded
    before the run's ``--max-tokens`` was stamped with such requests: the request as it was
    then (its url and body) is unchanged, the limit it ran with unknown."""
    out = []
    for d in docs:
        made = recorded_hash(records.get(d.id) or {})
        if d.request is not None and made is not None and d.stamp.sha256 != made \
                and made == request_stamp(d.request.url, d.request.body).sha256:
            out.append(d.id)
    return out


def limit_note(docs, records: Mapping[str, dict], tri: Triage) -> list[str]:
    """The line that says how many answers :func:`limit_unstamped` took as current (``[]``: none)."""
    n = sum(i in tri.done for i in limit_unstamped(docs, records))
    if not n:
        return []
    return [f"{count_text(n, 'answer')} of requests without a token limit from an older mlx-tier: the `max_tokens` "
            f"they were answered within was not recorded; taken as current (delete one's line from {BATCH_OUTPUT} "
            "to redo it)"]


def _text_hash(rec: dict) -> str | None:
    """The hash a request's record keeps of its text only (an older version's), else ``None``."""
    made = rec.get("made_from")
    return recorded_hash(rec) if isinstance(made, dict) and made.get("hashed") == "text" else None


def _size(doc) -> int | None:
    """A document's size in bytes as its stamp would count them, without reading it (``None``: unknown)."""
    path = getattr(doc, "path", None)
    if path is None:
        return doc.stamp.size if doc.stamp is not None else None
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def model_name(model: Path | str | None) -> str:
    """The model as summaries name it: the folder or repo id as given, ``demo`` for the built-in one."""
    from mlx_tier.tools.demo_model import DEMO, is_demo

    return DEMO if is_demo(model) else str(model)


def locate_model(model: Path | str | None) -> Path | None:
    """The model's folder when it is on this machine already: a folder, a repo in the local
    hub cache, the demo built; ``None`` otherwise (nothing is downloaded or built here)."""
    from mlx_tier.engine.hub import cached_snapshot, is_repo_id
    from mlx_tier.tools.demo_model import built_demo_model, is_demo

    if is_demo(model):
        return built_demo_model()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    return cached_snapshot(str(model)) if is_repo_id(model) else None


def run_settings(model: Path | str | None, generation, model_dir: Path | None, requests: bool = False,
                 compute: dict | None = None, say=None) -> Settings:
    """This run's :class:`~mlx_tier.job.provenance.Settings` from its model and
    :class:`~mlx_tier.job.scheduler.GenerationConfig`; the weights' and config's
    fingerprints when ``model_dir`` is known and readable (else ``None``: compared by
    name; the load says what is wrong with an unreadable one). ``requests``: a request
    file's run, whose answers follow their own messages and options: no prompt nor
    generation options, only the model, KV cache and ``compute`` are compared.
    ``compute``: the kernel and cast its model computes with (``None``: not compared).
    ``say``: told, in words, when the weights are read for their fingerprint (a first run)."""
    from mlx_tier.engine.checkpoint import context_length
    from mlx_tier.engine.fingerprints import (
        config_fingerprint,
        earlier_fingerprints,
        weights_fingerprint,
    )
    from mlx_tier.job.model_setup import FALLBACK_CONTEXT

    weights = config = context = None
    earlier: tuple = ()
    if model_dir is not None:
        try:
            weights, config = weights_fingerprint(model_dir, say), config_fingerprint(model_dir)
            earlier = earlier_fingerprints(model_dir, weights)  # for records of earlier versions
            context = context_length(model_dir, FALLBACK_CONTEXT)
        except CheckpointError:
            pass
    if requests:
        return Settings(model_name(model), weights, None, generation.kv_bits, config, compute=compute, earlier=earlier)
    return Settings(model_name(model), weights, prompt_hash(generation.instruction), generation.kv_bits, config,
                    generation_fields(generation, context), compute, earlier, context)


def copy_reused(tri: Triage, records: Mapping[str, dict], docs, out_dir: Path, journal: Journal) -> list[str]:
    """Give each of ``tri.reused`` the summary of the document with its content: the output
    copied (atomically) under its own name and journalled ``done`` with ``reused``.

    Returns:
        the ids whose copy failed (the source output unreadable, the disk full...): the
        caller runs them as pending.
    """
    by_id, failed = {d.id: d for d in docs}, []
    for i, j in tri.reused.items():
        doc, rec = by_id[i], records[j]
        try:
            data = read_nofollow(Path(out_dir) / f"{j}.md")
            # the copy's bytes vouched for, as a summary's are: not taken later for someone's edit
            journal.append(writing_record(i, doc.stamp.as_dict(), data, {k: rec[k] for k in SETTINGS_FIELDS
                                                                         if k in rec}))
            write_atomic(Path(out_dir) / f"{i}.md", data)
        except OSError:
            failed.append(i)
            continue
        journal.append({"id": i, "status": "done", "output": f"{i}.md", "name": doc.name, "reused": j,
                        "made_from": doc.stamp.as_dict(), **source_field(doc),
                        **{k: rec[k] for k in _REUSED_KEEPS if k in rec}})
    return failed


def other_files(docs, records: Mapping[str, dict], out_dir: Path) -> list[tuple[str, str, str]]:
    """``(output, earlier file, this file)`` for each document whose output holds the finished
    summary of another file: its ``done`` record names a ``source``
    (:func:`~mlx_tier.job.documents.source_file`) that is not this document's file, still
    exists, and held other bytes than this file holds now. A source gone since (a folder
    moved or renamed) is not another file: its summary is this document's, judged by content
    as any other; nor is a file of the same bytes (a copy of the folder: its summary is
    current). A JSONL line's file is its JSONL file (``this file`` then names its line): a
    line of another JSONL file, or a file, is another file; a line of the same JSONL file
    is judged by content. A record without a ``source`` (an older version's) and a batch
    request are never another file.
    """
    found = []
    for d in docs:
        rec = records.get(d.id) or {}
        was = rec.get("source")
        if rec.get("status") != "done" or not isinstance(was, str):
            continue  # resolved only when there is a path to compare with
        now, output = source_file(d), Path(out_dir) / f"{d.id}.md"
        if now is not None and _another_file(was, now) and output.exists() and not _same_bytes(d, rec):
            found.append((str(output), was, os.path.abspath(d.source) if d.key is not None else now))
    return found


def _same_bytes(doc, rec: dict) -> bool:
    """Whether ``doc``'s source now holds the bytes its record's summary was made from."""
    made = recorded_hash(rec)
    return made is not None and doc.stamp is not None and doc.stamp.sha256 == made


def _another_file(was: str, now: str) -> bool:
    """Whether ``was`` is an existing file other than ``now`` (the same file by another path,
    a hard link or a name differing in case on a case-insensitive disk, is not)."""
    if was == now or not os.path.isfile(was):
        return False
    try:
        return not os.path.samefile(was, now)
    except OSError:  # either one unreadable now: not known to be another file
        return False


def refuse_other_files(docs, records: Mapping[str, dict], out_dir: Path) -> None:
    """Refuse a run that would summarise a document over the finished summary of another file
    (:func:`other_files`: another input of the same names run into the same output folder),
    before anything is written: a summary of another document is never redone or replaced.

    Raises:
        InputError: one line naming the first such output and both files.
    """
    found = other_files(docs, records, out_dir)
    if not found:
        return
    output, was, now = found[0]
    more = f" ({count_text(len(found) - 1, 'more document')} of this input likewise)" if len(found) > 1 else ""
    raise InputError(f"{output} holds the summary of {was}, not of this input's {now}, which has the same "
                     f"output name{more}; nothing was run. Give this input another `out_dir`, or list the files "
                     "of both on stdin (mlx-tier run -), which names each by its absolute path")


def rerun_counts(tri: Triage) -> dict:
    """What the triage found of earlier summaries, for the run's record
    (:func:`mlx_tier.job.report.rerun_account`)."""
    return {"stale": len(tri.stale) - len(tri.copied),  # the copied ones are current now
            "kept_changed": len(tri.kept_changed), "reused": len(tri.reused), "unstamped": len(tri.unstamped)}


def rerun_notes(tri: Triage, records: Mapping[str, dict], settings: Settings, retry_failed: bool,
                ids: list[str] | None = None, batch: bool = False) -> list[str]:
    """One line for each thing this run does with earlier summaries, or (``batch``) with the
    answers of a batch request file's earlier runs (``[]``: nothing to say); ``ids``: the
    job's documents (summaries of others are counted as left out). Library setting names
    are in backquotes (the CLI shows them as flags)."""
    notes = []
    if ids is not None:
        notes += _left_out(tri, records, ids, batch)
    noun = "request" if batch else "document"
    copied = tri.copied
    if len(tri.stale) > len(copied):
        notes.append(_stale_note(len(tri.stale) - len(copied), retry_failed, batch))
    if copied:
        what = ("answer" if batch else "summary") if len(copied) == 1 else ("answers" if batch else "summaries")
        notes.append(f"{count_text(len(copied), noun)} changed since {'answered' if batch else 'summarised'} to a "
                     f"text {'answered' if batch else 'summarised'} already: {'that' if len(copied) == 1 else 'those'} "
                     f"{what} copied, not written again")
    missing = [i for i in tri.missing if i in tri.pending]  # not those a copy of their content gives back
    if missing:
        what, where = ("answer", f"missing from {BATCH_OUTPUT}") if batch else ("summary", "missing (deleted since)")
        notes.append(f"{count_text(len(missing), what)} of earlier runs {where}: "
                     f"{'answering' if batch else 'writing'} {'it' if len(missing) == 1 else 'them'} again")
    if tri.failed_changed:
        notes.append(f"{count_text(len(tri.failed_changed), noun)} that failed in an earlier run changed since: "
                     f"trying {'it' if len(tri.failed_changed) == 1 else 'them'} again")
    if len(tri.reused) > len(copied):
        notes.append(f"{count_text(len(tri.reused) - len(copied), noun)} renamed or copied: the summary of the same "
                     "content copied under the new name, not written again")
    done = "answer" if batch else "summary"
    if tri.changed:  # a --retry-failed run tries failed ones only: the redo is a plain rerun's
        notes.append(f"`redo_changed`: {'leaving' if retry_failed else 'redoing'} "
                     f"{count_text(len(tri.changed), done)} written with another "
                     f"{_what(tri.changed, records, settings)}"
                     + (" for a rerun without `retry_failed`" if retry_failed else ""))
    if tri.kept_changed:
        notes.append(f"keeping {count_text(len(tri.kept_changed), done)} written with another "
                     f"{_what(tri.kept_changed, records, settings)}; redo "
                     f"{'it' if len(tri.kept_changed) == 1 else 'them'} with `redo_changed`")
    if tri.unstamped and batch:
        notes.append(f"{count_text(len(tri.unstamped), 'answer')} from an older mlx-tier record no request hash: "
                     f"taken as current (delete one's line from {BATCH_OUTPUT} to redo it)")
    elif tri.unstamped:
        notes.append(f"{count_text(len(tri.unstamped), 'summary')} from an older mlx-tier record no source hash, "
                     "model or prompt: taken as current (delete one's .md to redo it)")
    text_only = sum(_text_hash(rec) is not None and i not in tri.stale for i, rec in tri.done.items()) \
        if batch else 0
    if text_only:
        notes.append(f"{count_text(text_only, 'answer')} from an older mlx-tier record the hash of the messages' "
                     "text only, which is unchanged: taken as current (a changed option is not seen; delete "
                     f"one's line from {BATCH_OUTPUT} to redo it)")
    return notes


def _left_out(tri: Triage, records: Mapping[str, dict], ids: list[str], batch: bool) -> list[str]:
    """One line when earlier runs' summaries (or answers) are of documents (requests) not in
    this input: another input run into the same folder, or documents removed. One whose
    content a document of the job still has (a rename, a copy: its summary moved with it)
    is not counted."""
    job = set(ids)
    kept = {recorded_hash(records[i]) for i in job if (records.get(i) or {}).get("status") == "done"} - {None}
    gone = [i for i, r in records.items() if r.get("status") == "done" and i not in job
            and i not in tri.reused.values() and recorded_hash(r) not in kept]
    answers = [i for i in gone if records[i].get("output") == BATCH_OUTPUT]  # a request file's, else summaries
    notes = []
    for n, what, of in ((len(answers), "answer", "requests not in this file" if batch else "a request file's requests"),
                        (len(gone) - len(answers), "summary",
                         "documents, not requests" if batch else "documents not in this input")):
        if n:
            notes.append(f"{count_text(n, what)} of earlier runs {'is' if n == 1 else 'are'} of {of} (another "
                         "input, or removed): left on disk, not part of this job")
    return notes


def _stale_note(n: int, retry_failed: bool, batch: bool) -> str:
    """What the run does with ``n`` stale summaries, or (``batch``) answers of changed requests."""
    one = n == 1
    noun, done, old = ("request", "answered", f"answer stays in {BATCH_OUTPUT}") if batch else \
        ("document", "summarised", "summary stays")
    return (f"{count_text(n, noun)} changed since {done} (stale): "
            + (f"left for a plain rerun, which redoes {'it' if one else 'them'}" if retry_failed else
               f"redoing {'it; its' if one else 'them; each'} old {old} until the new one is complete"))


def _what(ids: list[str], records: Mapping[str, dict], settings: Settings) -> str:
    """``model``, ``prompt``, ```kv_bits```, ```max_tokens```... or several joined by "or":
    what the summaries ``ids`` were written with otherwise."""
    seen = Counter(x for i in ids for x in settings.differences(records[i]))
    names = {"model": "model", "prompt": "prompt", "kv_bits": "`kv_bits`", "kernel": "`kernel`"} | \
        {k: f"`{k}`" for k in GENERATION_KEYS}
    return " or ".join(name for x, name in names.items() if seen[x]) or "model or prompt"


def doubt_unrecorded(tri: Triage, entries: Iterable[dict], output_of: Callable[[str], Path], by_id: dict,
                     order: list[str], retry_failed: bool = False) -> None:
    """Check each output its records may not describe against the ``writing`` record its
    run journalled (:func:`~mlx_tier.job.provenance.vouched`): those of ``tri.recovered``
    (no ``done`` record) and done ones rewritten since their record
    (:func:`~mlx_tier.job.provenance.rewritten_since_done`: a redo renamed into place, not
    recorded). One the record vouches for is adopted with its ``made_from`` and settings
    (``tri.recovered_from``); one made from another version of its source (``tri.stale``)
    or, with no done record, one no run wrote, is redone (pending, in input order; with
    ``retry_failed`` left for a plain rerun); without a writing record (an older
    journal), or a done one still as recorded, it stays as it was. ``output_of``: an
    id's output path; ``by_id``: the job's documents.

    Raises:
        InputError: an output with no record, of a document a run that journals its
            outputs set out to do: someone else's file under the job's output name
            (counting it done would call the document summarised).
    """
    redo, entries = [], list(entries)  # read once, asked for each output
    # documents of runs that journal each output they write: one of theirs no record names is not theirs
    recording = {i for r in entries if r.get("event") == "start" and r.get("writes") is True
                 for i in r.get("todo") or [] if isinstance(i, str)}
    for i in _doubted(tri, entries):
        try:
            output = read_nofollow(output_of(i))
        except OSError:
            continue  # as it was; its record says what it is
        stamp = by_id[i].stamp
        said = vouched(entries, i, output, stamp.sha256 if stamp is not None else None)
        if said is None and i in recording and i in tri.recovered:
            raise InputError(f"{output_of(i)}: not written by mlx-tier (its journal records no output for "
                             f"{by_id[i].name}); move it out of the output folder, or delete it, to summarise "
                             "that document; nothing was run")
        if isinstance(said, dict):
            _adopt(tri, i, said)
        elif i in tri.stale:
            continue  # redone as it is
        elif said == "stale" or (said == "unwritten" and i not in tri.done):
            redo.append(i)
            _undone(tri, i)
            if said == "stale":
                tri.stale.append(i)
    _pending_again(tri, redo, order, retry_failed)


def doubt_answers(tri: Triage, entries: Iterable[dict], digests: dict[str, str | None], by_id: dict,
                  order: list[str], retry_failed: bool = False) -> None:
    """:func:`doubt_unrecorded` for a batch's answers: each line of ``output.jsonl`` its records
    may not describe (``tri.recovered``: no ``done`` record, a crash between its line and its
    record; and done ones whose last ``writing`` record came after: a redo's line, its record
    lost) is checked against the writing record its run journalled before the line
    (:func:`~mlx_tier.job.provenance.vouched`). One it vouches for, made from the request as
    it is now, is adopted with its ``made_from`` and settings (``tri.recovered_from``); a line
    made for another version of its request, or a recovered one no record names (an older
    version's run), is answered again, its line replaced (pending and ``stale``, in input
    order; with ``retry_failed``, left for a plain rerun). ``digests``: id -> the sha256 of
    its answer's line (``None``: no line)."""
    entries, redo = list(entries), []
    for i in _doubted(tri, entries):
        if digests.get(i) is None:
            continue  # no line: as its record says
        stamp = by_id[i].stamp
        said = vouched(entries, i, digests[i], stamp.sha256 if stamp is not None else None)
        if isinstance(said, dict):
            _adopt(tri, i, said)
        elif i in tri.stale:
            continue  # redone as it is
        elif i in tri.recovered or said == "stale":  # unvouched, or the answer to another version
            redo.append(i)
            _undone(tri, i)
    if redo:  # its line is replaced, as a stale answer's
        stale = set(tri.stale) | set(redo)
        tri.stale[:] = [i for i in order if i in stale]
    _pending_again(tri, redo, order, retry_failed)


def _doubted(tri: Triage, entries: list[dict]) -> list[str]:
    """The outputs their records may not describe: those of ``tri.recovered`` (no ``done``
    record), then done ones whose last ``writing`` record came after their ``done`` one
    (:func:`~mlx_tier.job.provenance.rewritten_since_done`: a redo's, its record lost)."""
    return [*tri.recovered, *sorted(rewritten_since_done(entries) & (set(tri.done) | set(tri.stale)))]


def _adopt(tri: Triage, i: str, said: dict) -> None:
    """``i``'s output as the writing record ``said`` vouches for it: as its done record says
    (a redo never renamed), or else a redo's, written into place with that record's source
    and settings (a ``--redo-changed`` run's): recovered with them (``tri.recovered_from``)."""
    if i in tri.done and (said.get("made_from") or {}).get("sha256") == recorded_hash(tri.done[i]) \
            and all(said.get(k) == tri.done[i].get(k) for k in SETTINGS_FIELDS):
        return
    _undone(tri, i)
    if i not in tri.recovered:
        tri.recovered.append(i)
    tri.recovered_from[i] = said


def _pending_again(tri: Triage, redo: list[str], order: list[str], retry_failed: bool) -> None:
    """``redo`` out of the recovered outputs and into the pending ones (with ``retry_failed``,
    those left for a plain rerun), in input ``order``."""
    if not redo:
        return
    tri.recovered[:] = [i for i in tri.recovered if i not in redo]
    into = tri.left if retry_failed else tri.pending
    waiting = set(into) | set(redo)
    into[:] = [i for i in order if i in waiting]


def _undone(tri: Triage, i: str) -> None:
    """Take ``i`` out of the done and stale documents (and their notes): its output is not
    what its record says."""
    tri.done.pop(i, None)
    for ids in (tri.kept_changed, tri.unstamped, tri.stale, tri.pending, tri.left):
        if i in ids:
            ids.remove(i)
