"""What a run says of its schedule as it starts (:func:`mlx_tier.job.activity.announce`)."""

from types import SimpleNamespace

import pytest

from mlx_tier.job.activity import announce
from mlx_tier.job.scheduler import GenerationConfig


def scheduler(context: int, asked: int | None, by_memory: bool):
    return SimpleNamespace(info={"batch_size_from": "memory headroom", "schedule": "paced",
                                 "context_limited_by_memory": by_memory},
                           pools=None, batch_size=2, context=context, config=GenerationConfig(context=asked))


@pytest.mark.parametrize("asked, by_memory, said", [
    (100_000, False, "`context` 100000 lowered to 8192 tokens: the model's context is 8192"),
    (8192, True, "`context` 8192 lowered to 3233 tokens: the memory left allows 3233"),
    (None, False, None), (4096, False, None),
])
def test_a_context_lowered_is_said(asked, by_memory, said):
    """A user trial: `--context 100000` became a usable context of 8192 (the model's) with
    nothing said beyond the number; and 3233 under `--memory-gb 1`."""
    lines = []
    context = 3233 if by_memory else 8192 if asked != 4096 else 4096
    announce(scheduler(context, asked, by_memory), SimpleNamespace(message=lines.append))
    assert lines[0] == f"batch size 2 (memory headroom), usable context {context} tokens"
    assert lines[1:] == ([said] if said else [])
