"""CPU attention equals MLX's scaled dot-product attention within fp32 rounding.

Invariant guarded: :func:`mlx_tier.kernels.cpu_attention.sdpa` gives
``mx.fast.scaled_dot_product_attention``'s output within the kernel bound
(max|Δ| <= 1e-4 x max|reference|) for grouped heads and every mask mlx-lm
makes (none, causal over a cache, a batch's boolean mask with left padding,
additive); a model served by it keeps mlx-lm's greedy tokens; only the served
model's calls leave MLX's path.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.utils import load_model

import mlx_tier
from mlx_tier.kernels import cpu_attention
from tests.support.exactness import BOUND, PROMPTS, close, greedy_ids


def qkv(B, H, Hk, Lq, Lk, D, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((B, H, Lq, D)), mx.random.normal((B, Hk, Lk, D)) * 2,
            mx.random.normal((B, Hk, Lk, D)))


@pytest.mark.parametrize("B, H, Hk, Lq, Lk, D, mask", [
    (1, 4, 2, 1, 9, 16, None),  # decode, grouped heads
    (2, 6, 2, 5, 5, 32, "causal"),  # a prompt from empty
    (1, 4, 4, 7, 300, 16, "causal"),  # a chunk over a long cache: the last Lq of Lk
    (1, 8, 2, 600, 600, 8, "causal"),  # several query blocks
    (1, 4, 2, 600, 900, 8, "causal"),  # several blocks of a chunk over a cache: each skips its later keys
    (3, 4, 2, 520, 700, 8, "left_padding"),  # the same with a batch's padding (mlx-lm's prompt pool)
    (2, 4, 2, 520, 700, 8, "additive_causal"),
    (3, 4, 1, 4, 12, 16, "left_padding"),  # a batch's boolean mask
    (2, 4, 2, 3, 8, 16, "additive"),
    (3, 4, 2, 1, 40, 16, "decode_left_padding"),  # a decode pool: keys left of each sequence skipped
    (2, 4, 2, 2, 30, 16, "window"),  # keys masked at both ends (a sliding window)
    (2, 4, 2, 2, 30, 16, "additive_window"),
    (2, 4, 2, 600, 900, 8, "sliding"),  # a sliding window over several blocks: each leaves out keys on both sides
])
def test_sdpa_matches_mlx(B, H, Hk, Lq, Lk, D, mask):
    q, k, v = qkv(B, H, Hk, Lq, Lk, D)
    if mask == "left_padding":
        mask = create_causal_mask(Lq, offset=Lk - Lq, left_padding=mx.array([0, 3, 6][:B]))
    elif mask == "sliding":
        mask = create_causal_mask(Lq, offset=Lk - Lq, window_size=200)
    elif mask == "additive_causal":
        causal = create_causal_mask(Lq, offset=Lk - Lq)
        mask = mx.where(causal, mx.random.normal((B, 1, Lq, Lk)), -mx.inf)
    elif mask == "additive":
        mask = mx.random.normal((B, 1, Lq, Lk))
    elif mask == "decode_left_padding":
        mask = create_causal_mask(Lq, offset=Lk - Lq, left_padding=mx.array([0, 17, 39]))
    elif isinstance(mask, str) and mask.endswith("window"):
        keys = mx.arange(Lk)
        window = mx.stack([(keys >= 5) & (keys < 20), (keys >= 10) & (keys < Lk)])[:, None, None]
        mask = mx.where(window, mx.random.normal(window.shape), -mx.inf) if mask == "additive_window" else window
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
    got = cpu_attention.sdpa(q, k, v, D**-0.5, mask)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert close(ref, got) <= BOUND


@pytest.mark.parametrize("kind", ["bool", "additive", "holes"])
def test_a_decode_pool_matches_mlx(kind):
    """A decode pool (one query a sequence, more sequences than the kernel's threads):
    each sequence's heads in one batched product, its left padding left out; a mask with
    keys left out inside a sequence's span (holes) is applied there."""
    from mlx_tier.kernels import cpu

    B = 2 * cpu.THREADS + 1
    q, k, v = qkv(B, 9, 3, 1, 50, 16, seed=4)
    mask = create_causal_mask(1, offset=49, left_padding=mx.array([(7 * b) % 50 for b in range(B)]))
    if kind == "additive":
        mask = mx.where(mask, mx.random.normal(mask.shape), -mx.inf)
    elif kind == "holes":
        mask = mask & (mx.arange(50) % 5 != 3)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = cpu_attention.sdpa(q, k, v, 0.25, mask)
    assert got.shape == ref.shape and close(ref, got) <= BOUND


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("B, Lq, mask", [(1, 6, "causal"), (2 * 2 + 1, 1, "decode_left_padding"),
                                         (3, 4, "left_padding")])
def test_quantized_keys_and_values_match_mlx_lm_quantized_attention(bits, B, Lq, mask):
    """A quantized KV cache's triples, dequantized as they are read: mlx-lm's own
    quantized attention (``quantized_scaled_dot_product_attention``) within the bound,
    prefill and a decode pool (more sequences than threads), left padding left out."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    Lk, D = 70, 64
    q, k, v = qkv(B, 6, 2, Lq, Lk, D, seed=bits)
    if mask != "causal":
        mask = create_causal_mask(Lq, offset=Lk - Lq, left_padding=mx.array([(11 * b) % 40 for b in range(B)]))
    dtype = mx.bfloat16 if bits == 4 else mx.float32  # a bf16 cache's scales and biases are bf16
    qk, qv = (mx.quantize(t.astype(dtype), group_size=64, bits=bits) for t in (k, v))
    # mlx-lm scales its queries argument in place (`queries *= scale`): give it its own
    ref = quantized_scaled_dot_product_attention(mx.array(q), qk, qv, scale=D**-0.5, mask=mask, group_size=64,
                                                 bits=bits)
    got = cpu_attention.sdpa(q, tuple(qk), tuple(qv), D**-0.5, mask, group_size=64, bits=bits)
    assert got.shape == ref.shape and close(ref, got) <= BOUND


def test_other_quantized_bits_keep_mlx_attention(monkeypatch):
    """A cache quantized to bits the CPU attention does not unpack (mlx-lm's ``kv_bits``
    2, 3, 6) keeps MLX's path."""
    from types import SimpleNamespace

    calls = []
    dispatch = cpu_attention._dispatch(lambda *a, **kw: calls.append(kw["cache"].bits) or "mlx")
    monkeypatch.setattr(cpu_attention._MARK, "on", True, raising=False)
    q, k, v = qkv(1, 2, 2, 1, 8, 64)
    for bits in (2, 3, 6):
        qk, qv = (tuple(mx.quantize(t, group_size=64, bits=bits)) for t in (k, v))
        assert dispatch(q, qk, qv, SimpleNamespace(bits=bits, group_size=64), 0.1, None) == "mlx"
    assert calls == [2, 3, 6]


def test_key_spans_leave_out_only_keys_no_query_attends():
    """A decode pool's left padding and a window's both ends are left out; a mask that
    attends to every key, one broadcast over keys, and a sequence that attends to none keep
    all keys."""
    import numpy as np

    m = np.zeros((4, 1, 2, 10), bool)
    m[0, :, :, 3:] = True  # left padding of 3
    m[1, :, 0, 2:5] = True  # a window; the other query attends to more
    m[1, :, 1, 4:8] = True
    m[2] = True
    assert cpu_attention._key_spans(m, 4, 10) == [(3, 10), (2, 8), (0, 10), (0, 10)]
    additive = np.where(m, 0.0, -np.inf).astype(np.float32)
    assert cpu_attention._key_spans(additive, 4, 10) == [(3, 10), (2, 8), (0, 10), (0, 10)]
    assert cpu_attention._key_spans(np.ones((2, 1, 1, 1), bool), 2, 10) == [(0, 10)] * 2
    assert cpu_attention._key_spans(None, 2, 10) == cpu_attention._key_spans(np.ones((3, 10), bool), 2, 10)


def test_a_query_block_leaves_out_the_keys_none_of_its_queries_attends():
    """A causal chunk of 600 queries over 900 keys: block i (256 queries) attends keys up to
    300 + 256 (i + 1); with left padding, from the padding on; a block attending to no key
    keeps its sequence's span; no mask: every block all keys."""
    import numpy as np

    causal = cpu_attention._mask_array("causal", 1, 4, 600, 900)
    assert cpu_attention._block_spans(causal, 1, 600, 900, [(0, 900)]) == [[(0, 556), (0, 812), (0, 900)]]
    padded = np.array(create_causal_mask(600, offset=300, left_padding=mx.array([0, 40])))  # [2, 1, 600, 900]
    spans = cpu_attention._key_spans(padded, 2, 900)
    assert cpu_attention._block_spans(padded, 2, 600, 900, spans) == [[(0, 556), (0, 812), (0, 900)],
                                                                      [(40, 556), (40, 812), (40, 900)]]
    none = np.zeros((1, 1, 600, 900), bool)
    none[..., 300:, :] = True  # the first block's queries attend to nothing
    assert cpu_attention._block_spans(none, 1, 600, 900, [(0, 900)])[0][0] == (0, 900)
    assert cpu_attention._block_spans(None, 1, 600, 900, [(0, 900)]) is None


def test_a_boolean_mask_is_applied_only_from_the_first_key_a_block_leaves_out():
    """A causal chunk of 600 queries over 900 keys: block i's queries all attend keys up to
    300 + 256 i, so its scores are masked from the next key on only; a head that leaves
    out key 5 makes every block mask from there; an additive mask is added everywhere."""
    import numpy as np

    causal = cpu_attention._mask_array("causal", 1, 4, 600, 900)
    blocks = cpu_attention._block_spans(causal, 1, 600, 900, [(0, 900)])
    assert cpu_attention._masked_from(causal, 1, 600, blocks) == [[301, 557, 813]]
    per_head = np.broadcast_to(causal, (1, 4, 600, 900)).copy()
    per_head[0, 2, :, 5] = False
    assert cpu_attention._masked_from(per_head, 1, 600, blocks) == [[5, 5, 5]]
    assert cpu_attention._masked_from(causal.astype(np.float32), 1, 600, blocks) is None
    q, k, v = qkv(1, 4, 2, 600, 900, 8, seed=3)
    mask = mx.array(per_head)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=8**-0.5, mask=mask)
    assert close(ref, cpu_attention.sdpa(q, k, v, 8**-0.5, mask)) <= BOUND


