"""The calls a document of known length takes when it is read in parts (map-reduce), as
:class:`mlx_tier.job.longdoc.MapReduce` splits it: plain arithmetic on token counts, which
the scheduler's pools, the ETA and ``mlx-tier plan`` price a long document by."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Tokens a part keeps free for what the tokenizer merges across a join.
JOIN_SLACK = 8


@dataclass(frozen=True)
class CallPlan:
    """The calls a document of known length takes, as :class:`~mlx_tier.job.longdoc.MapReduce` would split it, each
    summary taken at ``max_tokens`` (erring long): ``parts`` calls of about ``part_prompt``
    prompt tokens, then ``combines`` calls of about ``combine_prompt`` (0 when it fits one call)."""

    parts: int
    part_prompt: int
    combines: int = 0
    combine_prompt: int = 0

    @property
    def calls(self) -> int:
        return self.parts + self.combines


def call_plan(doc_tokens: int, prompt_limit: int, max_tokens: int, map_overhead: int,
              reduce_overhead: int) -> CallPlan:
    """:class:`CallPlan` of a document of ``doc_tokens`` tokens of text, calls of at most
    ``prompt_limit`` prompt tokens, the map and combine instructions taking ``map_overhead``
    and ``reduce_overhead`` of them (:meth:`~mlx_tier.job.longdoc.MapReduce._room`'s); one call when it fits."""
    if doc_tokens + map_overhead <= prompt_limit:
        return CallPlan(1, doc_tokens + map_overhead)
    room = max(16, prompt_limit - map_overhead - JOIN_SLACK)
    parts = math.ceil(doc_tokens / room)
    listed = max_tokens + 6  # a summary as a combining call lists it ("Part 9: ...")
    per_call = max(2, (prompt_limit - reduce_overhead - JOIN_SLACK) // listed)
    combines, level = 0, parts
    while level > 1:  # each level combines groups of per_call results
        level = math.ceil(level / per_call)
        combines += level
    return CallPlan(parts, math.ceil(doc_tokens / parts) + map_overhead, combines,
                    min(parts, per_call) * listed + reduce_overhead)
