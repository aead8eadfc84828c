"""Durable job state: an fsync'ed append-only journal and atomic output writes.

Invariant: a finished output is never lost or rewritten. An output file is
written to a temporary name, fsync'ed and renamed into place, so it exists
only when complete; then a ``done`` record is appended to ``journal.jsonl``
and fsync'ed. After a crash between the two, the rerun finds the complete
output without its record and records it instead of regenerating it.

Nothing here follows a link planted in the output folder: appends open with
``O_NOFOLLOW``, outputs are renamed into place (a rename replaces a link, it
never writes through it), and :func:`mlx_tier.outdir.layout.check_out_dir` refuses a folder whose
job files are links. A failed append (disk full) is cut back, so the file
holds only whole records; the error names the file.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlx_tier.fsio import _NOFOLLOW, _append_line, named
from mlx_tier.outdir.layout import JOURNAL, rank_journals

_NUMBER = (int, float)
# Field -> the types a record may give it (others: any JSON value).
_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "status": (str,), "event": (str,), "name": (str,), "time": _NUMBER, "seconds": _NUMBER,
    "throttled_seconds": _NUMBER, "input_tokens": (int,), "output_tokens": (int,), "parts": (int,),
    "parts_kept": (int,), "kept_tokens": (int,), "error": (str, type(None)), "output": (str, type(None)),
    "finish_reason": (str, type(None)),
    "started": _NUMBER, "pid": (int,), "ids": (list,), "todo": (list,), "left": (list,), "command": (str, type(None)),
    "input": (str,), "output_format": (str,), "error_code": (str, type(None)), "error_param": (str, type(None)),
    # a run's identity and clock (RunClock), what a summary was made from and with
    "run": (str,), "run_t": _NUMBER, "mono": _NUMBER, "host": (str,), "made_from": (dict,),
    "model": (dict, type(None)), "prompt": (str, type(None)), "prompt_text": (str,), "redo": (str,),
    "reused": (str,), "generation": (dict,), "doc": (str,), "output_sha256": (str,), "source": (str,),
    "cwd": (str,),
}


def record_problem(rec: object) -> str | None:
    """Why a parsed journal line is not a usable record, or ``None`` when it is.

    A record is an object; each field of :data:`_TYPES` it has is of its type
    (``True`` is not a number; numbers are finite); ``ids``/``todo`` are lists
    of strings; a document record (``id``) has a ``status``.
    """
    if not isinstance(rec, dict):
        return "not an object"
    for key, types in _TYPES.items():
        if key not in rec:
            continue
        value = rec[key]
        if not isinstance(value, types) or isinstance(value, bool) or (
                isinstance(value, float) and not math.isfinite(value)):
            return f'"{key}" is {json.dumps(value)[:40]}, not {" or ".join(t.__name__ for t in types)}'
        if key in ("ids", "todo") and not all(isinstance(x, str) for x in value):
            return f'"{key}" must list strings'
    if "id" in rec and "status" not in rec:
        return 'a document record needs a "status"'
    return None


def new_run_id() -> str:
    """A fresh run id: the local start time, for people, and 6 random hex digits, so
    that two runs never share one (whatever the clocks say)."""
    return time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3)


@dataclass
class RunClock:
    """One run's identity and its clock.

    Every record a run appends carries ``run`` (its id) and ``run_t``: seconds since
    the run started, on the monotonic clock, so durations and rates never depend
    on the wall clock (``time`` stays on each record, for people). A run's
    records are found by its id, never by comparing wall times.

    Attributes:
        id: the run's id (:func:`new_run_id`); the ranks of a distributed run
            share their launcher's.
        origin: ``time.monotonic()`` when the run started.
    """

    id: str = field(default_factory=new_run_id)
    origin: float = field(default_factory=time.monotonic)

    def t(self) -> float:
        """Seconds since the run started (monotonic)."""
        return time.monotonic() - self.origin


class Journal:
    """Append-only record of document states in ``OUT_DIR/journal.jsonl``.

    Each line is one JSON object with at least ``id``, ``status`` (``done`` or
    ``failed``) and ``time`` (Unix seconds, for people). The last record of an
    id in file order wins. A torn last line (crash mid-append) is ignored.
    Records without an ``id`` (e.g. throttle events) are kept for
    :meth:`entries` only.

    Args:
        out_dir: the job's output folder.
        on_done: called with each ``done`` record before it is appended (the
            JSONL export, :meth:`JsonlSummaries.add`); if it raises, the
            record is not appended.
        on_failed: the same for each ``failed`` record (the JSONL export drops
            the document's line: :meth:`JsonlSummaries.drop`).
        name: the journal's file name in ``out_dir`` (default: the job's one journal).
        clock: the run appending (:class:`RunClock`): each record gets its
            ``run`` and ``run_t``; ``None``: neither (a reader).
    """

    def __init__(self, out_dir: Path, on_done: Callable[[dict], None] | None = None, name: str = JOURNAL,
                 clock: RunClock | None = None, on_failed: Callable[[dict], None] | None = None):
        self.path = Path(out_dir) / name
        self.on_done, self.on_failed = on_done, on_failed
        self.clock = clock
        self.warnings: dict[int | str, str] = {}  # line number (a rank journal's: path:line) -> why skipped

    def entries(self) -> Iterator[dict]:
        """Every usable record in file order. A torn line (crash mid-append) is
        skipped quietly; a whole line that is not a usable record
        (:func:`record_problem`) is skipped with a warning in :attr:`warnings`.

        The job's ``journal.jsonl`` also brings the rank journals of its
        distributed runs, each run's right after its start record (:func:`merged`)."""
        # A distributed run's ranks each append to their own journal; readers see them merged.
        extra = rank_journals(self.path.parent) if self.path.name == JOURNAL else []
        if not extra:
            yield from self._read(self.path)
            return
        runs: dict[str, list[Iterator[dict]]] = {}
        for path in extra:  # OUT_DIR/ranks/<run id>/journal-<k>.jsonl
            runs.setdefault(path.parent.name, []).append(self._read(path))
        yield from merged(self._read(self.path), runs)

    def _read(self, path: Path) -> Iterator[dict]:
        """The usable records of one journal file (see :meth:`entries`)."""
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except FileNotFoundError:
            return
        except OSError as e:
            raise named(e, path) from None
        key = (lambda n: n) if path == self.path else (lambda n: f"{path}:{n}")
        with os.fdopen(fd, "rb") as f:
            for n, line in enumerate(f, 1):
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    if line.endswith(b"\n") and line.strip():
                        self.warnings[key(n)] = f"{path}:{n}: skipped (not JSON)"
                    continue  # a torn write at the end of a crashed run
                problem = record_problem(rec)
                if problem is not None:
                    self.warnings[key(n)] = f"{path}:{n}: skipped ({problem})"
                    continue
                yield rec

    def records(self) -> dict[str, dict]:
        """The latest record of each document id."""
        return {rec["id"]: rec for rec in self.entries() if "id" in rec}

    def names(self) -> dict[str, str]:
        """``name -> id`` of every document an earlier run recorded (done or failed),
        so a rerun gives each document the same output name (:mod:`mlx_tier.job.naming`)."""
        return {rec["name"]: rec["id"] for rec in self.entries() if "id" in rec and "name" in rec}

    def append(self, record: dict) -> dict:
        """Durably append one record (``time`` is added, and the clock's ``run`` and ``run_t``);
        the state change is on disk when this returns. Returns the record as appended."""
        record = {**record, "time": round(time.time(), 3)}
        if self.clock is not None:
            record.setdefault("run", self.clock.id)
            record["run_t"] = round(self.clock.t(), 3)
        if self.on_done is not None and record.get("status") == "done":
            self.on_done(record)
        if self.on_failed is not None and record.get("status") == "failed":
            self.on_failed(record)
        # ASCII JSON: a file name that is not valid UTF-8 (a lone surrogate
        # after decoding) round-trips as \udcXX instead of failing the append.
        _append_line(self.path, (json.dumps(record) + "\n").encode("ascii"))
        return record


