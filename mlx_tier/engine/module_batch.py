"""Module batching: forward passes that share each tiered expert block's call.

MoE-Gen (arXiv 2503.09716) runs attention per batch and the expert modules on
large batches of their own: the tokens of every batch in flight that reach an
MoE layer are computed there together, so each expert is fetched once and its
weights are read once for all of them. Here two (or more) of mlx-lm's own
forward passes (a prompt chunk's ``PromptProcessingBatch.prompt`` and a decode
step's ``GenerationBatch.next``, each with its own KV caches, masks and
shapes) run as :class:`Pass` es under :func:`run_together`: when a pass calls a
tiered expert block (:class:`mlx_tier.engine.load.TieredExperts`), the block
hands its ``(x, indices)`` over (:func:`hand_over`) and the pass waits; once
every live pass waits at the same block, the block computes all their rows in
one call and each pass resumes with its own rows of the output.

Every row of an expert block's output depends on that row alone (its input and
its experts), so a pass's tokens do not depend on what it ran beside. Each pass
runs in its own greenlet on the calling thread: MLX's streams belong to a
thread, so the passes cannot be OS threads, and only one runs at a time anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from greenlet import GreenletExit, getcurrent, greenlet


class PassStopped(Exception):
    """Raised inside a pass whose ``stop`` asked it to stop before a layer."""


class _PassLet(greenlet):
    """A pass's greenlet (so a block knows it is called inside a pass)."""


@dataclass(eq=False)
class _Call:
    block: object  # a TieredExperts: .alone(x, indices), .cache.layer
    x: mx.array  # [..., D]
    indices: mx.array  # [..., k]


@dataclass(eq=False)
class Pass:
    """One forward pass to run beside others (:func:`run_together`).

    Attributes:
        run: makes the pass (calls the model); its return value becomes ``result``.
        stop: ``stop(layer index)`` asked before each tiered block this pass
            reaches (the passes at one block in their order in the list); true
            abandons the pass there (``PassStopped`` is raised inside
            it, ``stopped_at`` set); the other passes go on. ``None``: never.
        result: what ``run`` returned (``None`` if stopped).
        stopped_at: the layer where ``stop`` abandoned the pass, else ``None``.
    """

    run: Callable[[], object]
    stop: Callable[[int], bool] | None = None
    result: object = None
    stopped_at: int | None = None


def in_pass() -> bool:
    """Whether the caller runs inside a pass of :func:`run_together`."""
    return isinstance(getcurrent(), _PassLet)


def hand_over(block, x: mx.array, indices: mx.array) -> mx.array:
    """Called by a tiered expert block inside a pass: wait until the block has computed
    this pass's rows with the other passes', and return them (``[..., k, D']``)."""
    return getcurrent().parent.switch(_Call(block, x, indices))


def run_together(passes: list[Pass]) -> None:
    """Run ``passes`` with their tiered expert blocks' calls merged (module doc).

    Sets each pass's ``result`` (or ``stopped_at``). A block is computed when every
    pass still running waits at it; passes waiting at different blocks (not in
    step: a pass that skips a layer) are served the lowest layer first.

    Raises:
        whatever a pass raises other than :class:`PassStopped` (the other passes
        are abandoned first).
    """
    lets = [_PassLet(p.run) for p in passes]
    waiting: dict[int, _Call] = {}

    def resume(i: int, *value, error: BaseException | None = None) -> None:
        try:  # no value: the pass starts
            got = lets[i].throw(error) if error is not None else lets[i].switch(*value)
        except PassStopped:
            return
        if lets[i].dead:
            passes[i].result = got
        else:
            waiting[i] = got

    try:
        for i in range(len(passes)):
            resume(i)
        while waiting:
            layer = min(c.block.cache.layer for c in waiting.values())
            group = sorted(i for i, c in waiting.items() if c.block.cache.layer == layer)
            going = []
            _run_now([waiting[i].x for i in group if passes[i].stop is not None])  # the layers before, now
            for i in group:
                call = waiting.pop(i)
                if passes[i].stop is not None and passes[i].stop(layer):
                    passes[i].stopped_at = layer
                    resume(i, error=PassStopped())
                else:
                    going.append((i, call))
            if going:
                for (i, _), out in zip(going, _compute([c for _, c in going])):
                    resume(i, out)
    finally:
        for let in lets:
            if not let.dead:
                let.throw(GreenletExit)


def _run_now(xs: list[mx.array]) -> None:
    """Evaluate the inputs to a layer's block of the passes with a ``stop`` (one evaluation
    a layer, none without a stop) before their stop is asked: where nothing else
    forces it (the MLX kernel with every expert resident never reads the router's choice
    on the host), MLX would build the whole pass lazily in milliseconds and compute it at
    its end, so a stop asked "between layers" would wait for the whole pass (a minute on
    a slow machine) and progress would not move."""
    if xs:
        mx.eval(xs)


def _compute(calls: list[_Call]) -> list[mx.array]:
    """One block call on the rows of every call; each call's rows of the output,
    ``[*indices.shape, D']``."""
    block = calls[0].block
    if len(calls) == 1:
        return [block.alone(calls[0].x, calls[0].indices)]
    d, k = calls[0].x.shape[-1], calls[0].indices.shape[-1]
    x = mx.concatenate([c.x.reshape(-1, d) for c in calls])
    indices = mx.concatenate([c.indices.reshape(-1, k) for c in calls])
    y = block.alone(x, indices)  # [N, k, D']
    outs, start = [], 0
    for c in calls:
        n = c.indices.size // k
        outs.append(y[start:start + n].reshape(*c.indices.shape, y.shape[-1]))
        start += n
    return outs
