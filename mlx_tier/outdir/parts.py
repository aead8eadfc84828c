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
the same call.

One line per call: ``{"doc", "key", "text", "reasoning", "tokens",
"finish_reason"}``. A rank of a distributed run appends to its own file
(``ranks/<run>/parts-<k>.jsonl``, like its journal); every run reads them all.
Lines of documents finished since are dropped when the next run starts
(:meth:`PartStore.forget`). Like the journal, nothing here follows a link.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mlx_tier.fsio import _append_line, write_atomic
from mlx_tier.outdir.layout import PARTS, RANKS_DIR


@dataclass(frozen=True)
class KeptCall:
    """One finished call's result as a run kept it (tokens: how many it generated)."""

    doc: str
    text: str
    reasoning: str = ""
    tokens: int = 0
    finish_reason: str | None = None


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
        self._kept: dict[str, dict] = {}
        for path in self._files():
            for rec in _lines(path):
                self._kept[rec["key"]] = rec

    def _files(self) -> list[Path]:
        root = self.out_dir / RANKS_DIR
        ranks = sorted(root.glob("*/parts-*.jsonl")) if root.is_dir() and not root.is_symlink() else []
        return [self.out_dir / PARTS, *ranks]

    def docs(self) -> dict[str, int]:
        """``document id -> calls kept`` of every kept call."""
        out: dict[str, int] = {}
        for rec in self._kept.values():
            out[rec["doc"]] = out.get(rec["doc"], 0) + 1
        return out

    def get(self, prompt: list[int]) -> KeptCall | None:
        """The kept result of the call with this prompt under this identity, or ``None``."""
        rec = self._kept.get(call_key(self.identity, prompt))
        if rec is None:
            return None
        tokens, reason, reasoning = rec.get("tokens"), rec.get("finish_reason"), rec.get("reasoning")
        return KeptCall(rec["doc"], rec["text"], reasoning if isinstance(reasoning, str) else "",
                        tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0,
                        reason if isinstance(reason, str) else None)

    def keep(self, prompt: list[int], call: KeptCall) -> None:
        """Append one finished call (fsync'ed); a failed append is noted in :attr:`error`, not raised."""
        rec = {"doc": call.doc, "key": call_key(self.identity, prompt), "text": call.text,
               "reasoning": call.reasoning, "tokens": call.tokens, "finish_reason": call.finish_reason}
        try:
            _append_line(self.path, (json.dumps(rec) + "\n").encode("ascii"))
        except OSError as e:
            self.error = self.error or f"{e.filename}: {e.strerror or e}"
            return
        self._kept[rec["key"]] = rec

    def forget(self, finished: Iterable[str]) -> int:
        """Rewrite ``parts.jsonl`` without the lines of the documents ``finished`` (done
        since); returns how many lines were dropped. Rank files are left as they are
        (only their rank writes them). Raises OSError (the file cannot be rewritten)."""
        finished = set(finished)
        path = self.out_dir / PARTS
        lines = list(_lines(path))
        keep = [rec for rec in lines if rec["doc"] not in finished]
        if len(keep) == len(lines):
            return 0
        if keep:
            write_atomic(path, "".join(json.dumps(rec) + "\n" for rec in keep).encode("ascii"))
        else:
            path.unlink()
        self._kept = {k: v for k, v in self._kept.items() if v["doc"] not in finished}
        return len(lines) - len(keep)
