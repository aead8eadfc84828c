"""Module batching: forward passes share each tiered expert block's call.

Invariant guarded: each pass gets exactly the rows it handed over, computed in
one block call with the other passes' rows (one call per layer, not one per
pass); a pass that reaches a layer the others skip is served alone; a stop
abandons only its own pass; an error in one pass abandons the others and
reaches the caller. The blocks here are stand-ins with the tiered block's
interface (``alone``, ``cache.layer``): the engine's own tests run the real
ones (tests/job/test_pool_engine.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_tier.engine.module_batch import Pass, hand_over, in_pass, run_together


class Block:
    """``alone(x, indices)``: ``x * (layer + 1) + index``, shaped ``[..., k, D]``; counts its calls' rows."""

    def __init__(self, layer: int):
        self.cache = SimpleNamespace(layer=layer)
        self.rows = []

    def alone(self, x, indices):
        self.rows.append(indices.size // indices.shape[-1])
        return x[..., None, :] * (self.cache.layer + 1) + indices[..., None].astype(x.dtype)

    def __call__(self, x, indices):
        return hand_over(self, x, indices) if in_pass() else self.alone(x, indices)


def forward(blocks, x, k=2):
    """A pass: through each block (top-``k`` indices from the input), summing over k."""
    for b in blocks:
        indices = (mx.abs(x[..., :k]) * 7).astype(mx.uint32) % 5
        x = b(x, indices).sum(axis=-2) / k
    return x


def test_each_pass_gets_its_own_rows_from_one_call_per_layer():
    blocks = [Block(i) for i in range(3)]
    xa = mx.array(np.random.default_rng(0).standard_normal((2, 5, 4)), dtype=mx.float32)
    xb = mx.array(np.random.default_rng(1).standard_normal((3, 1, 4)), dtype=mx.float32)
    want = [forward(blocks, xa), forward(blocks, xb)]
    for b in blocks:
        b.rows.clear()
    passes = [Pass(lambda: forward(blocks, xa)), Pass(lambda: forward(blocks, xb))]
    run_together(passes)
    assert [b.rows for b in blocks] == [[10 + 3]] * 3  # one call a layer on both passes' rows
    for p, w in zip(passes, want):
        assert p.result.shape == w.shape and mx.array_equal(p.result, w)
    assert not in_pass()


def test_a_pass_at_a_layer_the_others_skip_is_served_alone():
    blocks = [Block(i) for i in range(3)]
    x = mx.ones((1, 2, 4))
    passes = [Pass(lambda: forward(blocks, x)), Pass(lambda: forward([blocks[0], blocks[2]], x))]
    run_together(passes)
    assert [b.rows for b in blocks] == [[4], [2], [4]]
    assert mx.array_equal(passes[1].result, forward([blocks[0], blocks[2]], x))


def test_a_stop_abandons_only_its_pass():
    blocks = [Block(i) for i in range(3)]
    x = mx.ones((1, 3, 4))
    asked = []
    reached = []

    def stopped():
        try:
            return forward(blocks, x)
        finally:
            reached.append("unwound")

    passes = [Pass(stopped, stop=lambda layer: asked.append(layer) or layer == 1), Pass(lambda: forward(blocks, x))]
    run_together(passes)
    assert asked == [0, 1] and passes[0].stopped_at == 1 and passes[0].result is None and reached == ["unwound"]
    assert [b.rows for b in blocks] == [[6], [3], [3]]
    assert mx.array_equal(passes[1].result, forward(blocks, x))


def test_a_pass_with_a_stop_is_computed_up_to_each_layer_before_the_stop_is_asked(monkeypatch):
    """A user trial: with the MLX kernel and every expert resident nothing forces a pass's
    lazy graph, so it was built in milliseconds and computed at its end: a stop asked
    "between layers" came after the whole pass (24 s on the demo). The input of each
    block is evaluated before the pass's stop is asked; a pass without a stop stays lazy."""
    import mlx_tier.engine.module_batch as mb

    blocks = [Block(i) for i in range(3)]
    x = mx.ones((1, 3, 4))
    log = []
    monkeypatch.setattr(mb, "_run_now", lambda xs: log.append(("eval", [a.shape for a in xs])))
    passes = [Pass(lambda: forward(blocks, x), stop=lambda layer: log.append(("stop", layer)) or False),
              Pass(lambda: forward(blocks, x))]
    run_together(passes)  # one evaluation a layer, of the pass with a stop only
    assert log == [("eval", [(1, 3, 4)]), ("stop", 0), ("eval", [(1, 3, 4)]), ("stop", 1), ("eval", [(1, 3, 4)]),
                   ("stop", 2)]


def test_an_error_in_one_pass_abandons_the_others():
    blocks = [Block(i) for i in range(2)]
    x = mx.ones((1, 1, 4))
    unwound = []

    def other():
        try:
            return forward(blocks, x)
        finally:
            unwound.append(True)

    def failing():
        forward(blocks[:1], x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_together([Pass(other), Pass(failing)])
    assert unwound == [True]


def test_passes_without_tiered_blocks_run_one_after_the_other():
    order = []
    passes = [Pass(lambda: order.append("a") or 1), Pass(lambda: order.append("b") or 2)]
    run_together(passes)
    assert order == ["a", "b"] and [p.result for p in passes] == [1, 2]
