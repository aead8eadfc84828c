"""Long documents: split without loss into parts that fit; map-reduce levels stay within the context."""

from __future__ import annotations

import re

import pytest
from mlx_lm.utils import load_tokenizer

from mlx_tier.errors import TooLong
from mlx_tier.job.longdoc import MapReduce, split_text
from mlx_tier.job.prompts import build_prompt


def words(text: str) -> int:
    return len(text.split())


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("limit", [3, 7, 20, 1000])
def test_split_text_keeps_every_character_and_respects_the_limit(limit):
    text = "\n\n".join(
        " ".join(f"w{p}_{s}_{i}" for i in range(s + 2)) + "." for p in range(6) for s in range(4)
    ) + "\n\n" + "x" * 50  # one 'word' longer than any limit in tokens is cut by characters
    parts = split_text(text, words, limit)
    assert all(words(p) <= limit for p in parts)
    assert squash("".join(parts)) == squash(text)
    if limit == 1000:
        assert len(parts) == 1


def test_split_prefers_paragraph_boundaries():
    text = "a b c.\n\nd e f.\n\ng h i."
    assert split_text(text, words, 6) == ["a b c.", "d e f.", "g h i."]  # 3+3+slack > 6
    assert split_text(text, words, 100) == [text]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def test_map_reduce_levels_fit_and_cover_the_document(tokenizer):
    text = "\n\n".join(f"Paragraph {i} says that item {i} weighs {i * 3} grams and is blue." for i in range(80))
    limit = 160
    assert len(build_prompt(tokenizer, "Summarise.", text)) > limit
    mr = MapReduce(tokenizer, "Summarise.", text, limit)
    calls = mr.prompts()
    assert mr.parts == len(calls) > 2
    assert all(len(p) <= limit for _, p in calls)
    decoded = "".join(tokenizer.decode(p) for _, p in calls)
    assert all(f"item {i} weighs" in decoded for i in range(80))  # nothing dropped
    levels = 0
    while mr.summary is None:
        levels += 1
        # Long fake results force a grouped level before the final combine.
        nxt = []
        for i, _ in calls:
            nxt = mr.add(i, f"result {levels}.{i} " + "detail " * 25) or nxt
        assert all(len(p) <= limit for _, p in nxt)
        calls = nxt
    assert levels >= 3  # map, at least one grouped combine, final combine
    assert mr.summary.startswith(f"result {levels}.0")


def test_map_reduce_refuses_a_context_with_no_room(tokenizer):
    with pytest.raises(TooLong, match="no room"):
        MapReduce(tokenizer, "Summarise. " * 30, "some text " * 500, 60)
