"""What a checkpoint is, for telling whether a summary was made by it: the fingerprints of
its weights and of the files beside them that decide its tokens.

A fingerprint is ``v2-`` and 16 hex digits (the first 64 bits of a sha256). Records
written before it carry 16 bare hex digits (the first version's: :func:`weights_v1`,
:func:`config_v1`, the weights sampled, fewer tokenizer files; or those of a version
that hashed every weight byte: :func:`earlier_fingerprints`); those are compared
with the same checkpoint's fingerprints as those versions took them, so an upgrade
alone never makes a summary read as written by another model. Importable without MLX (the checkpoint's
weight files are found when a fingerprint is taken).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from pathlib import Path

from mlx_tier.errors import CheckpointError

TAG = "v2-"  # this version's fingerprints; a bare one is the first version's
# The files beside the weights that change a checkpoint's tokens: its architecture
# (config.json: experts per token, rope...), generation defaults (eos ids), tokenizer
# and chat template. Anything else in the folder (a README, a saved profile) is not.
TOKEN_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
               "chat_template.jinja", "chat_template.json", "tiktoken.model")
GLOBS_V1 = ("*.tiktoken", "tokenization_*.py")  # tiktoken vocabularies, a remote-code tokenizer
# and the tokenizers named otherwise: Mistral's tekken.json, SentencePiece models (spiece.model,
# sentencepiece.bpe.model, tokenizer.model.v3), WordPiece's vocab.txt, chat templates kept apart
TOKEN_GLOBS = (*GLOBS_V1, "tekken.json", "*.model", "*.model.v*", "vocab.txt", "*.jinja",
               "additional_chat_templates/*.jinja")
SAY_FINGERPRINT_BYTES = 2**30  # weights_fingerprint says so before reading more than this


def config_fingerprint(model_dir: Path) -> str:
    """A short fingerprint of what beside its weights decides a checkpoint's tokens.

    sha256 over each of :data:`TOKEN_FILES` present in ``model_dir``, then the other
    files matching :data:`TOKEN_GLOBS` in name order (each its name and its bytes; a
    missing one is left out): a copy of a model with ``num_experts_per_tok`` or the
    chat template edited differs from the original though its weights
    (:func:`weights_fingerprint`) are the same.

    Returns:
        :data:`TAG` and 16 hex digits.
    Raises:
        CheckpointError: one of the files is there but unreadable.
    """
    return TAG + _token_files_digest(Path(model_dir), TOKEN_GLOBS)


def config_v1(model_dir: Path) -> str:
    """:func:`config_fingerprint` as the first version took it (:data:`GLOBS_V1`)."""
    return _token_files_digest(Path(model_dir), GLOBS_V1)


def _token_files_digest(model_dir: Path, globs: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    matched = sorted({p.relative_to(model_dir).as_posix() for pattern in globs for p in model_dir.glob(pattern)}
                     - set(TOKEN_FILES))
    for name in (*TOKEN_FILES, *matched):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()[:16]


def weights_fingerprint(model_dir: Path, say: Callable[[str], None] | None = None) -> str:
    """A short fingerprint of a checkpoint's weights: of every byte of them.

    sha256 over each weight file (:func:`~mlx_tier.engine.checkpoint.weight_files`, in
    order): its name and the sha256 of its bytes (:func:`mlx_tier.fsio.file_sha256`:
    read once, then kept under the file's identity, so a rerun on the same files reads
    nothing). Two downloads or builds of the same weights agree wherever they lie;
    another model, another quantisation, or a fine-tune of the same shapes (a LoRA
    fused into a few layers included) differ. ``say``: told once, in words, before more
    than :data:`SAY_FINGERPRINT_BYTES` are read.

    Returns:
        :data:`TAG` and 16 hex digits.
    Raises:
        CheckpointError: no weight file, or one is unreadable.
    """
    from mlx_tier.engine.checkpoint import weight_files
    from mlx_tier.fsio import digests_kept, file_sha256, kept_sha256, user_cache_dir

    files = weight_files(model_dir)
    if say is not None:
        unread = sum(p.stat().st_size for p in files if kept_sha256(p) is None)
        if unread > SAY_FINGERPRINT_BYTES:
            kept = "once: then kept by file identity" if digests_kept() else \
                f"again each run: {user_cache_dir() / 'digests'} cannot be written"
            say(f"fingerprinting the model's weights ({unread / 2**30:.1f} GiB, {kept}), so that summaries of "
                "other weights are never taken as current")
    digest = hashlib.sha256()
    for path in files:
        try:
            sha = file_sha256(path)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
        digest.update(f"{path.name}\0{sha}\0".encode())
    return TAG + digest.hexdigest()[:16]


def earlier_fingerprints(model_dir: Path, weights: str) -> tuple[tuple[str, str], ...]:
    """``(weights, config)`` fingerprints of the model in ``model_dir`` as earlier versions took
    them, to compare the records they wrote: the first version's (:func:`weights_v1`,
    :func:`config_v1`), and a version that hashed every byte of the weights (this
    version's ``weights`` without its tag) beside the first version's config.

    Raises:
        CheckpointError: no weight file, or a file unreadable.
    """
    first = config_v1(model_dir)
    return (weights_v1(model_dir), first), (weights.removeprefix(TAG), first)


def weights_v1(model_dir: Path, samples: int = 16, block: int = 4096) -> str:
    """The first version's weights fingerprint, to compare the records it wrote: sha256 over
    each weight file's name, size, safetensors header and ``samples`` blocks of ``block``
    bytes spread over its data (a change between the blocks is not seen: why
    :func:`weights_fingerprint` reads every byte).

    Raises:
        CheckpointError: no weight file, or one is unreadable.
    """
    from mlx_tier.engine.checkpoint import weight_files

    digest = hashlib.sha256()
    for path in weight_files(model_dir):
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                raw = f.read(8)
                header = f.read(struct.unpack("<Q", raw)[0]) if len(raw) == 8 else b""
                start = 8 + len(header)
                spread = max(size - start - block, 0)
                parts = [os.pread(f.fileno(), block, start + spread * i // max(samples - 1, 1))
                         for i in range(samples)]
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
        digest.update(f"{path.name}\0{size}\0".encode() + raw + header + b"".join(parts))
    return digest.hexdigest()[:16]
