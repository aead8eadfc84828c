"""Documents' tokens before tokenizing: the sizing estimate errs long (memory), the pools'
prediction uses the tokenizer's measured characters per token."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from mlx_tier.job import doc_tokens
from mlx_tier.job.prompts import encode_data

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "docs"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def test_characters_per_token_measured_on_the_documents(tokenizer):
    """English prose (the example documents) takes well over the sizing estimate's 3
    characters a token: priced at 3, a document counted ~1.5x too long."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(EXAMPLES.glob("*.*"))]
    per = doc_tokens.chars_per_token(tokenizer, texts)
    pieces = [t[: doc_tokens.SAMPLE_CHARS] for t in texts[: doc_tokens.SAMPLE_DOCS]]
    want = sum(map(len, pieces)) / sum(len(encode_data(tokenizer, t)) for t in pieces)
    assert per == pytest.approx(want) and 3.5 < per < 6
    doc = texts[0]
    assert abs(doc_tokens.predicted_tokens(len(doc), per) - len(encode_data(tokenizer, doc))) < 0.2 * len(doc) / per
    assert doc_tokens.predicted_tokens(len(doc), None) == len(doc) // doc_tokens.SIZING_CHARS_PER_TOKEN


def test_dense_text_and_no_text(tokenizer):
    """Digits and symbols take fewer characters a token than prose (so the measurement, not a
    constant); empty or missing texts are skipped, none at all gives ``None``."""
    prose = "The committee met on Tuesday to discuss the budget for the coming year. " * 40
    digits = " ".join(str(n * 7919 % 100003) for n in range(600))
    assert doc_tokens.chars_per_token(tokenizer, [digits]) < doc_tokens.chars_per_token(tokenizer, [prose])
    assert doc_tokens.chars_per_token(tokenizer, ["", None, prose]) == doc_tokens.chars_per_token(tokenizer, [prose])
    assert doc_tokens.chars_per_token(tokenizer, []) is None and doc_tokens.chars_per_token(tokenizer, ["", None]) is None