def test_refuses_ungrouped_heads_and_unknown_masks():
    q, k, v = qkv(1, 3, 2, 2, 4, 8)
    with pytest.raises(ValueError, match="group"):
        cpu_attention.sdpa(q, k, v, 0.3)
    q, k, v = qkv(1, 2, 2, 2, 4, 8)
    with pytest.raises(ValueError, match="mask"):
        cpu_attention.sdpa(q, k, v, 0.3, "sliding")


def test_served_model_keeps_greedy_tokens_and_others_keep_mlx(tiny_moe, monkeypatch):
    ref, _ = load_model(tiny_moe)
    ref.set_dtype(mx.float32)
    want = [greedy_ids(ref, p) for p in PROMPTS]
    logits = ref(mx.array(PROMPTS[1])[None])
    model, _ = mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2, kernel="cpu"))
    calls = []
    real = cpu_attention.sdpa
    monkeypatch.setattr(cpu_attention, "sdpa", lambda *a: calls.append(1) or real(*a))
    assert close(logits, model(mx.array(PROMPTS[1])[None])) <= BOUND
    assert [greedy_ids(model, p) for p in PROMPTS] == want
    served = len(calls)
    assert served > 0
    assert [greedy_ids(ref, p) for p in PROMPTS] == want and len(calls) == served  # the plain model: MLX's path
    off, _ = mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2, kernel="cpu",
                                                                   attention_kernel=False))
    greedy_ids(off, PROMPTS[0])
    assert len(calls) == served
