"""How many tokens a document's characters make, before it is tokenized.

Two estimates for two uses:

- **sizing memory** (whether a document's KV cache fits, the batch by the
  longest document): ``chars // SIZING_CHARS_PER_TOKEN`` tokens, erring long
  (few texts take fewer than 3 characters a token), so a document sized to fit
  does fit;
- **predicting** (the throughput schedule's pools and its predicted
  documents/hour, the cache chooser's choice): the tokenizer's own characters
  per token, measured on a sample of the documents to run
  (:func:`chars_per_token`). English prose and markdown take ~4-5 characters
  a token with the demo's tokenizer, so the sizing estimate priced documents
  ~1.5x too long and predicted documents/hour ~1.4x low.
"""

from __future__ import annotations

from collections.abc import Iterable

from mlx_tier.job.prompts import encode_data

SIZING_CHARS_PER_TOKEN = 3
SAMPLE_DOCS = 4  # documents a measurement reads, at most
SAMPLE_CHARS = 16_000  # characters of each (the start of its text)
# A document's sampled text, or (text, its size in the units the documents' sizes count).
Sample = str | tuple[str, int]


def chars_per_token(tokenizer, texts: Iterable[Sample | None]) -> float | None:
    """Characters per token of the first :data:`SAMPLE_DOCS` non-empty ``texts`` (their
    first :data:`SAMPLE_CHARS` characters each), tokenized as document text
    (:func:`mlx_tier.job.prompts.encode_data`); ``None`` when there is no text.

    "Characters" are the units the documents' sizes are counted in
    (:func:`mlx_tier.job.documents.size_hint`: bytes for a plain-text file,
    characters for a converted one): a ``(text, size)`` item gives its text's
    size in those units (the bytes it was decoded from), a plain ``str`` its length.
    """
    chars = tokens = used = 0
    for item in texts:
        if used == SAMPLE_DOCS:
            break
        text, size = item if isinstance(item, tuple) else (item, None)
        if not text:
            continue
        piece = text[:SAMPLE_CHARS]
        chars += len(piece) if size is None else size * len(piece) // len(text)
        tokens += len(encode_data(tokenizer, piece))
        used += 1
    return chars / tokens if tokens else None


def predicted_tokens(chars: int, per_token: float | None) -> int:
    """Tokens of ``chars`` characters at ``per_token`` characters a token (measured by
    :func:`chars_per_token`); unmeasured: the sizing estimate's."""
    return int(chars / (per_token or SIZING_CHARS_PER_TOKEN))
