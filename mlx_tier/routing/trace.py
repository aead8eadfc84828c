"""Routing traces: which experts each token used at each MoE layer.

A trace is a list of *records*, one per (token, layer): the token's position
in the run, the layer, the phase (prefill or decode) and the router's top-k
expert ids. Two file formats:

* mlx-tier's own (``.npz``, written by :func:`save`): arrays ``token`` int64
  ``[N]``, ``layer`` int32 ``[N]``, ``phase`` uint8 ``[N]`` (0 prefill, 1 decode),
  ``experts`` int32 ``[N, k]``, and ``meta`` (a JSON string: ``format``,
  ``version``, ``num_layers``, ``num_experts``, ``top_k``, free-form ``source``);
  optionally ``predicted`` int32 ``[N, k]``: the record's experts as the
  previous layer's prefetch predicted them (:mod:`mlx_tier.engine.prefetch`), -1 where
  nothing was predicted (recorded when a run prefetches; the two-tier
  simulator replays its warm -> hot promotions from them).
* plain text (any other suffix): one line per (token, layer),
  ``TOKEN LAYER E1 E2 ...``; ``#`` starts a comment. Phase is unknown (decode).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlx_tier.errors import TraceError
from mlx_tier.fsio import write_atomic

FORMAT = "mlx-tier-trace"
VERSION = 1
PREFILL, DECODE = 0, 1


@dataclass
class Trace:
    """Routing records, in the order they happened.

    Attributes:
        token: ``[N]`` token position within the run.
        layer: ``[N]`` MoE layer index (0-based, model order).
        phase: ``[N]`` PREFILL or DECODE.
        experts: ``[N, k]`` expert ids chosen by the router.
        meta: ``num_layers``, ``num_experts``, ``top_k`` and anything else.
        predicted: ``[N, k]`` prefetch predictions (-1: none), or ``None``.
    """

    token: np.ndarray
    layer: np.ndarray
    phase: np.ndarray
    experts: np.ndarray
    meta: dict = field(default_factory=dict)
    predicted: np.ndarray | None = None

    @property
    def num_layers(self) -> int:
        return int(self.meta.get("num_layers") or (self.layer.max() + 1 if len(self.layer) else 0))

    @property
    def num_experts(self) -> int:
        return int(self.meta.get("num_experts") or (self.experts.max() + 1 if self.experts.size else 0))

    def layer_sequences(self) -> list[list[list[int]]]:
        """Per layer, the top-k lists in order of use."""
        seqs: list[list[list[int]]] = [[] for _ in range(self.num_layers)]
        for lay, row in zip(self.layer.tolist(), self.experts.tolist()):
            seqs[lay].append(row)
        return seqs

    def layer_predictions(self) -> list[list[list[int]]] | None:
        """Per layer, the predicted top-k list of each record (``[-1, ...]``: none),
        aligned with :meth:`layer_sequences`; ``None`` without predictions."""
        if self.predicted is None:
            return None
        seqs: list[list[list[int]]] = [[] for _ in range(self.num_layers)]
        for lay, row in zip(self.layer.tolist(), self.predicted.tolist()):
            seqs[lay].append(row)
        return seqs


def save(trace: Trace, path: Path) -> None:
    """Write ``trace`` in mlx-tier's ``.npz`` format (atomically).

    Raises:
        OSError: the folder is missing or not writable, or the disk is full.
    """
    meta = {"format": FORMAT, "version": VERSION, **trace.meta}
    buf = io.BytesIO()
    extra = {"predicted": trace.predicted} if trace.predicted is not None else {}
    np.savez_compressed(
        buf, token=trace.token, layer=trace.layer, phase=trace.phase, experts=trace.experts,
        meta=np.array(json.dumps(meta)), **extra,
    )
    write_atomic(Path(path), buf.getvalue())


def load(path: Path) -> Trace:
    """Read a trace in either format (see module doc).

    Raises:
        TraceError: missing file, wrong format, or a malformed line (with its number).
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                if meta.get("format") != FORMAT:
                    raise TraceError(f"{path}: not an mlx-tier trace")
                predicted = z["predicted"] if "predicted" in z.files else None
                return Trace(z["token"], z["layer"], z["phase"], z["experts"], meta, predicted)
        except (OSError, KeyError, ValueError) as e:
            if isinstance(e, TraceError):
                raise
            raise TraceError(f"{path}: not a readable mlx-tier trace ({e})") from None
    rows, width = [], None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text trace (not UTF-8)") from None
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            nums = [int(x) for x in line.split()]
        except ValueError:
            raise TraceError(f"{path}:{n}: expected integers 'TOKEN LAYER E1 E2 ...'") from None
        if len(nums) < 3 or min(nums) < 0:
            raise TraceError(f"{path}:{n}: expected 'TOKEN LAYER E1 E2 ...' with non-negative integers")
        if width is not None and len(nums) != width:
            raise TraceError(f"{path}:{n}: {len(nums) - 2} experts, earlier lines have {width - 2}")
        width = len(nums)
        rows.append(nums)
    if not rows:
        raise TraceError(f"{path}: empty trace")
    a = np.array(rows, dtype=np.int64)
    return Trace(a[:, 0], a[:, 1].astype(np.int32), np.full(len(a), DECODE, np.uint8), a[:, 2:].astype(np.int32),
                 {"top_k": a.shape[1] - 2})


