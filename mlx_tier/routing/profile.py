"""Expert frequency profiles: how often each expert of each MoE layer was used.

A profile is a count matrix ``[L, E]`` int64: entry ``(l, e)`` is the number of
(token, layer ``l``) records whose router top-k chose expert ``e`` — the same
unit for a routing trace (:func:`from_trace`) and for a live model's counters
(:meth:`mlx_tier.engine.expert_cache.ExpertCache.profile_counts`). It drives frequency
pinning (the ``pinned`` policy keeps the profile's hottest experts), pre-warm
at load (each layer starts with its most used experts resident) and the
adaptive split of slots across layers (:func:`adaptive_slots`).

Where it lives: ``<model_dir>/mlx-tier-profile.json`` (small JSON: L x E
integers). When the model folder is not writable (a read-only mount, another
user's folder), :func:`record` falls back to
``<cache dir>/profiles/<sha256 of the resolved model path, 16 hex>.json``,
where the cache dir is ``$MLX_TIER_CACHE`` or ``platformdirs.user_cache_dir
("mlx-tier")``. :func:`find_profile` looks in the model folder first, then in
the fallback. Runs merge: counts add, the older ones optionally multiplied by
a decay factor first (``decay`` = 0.5 halves the weight of the past).
"""

from __future__ import annotations

import errno
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlx_tier.errors import ProfileError
from mlx_tier.fsio import user_cache_dir, write_atomic

PROFILE_FILE = "mlx-tier-profile.json"
FORMAT = "mlx-tier-profile"
VERSION = 1

HOW_TO_MAKE = (
    "record one with `mlx-tier run DOCS --out OUT --trace T.npz` and then `mlx-tier profile MODEL T.npz`, "
    "or from Python with mlx_tier.routing.profile.record(model_dir, profile)"
)


@dataclass(frozen=True)
class Profile:
    """Expert use counts of one model.

    Attributes:
        counts: ``[L, E]`` int64, uses of expert ``e`` at MoE layer ``l``.
        runs: how many runs were merged into it.
        source: free-form origin (model path, trace file).
    """

    counts: np.ndarray
    runs: int = 1
    source: str = ""

    @property
    def num_layers(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])

    def hottest(self, layer: int, n: int) -> list[int]:
        """Up to ``n`` experts of ``layer`` with a non-zero count, most used first
        (ties: lower id first)."""
        c = self.counts[layer]
        order = np.lexsort((np.arange(len(c)), -c))  # by count descending, then id
        return [int(e) for e in order[:n] if c[e] > 0]

    def frequencies(self, layer: int) -> dict[int, float]:
        """``{expert: count}`` of ``layer``, for :class:`~mlx_tier.policy.eviction.PinnedPolicy`."""
        return {int(e): float(c) for e, c in enumerate(self.counts[layer]) if c > 0}

    def check(self, num_layers: int, num_experts: int, where: str = "profile") -> None:
        """Raises ProfileError unless the profile is ``[num_layers, num_experts]``."""
        if self.counts.shape != (num_layers, num_experts):
            raise ProfileError(
                f"{where}: profile is for {self.num_layers} MoE layers x {self.num_experts} experts, "
                f"the model has {num_layers} x {num_experts} (a profile of another model?); "
                "delete it or record a new one"
            )

    def merged(self, newer: Profile, decay: float = 1.0) -> Profile:
        """This profile's counts times ``decay`` (rounded) plus ``newer``'s.

        Raises:
            ProfileError: different shapes, or ``decay`` outside [0, 1].
        """
        if not 0.0 <= decay <= 1.0:
            raise ProfileError(f"decay must be in [0, 1], got {decay}")
        newer.check(self.num_layers, self.num_experts, "merge")
        old = np.rint(self.counts * decay).astype(np.int64) if decay != 1.0 else self.counts
        return Profile(old + newer.counts, self.runs + newer.runs, newer.source or self.source)


def from_counts(counts, source: str = "") -> Profile:
    """A one-run profile from a ``[L, E]`` count array (e.g. ``ExpertCache.profile_counts()``).

    Raises:
        ProfileError: not 2-D, or negative counts.
    """
    c = np.asarray(counts, dtype=np.int64)
    if c.ndim != 2 or (c < 0).any():
        raise ProfileError(f"profile counts must be a non-negative [layers, experts] array, got shape {c.shape}")
    return Profile(c.copy(), 1, source)


