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
- ``model``: ``{"name", "weights"}``: the model as the user gave it (a folder, a
  repo id, or ``demo``) and its weights' fingerprint
  (:func:`mlx_tier.engine.checkpoint.weights_fingerprint`).
- ``prompt``: the instruction's hash (:func:`prompt_hash`); the run's start
  record holds the text once.
- ``kv_bits``: the bits of the KV caches it was generated with, when quantized
  (``run --kv-bits``: the tokens depend on them); absent: unquantized.

What a rerun does with them (decided by :func:`mlx_tier.job.triage.triage`):
a summary whose source's hash changed is *stale* and redone by default (the
old one is replaced only when the new one is complete: outputs are renamed into
place; a request's ``output.jsonl`` line is replaced by rewriting the file
atomically, :class:`mlx_tier.job.outputs.BatchOutputs`); one written with
another model or prompt is kept, said in one line, and redone with
``redo_changed`` (not a request's: its answer is judged by its request's hash
alone); a document under a new name whose content
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


def request_stamp(url: str, body: dict) -> SourceStamp:
    """The stamp of a batch request: its ``url`` and ``body`` as canonical JSON (keys
    sorted, no spaces, ASCII escapes), so that any change of its messages, prompt,
    endpoint or any body option changes the hash, and the order of keys does not
    (a number's spelling does: ``1`` and ``1.0`` differ, so such a request is redone,
    never wrongly kept)."""
    data = json.dumps({"url": url, "body": body}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode("ascii")
    return SourceStamp(hashlib.sha256(data).hexdigest(), len(data), None, "request")


def prompt_hash(instruction: str) -> str:
    """The instruction's fingerprint: 16 hex digits of its sha256 (UTF-8)."""
    return hashlib.sha256(instruction.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def recorded_hash(rec: dict) -> str | None:
    """The source hash a ``done`` record keeps, ``None`` when it keeps none (an older version)."""
    made = rec.get("made_from")
    sha = made.get("sha256") if isinstance(made, dict) else None
    return sha if isinstance(sha, str) else None


@dataclass(frozen=True)
class Settings:
    """The model, prompt and KV cache of this run, as records name them.

    Attributes:
        model: the model as given: a folder, a repo id, or ``demo``.
        weights: its weights' fingerprint; ``None`` while unknown (a model not
            downloaded or built yet: compared by name until it is).
        prompt: :func:`prompt_hash` of the instruction.
        kv_bits: the KV caches' bits (``run --kv-bits``: the tokens depend on
            them), ``None`` unquantized.
    """

    model: str
    weights: str | None
    prompt: str
    kv_bits: int | None = None

    def fields(self) -> dict:
        """The ``model`` and ``prompt`` fields of a record this run writes (and
        ``kv_bits`` when quantized)."""
        return {"model": {"name": self.model, "weights": self.weights}, "prompt": self.prompt,
                **({"kv_bits": self.kv_bits} if self.kv_bits is not None else {})}

    def differences(self, rec: dict) -> list[str]:
        """What the ``done`` record ``rec`` names otherwise than these settings: ``[]``, or
        some of ``"model"``, ``"prompt"``, ``"kv_bits"``. A model or prompt it lacks (a
        record of an older version) never differs; a record naming either without
        ``kv_bits`` was generated unquantized; models are compared by weights when both
        are known, else by name."""
        model = rec.get("model") if isinstance(rec.get("model"), dict) else None
        prompt = rec.get("prompt")
        out = []
        if model is not None:
            weights = model.get("weights")
            same = (weights == self.weights if isinstance(weights, str) and self.weights is not None
                    else model.get("name") == self.model)
            if not same:
                out.append("model")
        if isinstance(prompt, str) and prompt != self.prompt:
            out.append("prompt")
        if (model is not None or isinstance(prompt, str)) and rec.get("kv_bits") != self.kv_bits:
            out.append("kv_bits")  # a stamped record without it was generated unquantized
        return out

    def differs(self, rec: dict) -> bool:
        """Whether the ``done`` record ``rec`` names another model, prompt or KV cache
        (:meth:`differences`)."""
        return bool(self.differences(rec))
