"""Prompts for one document, and map-reduce summarisation of documents longer than the context.

A document whose prompt plus output would not fit the usable context is never
truncated: its text is split at paragraph, then sentence, then word
boundaries into parts that fit (token counts by the model's tokenizer); each
part is summarised (map), then the part summaries, in order, are combined
into one (reduce). When the part summaries together are still too long, they
are combined in groups first, level by level, until one summary remains.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mlx_tier.errors import TooLong
from mlx_tier.job.prompts import build_prompt, encode_data
from mlx_tier.tools.calls import JOIN_SLACK

MAP_NOTE = "The text below is part {i} of {n} of a longer document; work on this part only. "
REDUCE_NOTE = (
    "The texts below are results for consecutive parts of one longer document, in order. "
    "Combine them into one result for the whole document. "
)


def _pieces(text: str, level: int) -> list[str]:
    if level == 0:
        return [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    if level == 1:
        return [p for p in re.split(r"(?<=[.!?])\s+", text) if p.strip()]
    return text.split()


# Tokens a join of two pieces is counted at while packing a part (what the tokenizer may
# merge or add across it, estimated); a part whose count still comes out over the limit is
# cut again (split_text's last line), so a low estimate costs a finer cut, never an overflow.
PACK_SLACK = 2


class EmptyCall(Exception):
    """A level of a map-reduce summary finished with a call whose result is empty (the token
    limit spent in a model's reasoning, or an end of text at once): combining the others
    would give a summary that looks whole but leaves that part out.

    Attributes:
        what: the call in words, ``"part 3 of 13"`` or ``"combining call 2 of 3"``.
        index: the call's index in its level.
    """

    def __init__(self, what: str, index: int):
        super().__init__(what)
        self.what, self.index = what, index


def split_text(text: str, count, limit: int, _level: int = 0) -> list[str]:
    """Split ``text`` into parts of at most ``limit`` tokens, in order.

    Args:
        count: text -> token count (the model's tokenizer, no special tokens).
        limit: most tokens per part, >= 1.

    Returns:
        parts joined back with blank lines (paragraphs) or spaces; no text is
        dropped except whitespace at the cuts. A single word longer than
        ``limit`` is cut by characters.
    """
    if count(text) <= limit:
        return [text.strip()]
    if _level > 2:  # one word longer than the limit: cut it by characters
        step = max(1, len(text) * limit // (2 * count(text)))
        return [text[i : i + step] for i in range(0, len(text), step)]
    sep = "\n\n" if _level == 0 else " "
    parts, current, used = [], [], 0
    for piece in _pieces(text, _level):
        n = count(piece)
        if n > limit:  # cut finer; its first cut may join what is packed, its last takes what follows
            cuts = split_text(piece, count, limit, _level + 1)
            if current and used + count(cuts[0]) + PACK_SLACK <= limit:
                current.append(cuts.pop(0))
            if current:
                parts.append(sep.join(current))
            parts += cuts[:-1]
            current, used = cuts[-1:], count(cuts[-1]) if cuts else 0
            continue
        if current and used + n + PACK_SLACK > limit:
            parts.append(sep.join(current))
            current, used = [], 0
        current.append(piece.strip())
        used += n + (PACK_SLACK if len(current) > 1 else 0)
    if current:
        parts.append(sep.join(current))
    # The sums above are estimates; re-split any part that is still too long.
    return [q for p in parts for q in (split_text(p, count, limit, _level + 1) if count(p) > limit else [p])]


@dataclass
class MapReduce:
    """The state of one long document's map-reduce summary.

    Level 0 summarises the document's parts; each further level combines the
    previous level's results in groups that fit. :meth:`prompts` gives the
    current level's prompts; :meth:`add` records one result and, when the
    level is complete, starts the next. :attr:`summary` is set at the end.

    Args:
        tokenizer: the model's tokenizer.
        instruction: the user's instruction (the final reduce answers it).
        text: the document.
        prompt_limit: most prompt tokens one call may take.
        max_tokens: most tokens one call may generate (0: not checked).

    Raises:
        TooLong: the instruction, or the combining instruction of the later levels,
            leaves no room for text; or a call may generate more than its room can
            take back: a part's text room below ``max_tokens`` (its summary need not
            be shorter than its text), or the combining room below one summary of
            ``max_tokens`` (raised as the document is split, before any call).
    """

    tokenizer: object
    instruction: str
    text: str
    prompt_limit: int
    max_tokens: int = 0
    level: int = 0
    parts: int = 0  # level-0 parts (reported)
    summary: str | None = None
    _prompts: list[list[int]] = field(default_factory=list)
    _results: list[str | None] = field(default_factory=list)

    def __post_init__(self):
        room = self._room(MAP_NOTE.format(i=999, n=999))
        self._check_shrinks(room, self._room(REDUCE_NOTE))  # fail now, not after every part
        chunks = split_text(self.text, self._count, room)
        self.parts = n = len(chunks)
        self._start([build_prompt(self.tokenizer, MAP_NOTE.format(i=i + 1, n=n) + self.instruction, c)
                     for i, c in enumerate(chunks)])

    def _check_shrinks(self, part: int, combine: int) -> None:
        """Refuse a split whose summaries cannot shrink the document (no room to combine part
        summaries at all fails in :meth:`_room`): fail now, not after every part is summarised."""
        if not self.max_tokens:
            return
        fix = "raise `context` or lower `max_tokens`"
        if part < self.max_tokens:
            raise TooLong(f"a part holds at most {part} tokens of text, fewer than the `max_tokens` "
                          f"{self.max_tokens} its summary may take: the parts' summaries would not shrink "
                          f"the document; {fix}")
        one = self.max_tokens + self._count("Part 999: ") + 2  # a summary as a combining call lists it
        if combine < one:
            raise TooLong(f"combining part summaries leaves room for {combine} tokens of text, less than one "
                          f"summary of `max_tokens` {self.max_tokens} ({one} as listed); {fix}")

    def _count(self, text: str) -> int:
        return len(encode_data(self.tokenizer, text))

    def _room(self, note: str) -> int:
        """Tokens of text a call with ``note`` and the instruction may take. Raises TooLong
        when fewer than 16 (the same floor as one call's: :func:`~mlx_tier.job.scheduler.check_context`)."""
        overhead = len(build_prompt(self.tokenizer, note + self.instruction, ""))
        room = self.prompt_limit - overhead - JOIN_SLACK
        if room < 16:
            what = "the combining instruction" if note == REDUCE_NOTE else "the instruction"
            raise TooLong(
                f"the usable context ({self.prompt_limit} prompt tokens) leaves {max(room, 0)} tokens for text "
                f"after {what} ({overhead} tokens) and {JOIN_SLACK} kept for joins, fewer than 16; raise "
                "`context` or lower `max_tokens`"
            )
        return room

    def _split(self, text: str, note: str) -> list[str]:
        return split_text(text, self._count, self._room(note))

    def _start(self, prompts: list[list[int]]) -> None:
        self._prompts, self._results = prompts, [None] * len(prompts)

    def prompts(self) -> list[tuple[int, list[int]]]:
        """``(index, prompt)`` of every call of the current level."""
        return list(enumerate(self._prompts))

    def prompt(self, index: int) -> list[int]:
        """The prompt of call ``index`` of the current level."""
        return self._prompts[index]

    def level_tokens(self, decoding=()) -> tuple[int, int]:
        """``(prompt tokens of the current level's calls read: finished, or being written
        (``decoding``: their indices), of all its calls)``: how much of the level's reading
        is behind (a progress line's and an ETA's measure of a document read in parts; a
        call written after its prompt was read counts as read, so the measure never falls)."""
        decoding = set(decoding)
        done = sum(len(p) for i, (p, r) in enumerate(zip(self._prompts, self._results))
                   if r is not None or i in decoding)
        return done, sum(len(p) for p in self._prompts)

    def add(self, index: int, result: str) -> list[tuple[int, list[int]]]:
        """Record the result of call ``index`` of the current level.

        Returns:
            the next level's ``(index, prompt)`` calls when this completed the
            level and more combining is needed; ``[]`` otherwise (check
            :attr:`summary`).

        Raises:
            EmptyCall: the level completed with an empty result to combine.
            TooLong: the results do not shrink when combined in groups.
        """
        self._results[index] = result.strip()
        if any(r is None for r in self._results):
            return []
        results = self._results
        empty = [i for i, r in enumerate(results) if not r]
        if empty and not (self.level > 0 and len(results) == 1):  # the summary itself: the caller's check
            kind = "part" if self.level == 0 else "combining call"
            raise EmptyCall(f"{kind} {empty[0] + 1} of {len(results)}", empty[0])
        joined = "\n\n".join(f"Part {i + 1}: {r}" for i, r in enumerate(results))
        final = build_prompt(self.tokenizer, REDUCE_NOTE + self.instruction, joined)
        if self.level > 0 and len(results) == 1:
            self.summary = results[0]  # the previous level combined everything
            return []
        self.level += 1
        if len(final) <= self.prompt_limit:
            self._start([final])
            return self.prompts()
        # Too long for one call: combine groups of consecutive results first.
        groups = self._split(joined, REDUCE_NOTE)
        if len(groups) >= len(results):
            raise TooLong(
                f"part results do not shrink: {len(results)} results need {len(groups)} groups "
                f"within {self.prompt_limit} prompt tokens"
            )
        self._start([build_prompt(self.tokenizer, REDUCE_NOTE + self.instruction, g) for g in groups])
        return self.prompts()
