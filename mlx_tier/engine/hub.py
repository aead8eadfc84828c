"""Models by name: a local folder or a Hugging Face repo id, as mlx-lm takes them.

:func:`resolve_model` turns ``--model`` into a local checkpoint folder: an
existing path is used as it is; ``org/name`` is looked up in the local
Hugging Face cache first and downloaded only when missing and the hub is
reachable (``HF_HUB_OFFLINE`` respected). The files fetched are mlx-lm's own
``DEFAULT_ALLOW_PATTERNS`` (config, tokenizer, ``model*.safetensors``).

:func:`remote_metadata` answers "will it fit" before anything large is
downloaded: the repo's ``config.json`` (a few KiB) and the safetensors
headers, read with HTTP range requests by ``huggingface_hub``'s
``get_safetensors_metadata``.

Both read ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` when called (not when
``huggingface_hub`` was imported), so tests and callers can set them late.
"""

from __future__ import annotations

import json
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

from mlx_tier.engine.checkpoint import TensorInfo
from mlx_tier.errors import CheckpointError

# org/name as the hub spells repo ids (letters, digits, - _ .), one slash.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# mlx_lm.utils.DEFAULT_ALLOW_PATTERNS: what `mlx_lm.load` downloads.
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model",
                  "*.txt", "*.jsonl", "*.jinja"]


def is_repo_id(name: str | os.PathLike) -> bool:
    """Whether ``name`` reads as a hub repo id (``org/name``) rather than a path."""
    text = str(name)
    return bool(_REPO_ID.match(text)) and not text.startswith((".", "~"))


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to a true value, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir() -> str | None:
    return os.environ.get("HF_HUB_CACHE") or None


def check_name(name: str | os.PathLike) -> None:
    """Refuse at once a ``--model`` that is neither an existing path nor shaped like a repo id.

    Raises:
        CheckpointError: one line saying so.
    """
    if not Path(name).expanduser().exists() and not is_repo_id(name):
        raise CheckpointError(f"{name}: model folder not found (nor a Hugging Face repo id such as "
                              "mlx-community/Qwen3-30B-A3B-4bit)")


def resolve_model(name: str | os.PathLike) -> Path:
    """A local checkpoint folder for ``name``.

    Args:
        name: a folder path, or a Hugging Face repo id ``org/name``.

    Returns:
        the folder itself, or the repo's snapshot folder in the hub cache
        (``HF_HUB_CACHE``/``models--org--name/snapshots/<rev>``), downloaded
        first if it was not there with its weights.

    Raises:
        CheckpointError: neither a folder nor a repo id; offline and not
            cached; the repo does not exist or cannot be reached (one line).
    """
    path = Path(name).expanduser()
    if path.exists():
        return path
    check_name(name)
    from huggingface_hub import snapshot_download

    repo = str(name)
    local = cached_snapshot(repo)
    if local is not None:
        return local
    if offline():
        raise CheckpointError(f"{repo}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                              f"download it first (hf download {repo}) or unset HF_HUB_OFFLINE")
    try:
        with _quiet_hub():
            return Path(snapshot_download(repo, allow_patterns=ALLOW_PATTERNS, cache_dir=_cache_dir()))
    except Exception as e:  # noqa: BLE001 - hub errors are many (HTTP, auth, network); one line each
        raise CheckpointError(f"{repo}: cannot download from the Hugging Face hub: {_first_line(e)}") from None


def cached_snapshot(repo: str) -> Path | None:
    """The repo's snapshot folder in the local hub cache when it holds its weights, else ``None``.

    A snapshot with only ``config.json`` (fetched by a remote ``plan``) does
    not count, nor one missing a shard its ``model.safetensors.index.json``
    names (an interrupted download leaves its shards as ``.incomplete``
    blobs, never linked into the snapshot).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        local = Path(snapshot_download(repo, allow_patterns=ALLOW_PATTERNS, cache_dir=_cache_dir(),
                                       local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    return local if _has_all_shards(local) else None


def _has_all_shards(local: Path) -> bool:
    """Whether ``local`` holds weights: every shard its index names, or one ``*.safetensors`` without an index."""
    index = local / "model.safetensors.index.json"
    if not index.is_file():
        return any(local.glob("*.safetensors"))
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return bool(shards) and all((local / name).is_file() for name in shards)


def _first_line(e: Exception) -> str:
    """One line for a hub error: "the hub cannot be reached" for a network failure (whose
    own text is a paragraph), else its type and first line."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    if isinstance(e, (LocalEntryNotFoundError, ConnectionError, TimeoutError)) or \
            type(e).__name__ in ("ConnectionError", "ConnectTimeout", "ReadTimeout", "ConnectError"):
        return "the hub cannot be reached (offline? set HF_HUB_OFFLINE=1 to use the local cache only)"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


@contextmanager
def _quiet_hub():
    """``huggingface_hub``'s warnings off while a call runs: each retry of a failing request
    ("Retrying in 8s [Retry 4/5]") would be a line of its own; the caller says one."""
    log = logging.getLogger("huggingface_hub")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def remote_metadata(repo: str, api=None) -> tuple[dict, dict[str, TensorInfo]]:
    """``config.json`` and every tensor's header entry of a hub repo, without its weights.

    Args:
        repo: a repo id ``org/name``.
        api: an object with ``hf_hub_download(repo_id, filename, cache_dir=)``
            and ``get_safetensors_metadata(repo_id)`` (default: ``huggingface_hub``'s;
            tests pass a fake).

    Returns:
        ``(config, index)``: the parsed config and ``{tensor name:
        TensorInfo}`` with ``file`` the shard's name in the repo and
        ``start`` the offset within its data section (nothing is local).

    Raises:
        CheckpointError: offline, no such repo, or no safetensors in it (one line).
    """
    if offline():
        raise CheckpointError(f"{repo}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set, so its "
                              f"headers cannot be read; unset HF_HUB_OFFLINE or download it (hf download {repo})")
    if api is None:
        import huggingface_hub as api
    try:
        with _quiet_hub():
            config = json.loads(Path(api.hf_hub_download(repo, "config.json", cache_dir=_cache_dir())).read_text())
            meta = api.get_safetensors_metadata(repo)
    except Exception as e:  # noqa: BLE001 - hub errors are many (HTTP, auth, not safetensors)
        raise CheckpointError(f"{repo}: cannot read its config and safetensors headers from the hub: "
                              f"{_first_line(e)}") from None
    index = {}
    for filename, file_meta in meta.files_metadata.items():
        for tensor, t in file_meta.tensors.items():
            begin, end = t.data_offsets
            index[tensor] = TensorInfo(Path(filename), t.dtype, tuple(t.shape), begin, end - begin)
    return config, index