def _t(rec: dict) -> float:
    t = rec.get("run_t")
    return float(t) if isinstance(t, (int, float)) else 0.0


def merged(main: Iterable[dict], runs: dict[str, list[Iterable[dict]]]) -> Iterator[dict]:
    """The job's journal with its distributed runs' rank journals spliced in, ordered
    without the wall clock.

    ``main`` (``journal.jsonl``) is read in file order; right after the start record
    of a distributed run (its ``run`` names the folder ``ranks/<run>/``) come that
    run's rank journals, ordered by their ``run_t`` (each rank's monotonic seconds since it
    started; the ranks start together). The ranks of one run write disjoint documents
    (:mod:`mlx_tier.ranks.stealing`), so how their records interleave orders only the
    page's samples, never which record of a document wins. Rank journals of a run that
    no start record names (written before runs had ids) are merged with the whole
    journal by wall ``time``, as they were then.

    Args:
        main: the records of ``journal.jsonl``, in file order.
        runs: run id -> the record streams of its rank journals.
    """
    main = list(main)
    groups = {run: [rec for stream in streams for rec in stream] for run, streams in runs.items()}
    named_runs = {rec.get("run") for rec in main if rec.get("event") == "start"}
    if any(run not in named_runs for run in groups):  # an older journal: by wall time, stable
        everything = main + [rec for group in groups.values() for rec in group]
        everything.sort(key=lambda rec: rec.get("time", 0.0))
        yield from everything
        return
    for rec in main:
        yield rec
        if rec.get("event") == "start" and rec.get("run") in groups:
            yield from sorted(groups.pop(rec["run"]), key=_t)


