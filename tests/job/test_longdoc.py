"""Long documents: split without loss into parts that fit; map-reduce levels stay within the context."""

from __future__ import annotations

import re

import pytest
from mlx_lm.utils import load_tokenizer

from mlx_tier.errors import TooLong
from mlx_tier.job.longdoc import JOIN_SLACK, REDUCE_NOTE, MapReduce, split_text
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


def test_short_headings_and_long_paragraphs_pack_into_few_parts():
    """A user trial: 1,084 tokens (the Bill of Rights: a two-word heading before each article,
    and paragraphs longer than a part) split into 105 parts of ~10 tokens under a 56-token room
    (each heading alone, each long paragraph's last sentences alone), where 20 would hold it;
    the plan foresaw 41 calls and the run made 213. A long paragraph's first cut now joins what
    is packed before it and its last cut takes what follows."""
    sentence = " ".join(f"w{i}" for i in range(11)) + "."
    text = "\n\n".join(f"Article {k}\n\n" + " ".join([sentence] * 7) for k in range(12))  # 12 x (2 + 84) words
    limit = 56
    parts = split_text(text, words, limit)
    assert all(words(p) <= limit for p in parts) and squash("".join(parts)) == squash(text)
    ideal = -(-words(text) // limit)
    assert len(parts) <= 1.5 * ideal, (len(parts), ideal)  # 72 parts before (a heading or 1-2 sentences each)
    assert not any(words(p) <= 2 for p in parts)  # no heading left alone
    assert any(p.startswith("Article") and "\n\nw0" in p for p in parts)  # a paragraph break kept as it was


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


def test_a_document_in_parts_reports_its_whole_level_as_one_prompt(tokenizer):
    """A user trial: a long document read in parts showed "reading long 570/952 prompt
    tokens", starting again at each part, and an ETA of seconds for 8 minutes. Its progress
    now counts every call of its current level: the parts read so far as read."""
    from types import SimpleNamespace

    from mlx_tier.job.scheduler import _by_document

    text = "\n\n".join(f"Paragraph {i} says that item {i} weighs {i * 3} grams." for i in range(60))
    mr = MapReduce(tokenizer, "Summarise.", text, 160)
    calls = mr.prompts()
    lengths = [len(p) for _, p in calls]
    assert mr.level_tokens() == (0, sum(lengths)) and len(calls) > 2
    class Doc:  # the scheduler's per-document state: hashable by identity
        def __init__(self, mr, name):
            self.mr, self.doc = mr, SimpleNamespace(id=name)

    d, short = Doc(mr, "long"), Doc(None, "short")
    assert _by_document([((d, 0), 50, lengths[0]), ((short, 0), 7, 9)]) == [("long", 50, sum(lengths)),
                                                                           ("short", 7, 9)]
    mr.add(0, "first part's summary")
    mr.add(1, "second part's summary")
    # the third part being read, the fourth too (a pool reads several): one entry, the first two counted read
    got = _by_document([((d, 2), 10, lengths[2]), ((d, 3), 5, lengths[3])] if len(calls) > 3
                       else [((d, 2), 10, lengths[2])])
    assert got == [("long", lengths[0] + lengths[1] + 10 + (5 if len(calls) > 3 else 0), sum(lengths))]
    # a user trial: the count fell (3,089 then 2,770 of 7,411) when a part read was being written: it is read
    assert len(calls) > 3
    writing = _by_document([((d, 3), 5, lengths[3])], [((d, 2), 4)])
    assert writing == [("long", lengths[0] + lengths[1] + lengths[2] + 5, sum(lengths))]
    assert writing[0][1] > got[0][1]


def test_map_reduce_refuses_a_context_with_no_room(tokenizer):
    with pytest.raises(TooLong, match="leaves 0 tokens for text after the instruction"):
        MapReduce(tokenizer, "Summarise. " * 30, "some text " * 500, 60)


def test_a_document_with_no_room_to_combine_its_parts_fails_before_any_call(tokenizer):
    """A user trial: `--context 120` summarised every part (55 calls), then failed: the
    combining instruction, longer than a part's, left no room for text. That is checked as
    the document is split. (Room for some text but not two long summaries is not refused:
    real summaries are often much shorter than `max_tokens`.)"""
    text = "\n\n".join(f"Paragraph {i} says that item {i} weighs {i * 3} grams and is blue." for i in range(40))
    floor = len(build_prompt(tokenizer, REDUCE_NOTE + "Summarise.", "")) + JOIN_SLACK + 16
    with pytest.raises(TooLong, match=r"leaves \d+ tokens for text after the combining instruction \(\d+ tokens\) and 8 kept for joins, fewer than 16; raise `context`"):
        MapReduce(tokenizer, "Summarise.", text, floor - 1)
    assert MapReduce(tokenizer, "Summarise.", text, floor).parts > 2


@pytest.mark.parametrize("limit, max_tokens, why", [
    (112, 48, "a part holds at most \\d+ tokens of text, fewer than the `max_tokens` 48"),
    (140, 48, "combining part summaries leaves room for \\d+ tokens of text, less than one summary"),
])
def test_a_split_whose_summaries_cannot_shrink_fails_before_any_call(tokenizer, limit, max_tokens, why):
    """A user trial: `--context 160 --max-tokens 48` split a 376-token document into 83
    parts of ~24 text tokens, summarised them all (~10 minutes), then failed "part results
    do not shrink". A part whose text room is below `max_tokens`, or a combining call
    without room for one full summary, is refused as the document is split; the default
    proportions (`--context 512 --max-tokens 160`) and `max_tokens` unchecked (0) pass."""
    text = "\n\n".join(f"Paragraph {i} says that item {i} weighs {i * 3} grams and is blue." for i in range(40))
    overhead = len(build_prompt(tokenizer, REDUCE_NOTE + "Summarise.", "")) + JOIN_SLACK
    limit += overhead - 88  # the demo's combining overhead is 88 tokens; this tokenizer's may differ
    with pytest.raises(TooLong, match=why + r".*raise `context` or lower `max_tokens`"):
        MapReduce(tokenizer, "Summarise.", text, limit, max_tokens)
    assert MapReduce(tokenizer, "Summarise.", text, limit).parts > 2
    assert MapReduce(tokenizer, "Summarise.", text * 8, 352 + overhead - 88, 160).parts > 2


def test_the_calls_a_long_document_takes_are_foreseen():
    """A user trial: one document of ~1,300 tokens at `--context 160` was predicted at 1062
    documents/hour and achieved 33: the prediction priced one call of the context's length.
    call_plan foresees its parts and the levels combining their summaries (each at
    `max_tokens`, erring long); a document that fits is one call."""
    from mlx_tier.tools.calls import call_plan

    one = call_plan(500, 1000, 64, 40, 50)
    assert (one.parts, one.part_prompt, one.combines, one.calls) == (1, 540, 0, 1)
    long = call_plan(10_000, 1000, 64, 40, 50)  # parts of 952 tokens of text; 13 summaries of 70 a call
    assert (long.parts, long.combines) == (11, 1) and long.part_prompt == -(-10_000 // 11) + 40
    assert long.combine_prompt == 11 * 70 + 50 <= 1000
    deep = call_plan(100_000, 1000, 64, 40, 50)  # 106 parts: 9 groups of 13, then one
    assert (deep.parts, deep.combines, deep.calls) == (106, 9 + 1, 116)
    assert call_plan(1_334, 112, 16, 60, 80).calls > 20  # the trial's: 21 parts and their combining
