"""Finished calls of long documents, kept across runs: ``OUT_DIR/parts.jsonl``.

A document longer than the usable context is summarised in parts, then the
part summaries are combined, level by level (:mod:`mlx_tier.job.longdoc`): on
a book, an hour of work before its one summary exists. Each finished call's
result is appended here and fsync'ed before the next step, so a run stopped
(Ctrl-C, a full disk) or killed midway loses only the calls in flight: the
next run takes the kept result of any call whose key matches instead of
generating it again.

A call's key is the SHA-256 of its exact prompt tokens and of everything
else that decides its tokens (the run's ``identity``: model weights and
config, instruction, KV bits, generation options, kernel). A changed
document, instruction, context or setting gives other prompts or another
identity, so nothing stale is ever reused; a result is only ever reused for
the same call. An empty result (a reasoning model's limit spent in its reasoning, an
end of text at once) is kept for the run's counts but never reused: the call is
made again.

One line per call: ``{"doc", "key", "run_key", "text", "reasoning", "tokens",
"finish_reason", "limit", "source"}`` (``run_key``: the identity's hash alone, so
a run can tell its own documents' lines and their split). A rank of a
distributed run appends to its own file (``ranks/<run>/parts-<k>.jsonl``, like
its journal); every run reads them all. The lines of a document go once its
summary is written and current (:func:`forget`, by the run holding the output
folder). Like the journal, nothing here follows a link.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from mlx_tier.fsio import _append_line, write_atomic
from mlx_tier.outdir.layout import PARTS, rank_part_files


@dataclass(frozen=True)
class KeptCall:
    """One finished call's result as a run kept it.

    Attributes:
        doc: the document it is a call of.
        text, reasoning: its result (trimmed as the map-reduce took it) and any thinking.
        tokens: how many tokens it generated.
        finish_reason: ``stop`` or ``length``.
        limit: the most prompt tokens a call of its document could take when the document
            was split (:class:`~mlx_tier.job.longdoc.MapReduce`): a resumed run splits the
            same way where that still fits, whatever memory it finds.
        source: the sha256 of the document's source it was made from (``None``: unknown).
        earlier: read from the file when the store opened (an earlier run's), not kept
            by this process.
    """

    doc: str
    text: str
    reasoning: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    limit: int | None = None
    source: str | None = None
    earlier: bool = False


def call_key(identity: dict, prompt: list[int]) -> str:
    """The key of a call: SHA-256 (hex) of ``identity`` (JSON, sorted keys) and the
    prompt's token ids."""
    h = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    h.update(b"\0" + ",".join(map(str, prompt)).encode())
    return h.hexdigest()


def _lines(path: Path) -> Iterable[dict]:
    """The usable lines of one parts file (a torn or foreign line is skipped)."""
    try:
        data = path.read_bytes() if not path.is_symlink() else b""
    except FileNotFoundError:
        return
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("key"), str) and isinstance(rec.get("text"), str) \
                and isinstance(rec.get("doc"), str):
            yield rec


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value) -> str | None:
    return value if isinstance(value, str) else None


def _call(rec: dict) -> KeptCall:
    return KeptCall(rec["doc"], rec["text"], _str(rec.get("reasoning")) or "", _int(rec.get("tokens")) or 0,
                    _str(rec.get("finish_reason")), _int(rec.get("limit")), _str(rec.get("source")), earlier=True)


def _reusable(rec: dict) -> bool:
    """Whether a kept line's result may stand for its call: not empty (an empty part would
    leave the summary without it)."""
    text = _str(rec.get("text"))
    return bool(text and text.strip())


def part_files(out_dir: Path) -> list[Path]:
    """The job's parts file (it may not exist) and every rank's."""
    return [Path(out_dir) / PARTS, *rank_part_files(out_dir)]