def as_written(records: Iterable[dict]) -> Callable[[dict], dict]:
    """A function giving each ``done`` record of ``records`` as this version records it, so that
    records of one model and context read as one whatever version wrote them: a record of an
    earlier version (its ``model`` has no ``context``) gets this version's fingerprints of the
    same model (the ``(weights, config)`` this version's records name as ``earlier``), and
    its ``context`` (``None``: the model's; or beyond the model's) the context it ran with
    (this version's records of that weights and config name it). This version's records, and
    records no newer record names, stay as they are; none is changed in place."""
    aliases: dict[tuple[str, str | None], tuple[str, str | None]] = {}
    contexts: dict[tuple[str, str | None], int] = {}
    for rec in records:
        model = rec.get("model") if isinstance(rec.get("model"), dict) else {}
        weights, config = model.get("weights"), model.get("config")
        if not isinstance(weights, str):
            continue
        for old in model.get("earlier") if isinstance(model.get("earlier"), list) else []:
            if isinstance(old, dict) and isinstance(old.get("weights"), str):
                aliases[old["weights"], old.get("config")] = (weights, config)
                aliases.setdefault((old["weights"], None), (weights, config))  # a record keeping no config
        if isinstance(model.get("context"), int):
            contexts[weights, config] = model["context"]

    def now(rec: dict) -> dict:
        model = rec.get("model") if isinstance(rec.get("model"), dict) else None
        if model is None or "context" in model or not (aliases or contexts):  # this version's: as written
            return rec
        key = aliases.get((model.get("weights"), model.get("config")))
        if key is not None:
            model = {**model, "weights": key[0], **({"config": key[1]} if key[1] is not None else {})}
            rec = {**rec, "model": model}
        generation, most = rec.get("generation"), contexts.get((model.get("weights"), model.get("config")))
        if isinstance(generation, dict) and most is not None and "context" in generation and (
                generation["context"] is None or isinstance(generation["context"], int)):
            rec = {**rec, "generation": {**generation, "context": min(generation["context"] or most, most)}}
        return rec

    return now


def short_fingerprint(fingerprint: str) -> str:
    """A fingerprint's first 8 hex digits, for people (its version tag,
    :data:`mlx_tier.engine.fingerprints.TAG`, left out: that module is not imported here,
    the read-only side loading no MLX)."""
    return fingerprint.removeprefix("v2-")[:8]


def written_with(rec: dict) -> tuple[str | None, str | None, str | None]:
    """``(model name, weights fingerprint, prompt hash)`` a ``done`` record says wrote its
    summary; each ``None`` when not recorded (a summary of a version before they were)."""
    model = rec.get("model") if isinstance(rec.get("model"), dict) else {}
    name, weights = model.get("name"), model.get("weights")
    return (name if isinstance(name, str) else None, weights if isinstance(weights, str) else None,
            rec.get("prompt") if isinstance(rec.get("prompt"), str) else None)


def written_options(rec: dict) -> dict:
    """The other settings a ``done`` record says its summary was made with, for people:
    the generation options (``max_tokens``, ``repetition_penalty``, ``context``),
    ``kv_bits``, the kernel and cast (``"cpu/float32"``) and the model's ``config``
    fingerprint (its first 8 characters), each only where recorded."""
    generation = rec.get("generation") if isinstance(rec.get("generation"), dict) else {}
    model = rec.get("model") if isinstance(rec.get("model"), dict) else {}
    compute = rec.get("compute") if isinstance(rec.get("compute"), dict) else {}
    out = {k: v for k, v in generation.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    if isinstance(rec.get("kv_bits"), int):
        out["kv_bits"] = rec["kv_bits"]
    if isinstance(compute.get("kernel"), str):
        out["kernel"] = "/".join(str(compute[k]) for k in ("kernel", "dtype") if isinstance(compute.get(k), str))
    if isinstance(model.get("config"), str):
        out["config"] = short_fingerprint(model["config"])
    return out


def written_by(records: Iterable[dict]) -> list[dict]:
    """The settings the given ``done`` records were written with, counted:
    ``[{"model", "weights", "prompt", "options", "documents"}]``, most documents first
    (``None`` values: not recorded, a summary of an older version; ``options``:
    :func:`written_options`), each record as this version records it (:func:`as_written`)."""
    records = list(records)
    now = as_written(records)
    counts = Counter((*written_with(now(rec)), tuple(sorted(written_options(now(rec)).items()))) for rec in records)
    return [{"model": m, "weights": w, "prompt": p, "options": dict(o), "documents": n}
            for (m, w, p, o), n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))]


