"""Token-id prompts and greedy decoding on mlx-lm's own generate_step, shared by the
architecture tests; the CPU kernel's logit bound and agreement check."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

import mlx_tier
from mlx_tier import TierConfig

PROMPTS = [[1, 5, 9, 17, 33, 2, 7], list(range(3, 120, 3))]  # short; long enough for the sorted path


def greedy_ids(model, prompt, n=8):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


BOUND = 1e-4  # max|Δ| <= BOUND * max|reference|: fp32 accumulation in another order


def close(ref: mx.array, got: mx.array) -> float:
    """max|Δ| / max|ref| (what BOUND limits)."""
    return (mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max() / mx.abs(ref).max()).item()


def assert_cpu_kernel_agrees(path, slot_counts):
    ref, _ = load_model(path)
    ref.set_dtype(mx.float32)
    want = [greedy_ids(ref, p) for p in PROMPTS]
    logits = ref(mx.array(PROMPTS[1])[None])
    for slots in slot_counts:
        model, _ = mlx_tier.load(path, config=TierConfig(slots_per_layer=slots, kernel="cpu"))
        assert close(logits, model(mx.array(PROMPTS[1])[None])) <= BOUND, slots
        assert [greedy_ids(model, p) for p in PROMPTS] == want, slots
        assert model.expert_cache.stats.misses > 0
