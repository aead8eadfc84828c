"""What each summary was made from and with, as its journal record keeps it.

A ``done`` record carries:

- ``made_from``: the source it read, ``{"sha256", "size", "mtime", "hashed"}``.
  For a file, the sha256 of its **bytes as stored** (``"hashed": "bytes"``),
  taken just before it is converted, ``size`` in bytes and ``mtime`` (Unix
  seconds). Bytes rather than the converted text: a rerun decides which
  summaries are current before converting anything (converting every finished
  PDF again on each rerun could take minutes), and any change of the bytes may
  change the text. A change that leaves the text as it was (a PDF saved again)
  therefore counts as a change: the summary is redone, never wrongly kept. A
  JSONL line has no bytes of its own: the sha256 of its text in UTF-8
  (``"hashed": "text"``, ``mtime`` ``None``). A batch request
  (:mod:`mlx_tier.job.batch_api`) is stamped whole, its ``url`` and ``body``
  in one canonical JSON form (:func:`request_stamp`, ``"hashed": "request"``):
  its messages or prompt and every body option may change the answer, the
  order of the line's keys does not. Answers recorded before requests were
  stamped whole keep the hash of their messages' text (``"hashed": "text"``):
  one whose text is unchanged is taken as current (a changed option was not
  recorded; :func:`mlx_tier.job.rerun.request_hashes`). Only the hash
  decides; size and mtime are there for people (a ``touch`` changes the
  mtime, not the hash).
- ``model``: ``{"name", "weights", "config", "earlier", "context"}``: the model as the
  user gave it (a folder, a repo id, or ``demo``), its weights' fingerprint
  (:func:`mlx_tier.engine.fingerprints.weights_fingerprint`) and that of the files
  beside them that decide its tokens: config, tokenizer, chat template
  (:func:`mlx_tier.engine.fingerprints.config_fingerprint`); ``earlier``: the same
  model's fingerprints as earlier versions took them (``[{"weights", "config"}]``), and
  its ``context`` in tokens, by which readers group older records with these
  (:func:`mlx_tier.outdir.journal.as_written`).
- ``prompt``: the instruction's hash (:func:`prompt_hash`); the run's start
  record holds the text once.
- ``kv_bits``: the bits of the KV caches it was generated with, when quantized
  (``run --kv-bits``: the tokens depend on them); absent: unquantized.
- ``generation``: the options of :data:`GENERATION_KEYS` it was generated with
  (``max_tokens``, ``repetition_penalty``, ``context``: each may change the
  summary; the schedule, pools and batch size do not, by the engine's exactness).
- ``compute``: ``{"kernel", "dtype"}``, the expert kernel and the cast its model
  computed with (``run --kernel``; the cast follows the kernel and the device:
  :mod:`mlx_tier.engine.compute`). The CPU kernel's logits are within a stated bound
  of MLX's, not equal, so another kernel may write other tokens.

What a rerun does with them (decided by :func:`mlx_tier.job.triage.triage`):
a summary whose source's hash changed is *stale* and redone by default (the
old one is replaced only when the new one is complete: outputs are renamed into
place; a request's ``output.jsonl`` line is replaced by rewriting the file
atomically, :class:`mlx_tier.job.outputs.BatchOutputs`); one written with
another model, prompt, option or kernel is kept, said in one line, and redone with
``redo_changed`` (the same for a model whose config or tokenizer changed; not
a request's: its answer is judged by its request's hash alone); a document
under a new name whose content
equals a summarised one's (a rename, a copy) gets that summary under its own
name, copied, not generated again (``reused`` in its record); records written
before these fields existed are taken as current, with a note.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from mlx_tier.job.doc_text import open_document

_CHUNK = 1 << 20  # bytes read at a time while hashing


@dataclass(frozen=True)
class SourceStamp:
    """What a summary was made from (module doc).

    Attributes:
        sha256: hex digest of the bytes (``hashed == "bytes"``) or of the UTF-8 text.
        size: bytes hashed.
        mtime: the file's modification time, Unix seconds; ``None`` for text and requests.
        hashed: ``"bytes"`` (a file as stored), ``"text"`` (a JSONL line's text) or
            ``"request"`` (a batch request's url and body, :func:`request_stamp`).
    """

    sha256: str
    size: int
    mtime: float | None
    hashed: str

    def as_dict(self) -> dict:
        return asdict(self)


def file_stamp(path: Path, inside: Path | None = None) -> SourceStamp | None:
    """The stamp of the file at ``path``, read as its conversion reads it
    (:func:`mlx_tier.job.doc_text.open_document`: never through a link out of
    ``inside``); ``None`` when it cannot be read (its conversion says why)."""
    fd = open_document(Path(path), inside)
    if isinstance(fd, str):
        return None
    digest, size = hashlib.sha256(), 0
    with os.fdopen(fd, "rb") as f:
        try:
            mtime = os.fstat(f.fileno()).st_mtime
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        except OSError:
            return None
    return SourceStamp(digest.hexdigest(), size, round(mtime, 3), "bytes")


def text_stamp(text: str) -> SourceStamp:
    """The stamp of a document given as text (a JSONL line): its UTF-8 bytes
    (a lone surrogate kept as it is)."""
    data = text.encode("utf-8", "surrogatepass")
    return SourceStamp(hashlib.sha256(data).hexdigest(), len(data), None, "text")


def writing_record(doc_id: str, made_from: dict | None, data: bytes, settings: dict | None = None) -> dict:
    """The journal record a run appends just before it renames a summary into place:
    ``{"event": "writing", "doc", "made_from", "output_sha256"}`` (the sha256 of the
    output's bytes ``data``) and ``settings``: the run's :meth:`Settings.fields`, with the
    summary's figures (tokens, seconds: :data:`mlx_tier.job.triage.FIGURES`) where known. A
    crash between that rename and the ``done`` record leaves an output its records do
    not describe (none, or the summary it replaced); a rerun adopts it only as this
    record vouches for it (:func:`vouched`), with its settings and figures."""
    return {"event": "writing", "doc": doc_id, "output_sha256": hashlib.sha256(data).hexdigest(),
            **({"made_from": made_from} if made_from is not None else {}), **(settings or {})}


def vouched(entries, doc_id: str, output: bytes | str, now: str | None) -> dict | str | None:
    """What the journal ``entries`` say of the output of ``doc_id`` whose bytes are
    ``output`` (or their sha256 in hex) and whose source hashes to ``now`` (``None``: unknown).

    Returns:
        the last ``writing`` record (:func:`writing_record`) for exactly these bytes,
        when the source is still what it was made from (adopt it); ``"stale"`` when it
        was made from another version of the source; ``"unwritten"`` when no record
        names these bytes though some name the document (the old output of a redo
        that crashed before its rename, or someone's edit); ``None`` when no record
        names the document (a journal of an older version).
    """
    mine = [r for r in entries if r.get("event") == "writing" and r.get("doc") == doc_id]
    if not mine:
        return None
    digest = output if isinstance(output, str) else hashlib.sha256(output).hexdigest()
    match = next((r for r in reversed(mine) if r.get("output_sha256") == digest), None)
    if match is None:
        return "unwritten"
    made = match.get("made_from") if isinstance(match.get("made_from"), dict) else {}
    if now is not None and made.get("sha256") not in (None, now):
        return "stale"
    return match


def rewritten_since_done(entries) -> set[str]:
    """Ids whose last ``writing`` record comes after their last ``done`` record in the
    journal ``entries``: a redo that may have renamed its output into place and not
    recorded it (a crash between the two)."""
    done, writing = {}, {}
    for n, r in enumerate(entries):
        if r.get("status") == "done" and isinstance(r.get("id"), str):
            done[r["id"]] = n
        elif r.get("event") == "writing" and isinstance(r.get("doc"), str):
            writing[r["doc"]] = n
    return {i for i, n in writing.items() if n > done.get(i, -1)}


def request_stamp(url: str, body: dict, default_max_tokens: int | None = None) -> SourceStamp:
    """The stamp of a batch request: its ``url`` and ``body`` as canonical JSON (keys
    sorted, no spaces, ASCII escapes), so that any change of its messages, prompt,
    endpoint or any body option changes the hash, and the order of keys does not
    (a number's spelling does: ``1`` and ``1.0`` differ, so such a request is redone,
    never wrongly kept). ``default_max_tokens``: the token limit the run gives a request
    that sets none (``run --max-tokens``), stamped with it: its answer depends on it."""
    stamped = {"url": url, "body": body}
    if default_max_tokens is not None:
        stamped["default_max_tokens"] = default_max_tokens
    data = json.dumps(stamped, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return SourceStamp(hashlib.sha256(data).hexdigest(), len(data), None, "request")


def prompt_hash(instruction: str) -> str:
    """The instruction's fingerprint: 16 hex digits of its sha256 (UTF-8)."""
    return hashlib.sha256(instruction.encode("utf-8", "surrogatepass")).hexdigest()[:16]


# A record's ``made_from`` when its document's file could not be read (missing, no
# permission): any readable file there later is a change, so its failure is retried.
UNREADABLE = {"unreadable": True}


def made_from(doc) -> dict | None:
    """What a record says ``doc``'s summary (or failure) was made from: its source's stamp
    (:meth:`SourceStamp.as_dict`), :data:`UNREADABLE` for a file that could not be read,
    ``None`` for a document without one."""
    stamp = getattr(doc, "stamp", None)
    if stamp is not None:
        return stamp.as_dict()
    return dict(UNREADABLE) if getattr(doc, "path", None) is not None else None


def was_unreadable(rec: dict) -> bool:
    """Whether the record ``rec`` failed on a file that could not be read (:data:`UNREADABLE`)."""
    made = rec.get("made_from")
    return isinstance(made, dict) and made.get("unreadable") is True


def recorded_hash(rec: dict) -> str | None:
    """The source hash a ``done`` record keeps, ``None`` when it keeps none (an older version)."""
    made = rec.get("made_from")
    sha = made.get("sha256") if isinstance(made, dict) else None
    return sha if isinstance(sha, str) else None


# The fields of a record that name what wrote it (:meth:`Settings.fields`).
SETTINGS_FIELDS = ("model", "prompt", "kv_bits", "generation", "compute")
# The generation options a summary's record keeps (``generation``), in this order.
GENERATION_KEYS = ("max_tokens", "repetition_penalty", "context")


def generation_fields(generation, model_context: int | None = None) -> dict:
    """``{key: value}`` of :data:`GENERATION_KEYS` from a
    :class:`~mlx_tier.job.scheduler.GenerationConfig`, ``context`` as the run resolves it
    from ``--context`` and the model's ``model_context`` (at most that; ``None`` asked: the
    model's); ``None`` where both are unknown. The memory a run finds may lower it further:
    not recorded (it does not change a document read in one call)."""
    fields = {k: getattr(generation, k) for k in GENERATION_KEYS}
    if model_context is not None:
        fields["context"] = min(fields["context"] or model_context, model_context)
    return fields


@dataclass(frozen=True)
class Settings:
    """The model, prompt, KV cache, generation options and kernel of this run, as records name them.

    Attributes:
        model: the model as given: a folder, a repo id, or ``demo``.
        weights: its weights' fingerprint; ``None`` while unknown (a model not
            downloaded or built yet: compared by name until it is).
        prompt: :func:`prompt_hash` of the instruction; ``None``: none applies (a request
            file's answers: each request runs its own messages), not compared.
        kv_bits: the KV caches' bits (``run --kv-bits``: the tokens depend on
            them), ``None`` unquantized.
        config: the fingerprint of its config, tokenizer and chat template
            (:func:`mlx_tier.engine.fingerprints.config_fingerprint`); ``None`` unknown.
        generation: :func:`generation_fields` of the run (``None``: not compared).
        compute: ``{"kernel", "dtype"}`` its model computes with
            (:func:`mlx_tier.engine.compute.compute_fields`; ``None``: not compared).
        earlier: ``((weights, config), ...)``: fingerprints of the same model as earlier
            versions took them (:func:`mlx_tier.engine.fingerprints.earlier_fingerprints`):
            a record of such a version is compared with them (and records name them:
            ``model.earlier``).
        model_context: the model's context in tokens: a record's ``context`` of ``None``
            (the model's) or beyond it (as asked, by an older version) is compared as the
            context it ran with; ``None`` (unknown: the model not on this machine yet):
            contexts are not compared.
    """

    model: str
    weights: str | None
    prompt: str | None
    kv_bits: int | None = None
    config: str | None = None
    generation: dict | None = None
    compute: dict | None = None
    earlier: tuple[tuple[str, str | None], ...] = ()
    model_context: int | None = None

    def fields(self) -> dict:
        """The ``model`` and ``prompt`` fields of a record this run writes (the model's
        earlier versions' fingerprints, ``earlier``, and its ``context`` with it, so that readers
        group records of older versions with this one's: :func:`~mlx_tier.outdir.journal.as_written`; and
        ``kv_bits`` when quantized, ``generation`` and ``compute`` when known)."""
        model = {"name": self.model, "weights": self.weights, **({"config": self.config} if self.config else {}),
                 **({"earlier": [{"weights": w, "config": c} for w, c in self.earlier]} if self.earlier else {}),
                 **({"context": self.model_context} if self.model_context is not None else {})}
        return {"model": model, "prompt": self.prompt,
                **({"kv_bits": self.kv_bits} if self.kv_bits is not None else {}),
                **({"generation": dict(self.generation)} if self.generation is not None else {}),
                **({"compute": dict(self.compute)} if self.compute is not None else {})}

    def differences(self, rec: dict) -> list[str]:
        """What the ``done`` record ``rec`` names otherwise than these settings: ``[]``, or
        some of ``"model"``, ``"prompt"``, ``"kv_bits"``, ``"kernel"`` (the kernel or
        cast of ``compute``) and the keys of :data:`GENERATION_KEYS`, in that order. What a record lacks (a record of an
        older version) never differs, but a record naming a model or prompt without
        ``kv_bits`` was generated unquantized; models are compared by weights when
        both are known, else by name, and by config where both records have it."""
        model = rec.get("model") if isinstance(rec.get("model"), dict) else None
        prompt = rec.get("prompt")
        out = []
        if model is not None and not self._same_model(model):
            out.append("model")
        if isinstance(prompt, str) and self.prompt is not None and prompt != self.prompt:
            out.append("prompt")
        if (model is not None or isinstance(prompt, str)) and rec.get("kv_bits") != self.kv_bits:
            out.append("kv_bits")  # a stamped record without it was generated unquantized
        made = rec.get("compute")
        if isinstance(made, dict) and self.compute is not None and \
                any(made.get(k) != self.compute.get(k) for k in ("kernel", "dtype")):
            out.append("kernel")
        made = rec.get("generation")
        if isinstance(made, dict) and self.generation is not None:
            out += [k for k in GENERATION_KEYS if k in made and k in self.generation
                    and not (k == "context" and self.model_context is None)  # unknown: not compared
                    and self._ran_with(k, made[k]) != self._ran_with(k, self.generation[k])]
        return out

    def _ran_with(self, key: str, value):
        """A generation option's value as it ran: ``context`` within the model's."""
        if key != "context" or self.model_context is None or not (value is None or isinstance(value, int)):
            return value
        return min(value or self.model_context, self.model_context)

    def _same_model(self, model: dict) -> bool:
        """Whether a record's ``model`` field names this run's model (:meth:`differences`)."""
        weights, config = model.get("weights"), model.get("config")
        if isinstance(weights, str) and self.weights is not None:  # this version's, or an earlier one's
            return any(weights == mine and not (isinstance(config, str) and my_config and config != my_config)
                       for mine, my_config in ((self.weights, self.config), *self.earlier))
        return model.get("name") == self.model

    def differs(self, rec: dict) -> bool:
        """Whether the ``done`` record ``rec`` names another model, prompt, KV cache,
        generation option or kernel (:meth:`differences`)."""
        return bool(self.differences(rec))