def forget(out_dir: Path, finished: Iterable[str]) -> int:
    """Rewrite the job's parts files (its own and its ranks') without the lines of the
    documents ``finished``, removing a file left empty; returns how many lines went. Only
    a run holding the output folder's lock may call it (no rank appends meanwhile).

    Raises:
        OSError: a file cannot be rewritten (``filename`` set).
    """
    finished, dropped = set(finished), 0
    for path in part_files(out_dir):
        lines = list(_lines(path))
        keep = [rec for rec in lines if rec["doc"] not in finished]
        if len(keep) == len(lines):
            continue
        dropped += len(lines) - len(keep)
        if keep:
            write_atomic(path, "".join(json.dumps(rec) + "\n" for rec in keep).encode("ascii"))
        else:
            path.unlink()
    return dropped


class PartStore:
    """The kept calls of a job's long documents (see the module).

    Args:
        out_dir: the job's output folder.
        identity: what, besides the prompt, decides a call's tokens (JSON-able).
        name: the file this process appends to (:data:`PARTS`, or a rank's
            :func:`~mlx_tier.outdir.layout.rank_parts`).

    Attributes:
        error: why a result could not be kept (the first failed append), else ``None``:
            the job goes on (the result is in its document's summary or in memory).
    """

    def __init__(self, out_dir: Path, identity: dict, name: str = PARTS) -> None:
        self.out_dir, self.identity, self.path = Path(out_dir), identity, Path(out_dir) / name
        self.error: str | None = None
        self.run_key = call_key(identity, [])[:16]  # the identity's own mark on each line
        self._kept: dict[str, dict] = {}
        for path in part_files(self.out_dir):
            for rec in _lines(path):
                self._kept[rec["key"]] = rec

    def _mine(self, sources: dict[str, str | None]):
        """Lines under this identity whose document is in ``sources`` and whose source hash
        is the document's now (either unknown: taken as the same)."""
        for rec in self._kept.values():
            doc, made = rec["doc"], _str(rec.get("source"))
            if rec.get("run_key") == self.run_key and doc in sources and (
                    made is None or sources[doc] is None or made == sources[doc]):
                yield rec

    def docs(self, sources: dict[str, str | None]) -> dict[str, int]:
        """``document id -> calls kept`` under this identity for the documents of ``sources``
        (``id -> sha256 of its source now``, ``None``: unknown), made from their source as it is."""
        out: dict[str, int] = {}
        for rec in self._mine(sources):
            if _reusable(rec):
                out[rec["doc"]] = out.get(rec["doc"], 0) + 1
        return out

    def limit(self, doc: str, source: str | None) -> int | None:
        """The prompt limit ``doc`` was split with under this identity from this source
        (the latest line's), or ``None``."""
        limits = [_int(rec.get("limit")) for rec in self._mine({doc: source})]
        return next((x for x in reversed(limits) if x is not None), None)

    def get(self, prompt: list[int]) -> KeptCall | None:
        """The kept result of the call with this prompt under this identity, or ``None`` (also
        for an empty one: made again)."""
        rec = self._kept.get(call_key(self.identity, prompt))
        return None if rec is None or not _reusable(rec) else replace(_call(rec), earlier=rec.get("_earlier", True))

    def written_now(self) -> dict[str, int]:
        """``document id -> tokens`` of the calls this process kept (:meth:`keep`), not an
        earlier run's."""
        out: dict[str, int] = {}
        for rec in self._kept.values():
            if rec.get("_earlier") is False:
                out[rec["doc"]] = out.get(rec["doc"], 0) + (_int(rec.get("tokens")) or 0)
        return out

    def keep(self, prompt: list[int], call: KeptCall) -> None:
        """Append one finished call (fsync'ed); a failed append is noted in :attr:`error`, not raised."""
        rec = {"doc": call.doc, "key": call_key(self.identity, prompt), "run_key": self.run_key,
               "text": call.text, "reasoning": call.reasoning, "tokens": call.tokens,
               "finish_reason": call.finish_reason, "limit": call.limit, "source": call.source}
        try:
            _append_line(self.path, (json.dumps(rec) + "\n").encode("ascii"))
        except OSError as e:
            self.error = self.error or f"{e.filename}: {e.strerror or e}"
            return
        self._kept[rec["key"]] = {**rec, "_earlier": False}