def from_trace(trace, num_layers: int | None = None, num_experts: int | None = None) -> Profile:
    """Count each expert's uses per layer in a :class:`~mlx_tier.routing.trace.Trace`.

    Args:
        num_layers, num_experts: the model's shape (default: the trace's).
    Raises:
        ProfileError: the trace has layers or expert ids beyond that shape.
    """
    L = num_layers or trace.num_layers
    E = num_experts or trace.num_experts
    if trace.experts.size and (int(trace.layer.max()) >= L or int(trace.experts.max()) >= E):
        raise ProfileError(
            f"trace uses {int(trace.layer.max()) + 1} layers and expert ids up to {int(trace.experts.max())}, "
            f"the model has {L} MoE layers x {E} experts (a trace of another model?)"
        )
    counts = np.zeros((L, E), np.int64)
    if trace.experts.size:
        flat = (trace.layer.astype(np.int64)[:, None] * E + trace.experts).reshape(-1)  # [N*k] layer-major ids
        counts += np.bincount(flat, minlength=L * E).reshape(L, E)
    return Profile(counts, 1, str(trace.meta.get("source", "")))


def fallback_path(model_dir: Path) -> Path:
    """The profile's place in the user cache dir, keyed by the model path (see module doc)."""
    key = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]
    return user_cache_dir() / "profiles" / f"{key}.json"


def find_profile(model_dir: Path) -> Path | None:
    """The saved profile of ``model_dir``: next to the checkpoint, else in the fallback place."""
    for p in (Path(model_dir) / PROFILE_FILE, fallback_path(model_dir)):
        if p.is_file():
            return p
    return None


def load(path: Path) -> Profile:
    """Read a profile file.

    Raises:
        ProfileError: missing, not JSON, not an mlx-tier profile, or malformed counts.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{path}: not a readable profile ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"{path}: not an mlx-tier profile")
    try:
        prof = from_counts(data["counts"], str(data.get("source", "")))
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{path}: malformed profile counts ({e})") from None
    return Profile(prof.counts, int(data.get("runs", 1)), prof.source)


def load_for(model_dir: Path, num_layers: int, num_experts: int, path: Path | None = None) -> Profile | None:
    """The profile of ``model_dir`` (or the file ``path``), checked against the model.

    Returns ``None`` when ``path`` is not given and no profile was saved.

    Raises:
        ProfileError: unreadable, or of another shape than ``[num_layers, num_experts]``.
    """
    path = path if path is not None else find_profile(model_dir)
    if path is None:
        return None
    prof = load(path)
    prof.check(num_layers, num_experts, str(path))
    return prof


def save(profile: Profile, path: Path) -> None:
    """Write ``profile`` as JSON, atomically.

    Raises:
        OSError: the folder is missing or not writable, or the disk is full.
    """
    data = {
        "format": FORMAT, "version": VERSION, "num_layers": profile.num_layers, "num_experts": profile.num_experts,
        "runs": profile.runs, "source": profile.source, "counts": profile.counts.tolist(),
    }
    write_atomic(Path(path), json.dumps(data, separators=(",", ":")) + "\n")


_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


def record(model_dir: Path, profile: Profile, decay: float = 1.0) -> Path:
    """Merge ``profile`` into ``model_dir``'s saved profile (if any) and save it.

    Saved next to the checkpoint; if that folder is not writable, in the
    fallback place (module doc). Returns the path written.

    Raises:
        ProfileError: the saved profile has another shape, or a bad ``decay``.
        OSError: neither place is writable, or the disk is full.
    """
    model_dir = Path(model_dir)
    existing = find_profile(model_dir)
    if existing is not None:
        profile = load(existing).merged(profile, decay)
    target = model_dir / PROFILE_FILE
    try:
        save(profile, target)
    except OSError as e:
        if e.errno not in _READ_ONLY:
            raise
        target = fallback_path(model_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        save(profile, target)
    return target


def adaptive_slots(profile: Profile, total_slots: int) -> tuple[int, ...]:
    """Split ``total_slots`` across layers by the profile: each layer gets 1,
    then each further slot goes to the layer whose next most used expert has
    the highest count (the miss reduction that slot buys if accesses are
    independent draws from the profile), at most E per layer.

    Returns:
        slots per layer, summing to ``min(total_slots, L * E)``.
    Raises:
        ValueError: ``total_slots`` < L (one slot per layer is the minimum).
    """
    L, E = profile.counts.shape
    if total_slots < L:
        raise ValueError(f"{total_slots} slots cannot give each of {L} layers one")
    ranked = -np.sort(-profile.counts, axis=1)  # [L, E] counts, most used first
    # Candidates beyond each layer's first slot: (count of the n-th hottest, layer).
    gains = ranked[:, 1:]  # [L, E-1]
    order = np.lexsort((np.repeat(np.arange(L), E - 1), -gains.reshape(-1)))  # by gain desc, then layer
    extra = min(total_slots, L * E) - L
    slots = np.ones(L, np.int64)
    np.add.at(slots, order[:extra] // max(E - 1, 1), 1)
    return tuple(int(s) for s in slots)
