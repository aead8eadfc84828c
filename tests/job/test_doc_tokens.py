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


def test_sizes_in_bytes_measured_in_bytes(tokenizer):
    """A plain-text file is sized by its bytes: its sample counts bytes too, so text of
    several bytes a character (here Cyrillic, 2 in UTF-8) is not priced that many times long."""
    text = "Комитет собрался во вторник, чтобы обсудить бюджет на следующий год. " * 40
    data = text.encode()
    per_char = doc_tokens.chars_per_token(tokenizer, [text])
    per_byte = doc_tokens.chars_per_token(tokenizer, [(text, len(data))])
    assert per_byte == pytest.approx(per_char * len(data) / len(text), rel=1e-3)
    tokens = len(encode_data(tokenizer, text))
    assert abs(doc_tokens.predicted_tokens(len(data), per_byte) - tokens) <= 0.02 * tokens


def test_a_run_samples_a_text_files_first_bytes_without_reading_it_whole(tmp_path):
    """Sampling for the pools reads a plain-text document's first bytes only (it is not
    converted, nor held, before its turn); a converted kind sized already gives its text."""
    from mlx_tier.job.documents import discover
    from mlx_tier.job.run import _samples

    (tmp_path / "big.txt").write_text("The river rose in spring and the farmers moved uphill. " * 20_000)
    (tmp_path / "small.md").write_text("# Notes\n\nA short document about bridges.\n")
    docs = discover(tmp_path)
    sizes = {d.id: (tmp_path / d.name).stat().st_size for d in docs}
    samples = _samples(docs, sizes)
    assert len(samples) == 2
    for (text, size), d in zip(samples, docs):
        assert size <= 4 * doc_tokens.SAMPLE_CHARS and text and "_converted" not in d.__dict__
    assert samples[1][1] == sizes[docs[1].id]  # a short file: all of it