def options_apart(written: list[dict], options: dict | None) -> str:
    """``options`` (:func:`written_options`) reduced to the keys whose values differ among the
    groups of ``written`` (:func:`written_by`) that recorded options, as text:
    ``"max_tokens 64"``; ``"options not recorded"`` for a summary that recorded none
    beside groups that did; ``""`` when nothing tells it apart."""
    recorded = [w["options"] for w in written if w.get("options")]
    if not options:
        return "options not recorded" if recorded else ""
    keys = sorted({k for g in recorded for k in g if len({repr(h.get(k)) for h in recorded}) > 1})
    return ", ".join(f"{k} {options[k]}" for k in keys if k in options)


def prompt_texts(entries: Iterable[dict]) -> dict[str, str]:
    """``prompt hash -> instruction text`` from the journal's start records (each run's, once)."""
    return {rec["prompt"]: rec["prompt_text"] for rec in entries
            if rec.get("event") == "start" and isinstance(rec.get("prompt"), str)
            and isinstance(rec.get("prompt_text"), str)}


@dataclass(frozen=True)
class JobInfo:
    """What a run set out to do: a ``{"event": "start", ...}`` record in the journal,
    appended when the run starts (the last one describes the current or last run).

    Attributes:
        input: the job's INPUT as given (``-`` for a list on stdin).
        ids: every document id of the job, in input order.
        todo: the ids this run will try (pending, or failed with ``--retry-failed``).
        started: Unix seconds when this run began generating (model loaded), for people.
        pid: the process running it.
        command: the command line that resumes it, when the CLI gave one.
        output_format: ``md`` or ``jsonl``.
        run: the run's id (:class:`RunClock`); its records carry it. ``None``:
            a journal written before runs had ids.
        run_t: seconds from the run's start to this record, i.e. to its model
            loaded (the loading time, :mod:`mlx_tier.rates`); monotonic.
        mono, host: ``time.monotonic()`` on ``host`` when the record was written,
            so that a reader on the same machine times the run's generation on
            the same monotonic clock.
        model: ``{"name", "weights"}``: the model as given (path, repo id, or
            ``demo``) and its weights' fingerprint
            (:func:`mlx_tier.engine.fingerprints.weights_fingerprint`).
        prompt, prompt_text: the instruction's hash (what each summary records)
            and its text (here once).
        cwd: the folder the command was given in (its paths may be relative to it).
        writes: ``True``: the run journals a ``writing`` record before each output it
            renames into place (:func:`mlx_tier.job.provenance.writing_record`), so an
            output of its documents that no record names is not its own; ``None``: an
            older version's run, which did not.
        reports: ``True``: the run's record in report.json carries its id, so a run whose id
            no record there has ended without writing its report (killed, crashed:
            :func:`mlx_tier.job.report.unreported_runs`); ``None``: an older version's.
        left: the ids the run leaves for a plain rerun though an earlier run summarised them
            (a ``--retry-failed`` run's stale ones): pending, their summary not current;
            ``None``: none, or an older version's run.
        retry_failed: whether the run was a ``--retry-failed`` one (its ``todo``: the failed
            documents); ``False``: a failed document in its ``todo`` is retried because
            its source changed, and a plain rerun would retry it too; ``None``: not
            recorded (an older version).
    """

    input: str
    ids: list[str]
    todo: list[str]
    started: float
    pid: int
    command: str | None = None
    output_format: str = "md"
    run: str | None = None
    run_t: float | None = None
    mono: float | None = None
    host: str | None = None
    model: dict | None = None
    prompt: str | None = None
    prompt_text: str | None = None
    cwd: str | None = None
    writes: bool | None = None
    reports: bool | None = None
    retry_failed: bool | None = None
    left: list[str] | None = None

    def write(self, journal: Journal) -> dict:
        """Durably append this run's ``start`` record to ``journal`` (its ``run`` and
        ``run_t`` from the journal's clock when not given) and return it.

        Raises:
            OSError: not writable, disk full.
        """
        fields = {k: v for k, v in asdict(self).items() if v is not None or k in ("command",)}
        return journal.append({"event": "start", **fields})

    @classmethod
    def last(cls, entries: list[dict]) -> JobInfo | None:
        """The last ``start`` record among journal ``entries``, or ``None``."""
        for rec in reversed(entries):
            if rec.get("event") == "start":
                try:
                    return cls(**{k: rec[k] for k in cls.__dataclass_fields__ if k in rec})
                except TypeError:
                    return None
        return None