class TraceRecorder:
    """Collects records from a live model (see :meth:`mlx_tier.engine.expert_cache.ExpertCache.start_trace`)."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int | None = None, source: str = ""):
        self.meta = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k, "source": source}
        # (layer, [B*T, k] ids, phase, [B*T, k] predicted ids or None)
        self._chunks: list[tuple[int, np.ndarray, int, np.ndarray | None]] = []
        self._ahead: dict[int, np.ndarray] = {}  # layer -> prediction for its next call

    def predict(self, layer: int, predicted: np.ndarray) -> None:
        """The prefetch's prediction ``[..., k]`` for ``layer``'s next call (made by the layer before)."""
        self._ahead[layer] = np.asarray(predicted)

    def add(self, layer: int, idx: np.ndarray) -> None:
        """One layer call: ``idx`` ``[..., k]`` (``[B, T, k]`` from mlx-lm); T > 1 is prefill."""
        idx = np.asarray(idx)
        steps = idx.shape[-2] if idx.ndim >= 3 else 1
        rows = idx.reshape(-1, idx.shape[-1]).astype(np.int32)
        ahead = self._ahead.pop(layer, None)
        if ahead is not None:
            ahead = ahead.reshape(-1, ahead.shape[-1]).astype(np.int32)
            ahead = ahead if ahead.shape == rows.shape else None  # another call's shape: not this call's
        self._chunks.append((layer, rows, PREFILL if steps > 1 else DECODE, ahead))

    def trace(self) -> Trace:
        token, layer, phase, experts, predicted = [], [], [], [], []
        seen = [0] * self.meta["num_layers"]
        for lay, rows, ph, ahead in self._chunks:
            t = len(rows)
            token.append(np.arange(seen[lay], seen[lay] + t))
            seen[lay] += t
            layer.append(np.full(t, lay, np.int32))
            phase.append(np.full(t, ph, np.uint8))
            experts.append(rows)
            predicted.append(ahead if ahead is not None else np.full_like(rows, -1))
        if not experts:
            k = self.meta.get("top_k") or 1
            return Trace(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros((0, k), np.int32), dict(self.meta))
        meta = dict(self.meta, top_k=int(experts[0].shape[1]))
        any_ahead = any(a is not None for *_, a in self._chunks)
        return Trace(np.concatenate(token), np.concatenate(layer), np.concatenate(phase), np.concatenate(experts), meta,
                     np.concatenate(predicted) if any_ahead else None)
