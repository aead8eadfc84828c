"""The tiny fast-loading MoE and the documents the job tests run on."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from mlx_tier.outdir.journal import Journal
from support.checkpoints import make_mixtral

WORDS = ["river", "flood", "spring", "farmer", "plant", "seed", "bee", "pollen", "flower", "fruit", "library", "book"]


@pytest.fixture(autouse=True)
def _short_context(monkeypatch):
    monkeypatch.setattr("mlx_tier.job.model_setup.FALLBACK_CONTEXT", 256)  # the tiny checkpoints state none


@pytest.fixture(scope="module")
def small_moe(tmp_path_factory):
    """The tiny Mixtral with a 320-token byte-level BPE tokenizer: loads in ~0.2 s
    where SmolLM2's 49k-token tokenizer takes 2-4 s on this machine, and these tests
    load a model nine times (once in a fresh process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("small")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS) + " Summarise the following document."], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(root / "tokenizer")
    return make_mixtral(root / "moe", root / "tokenizer", quantized=True, vocab_size=320)


def folder(path: Path, **files: str) -> Path:
    """``path`` made (with its parents), holding ``files`` (name -> text)."""
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def make_docs(folder: Path, n: int) -> list[Path]:
    folder.mkdir()
    paths = []
    for i in range(n):
        p = folder / f"doc{i:02d}.txt"
        p.write_text(" ".join(WORDS[(i + k) % len(WORDS)] for k in range(8)) + ".")
        paths.append(p)
    return paths


def done_lines(out: Path) -> Counter:
    """How many ``done`` records each id has in the journal (2 would mean regenerated)."""
    return Counter(r["id"] for r in Journal(out).entries() if r.get("status") == "done")
