"""The user's demo model, reused by the tests when this code built it."""

from __future__ import annotations

import json
import os
from pathlib import Path

# The user's own cache folder, as it was before the fixtures pointed MLX_TIER_CACHE away
# (this module is imported by tests/conftest.py, before any fixture runs).
USER_CACHE = os.environ.get("MLX_TIER_CACHE")


def users_demo(cache: str | Path | None) -> Path | None:
    """A demo model under ``cache`` (``None``: the platform's user cache folder) built
    with this very code (its recorded build fingerprint equals the current one: the
    build is seeded, so it is the same model), else ``None``. Read only: the fixture
    copies it."""
    import platformdirs

    from mlx_tier.tools.demo_model import build_fingerprint, demo_name

    root = Path(cache) if cache else Path(platformdirs.user_cache_dir("mlx-tier"))
    folder = root / demo_name()
    try:
        built = json.loads((folder / "config.json").read_text())["mlx_tier_demo"].get("build")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return folder if built == build_fingerprint() else None
