"""The pool model: a layer step's cost falls per token as the pool grows, and the
chosen pools respect memory, the user's batch size and the job's size.

Invariant guarded: the throughput schedule never plans more sequences than
their KV caches fit in the memory given (sequences that do not fit wait), and
``--batch-size`` stays an upper bound.
"""

from __future__ import annotations

import pytest

from mlx_tier.tools.pools import (
    MAX_DECODE_POOL,
    Rates,
    Shape,
    choose_pools,
    distinct_experts,
    layer_step_seconds,
    seconds_per_token,
)

RATES = Rates(disk_gbps=1.0, gemm_gflops=40.0, matvec_gbps=8.0, dequant_gbps=8.0, attention_gflops=20.0)
# The 8 GB synthetic's per-layer shape: 128 experts of 2.65 MB, top-8, 11 slots.
SYNTH = Shape(layers=24, experts=128, top_k=8, slots=11, expert_bytes=2_650_000, expert_flops=2 * 3 * 768 * 2048,
              dense_bytes=6_000_000, dense_flops=2 * 2048 * 6144, attn_flops=4 * 32 * 128, kv_bytes=98_304.0,
              heads=32)


def test_distinct_experts():
    assert distinct_experts(1, 128, 8) == pytest.approx(8)
    assert distinct_experts(0, 128, 8) == 0
    assert 127 < distinct_experts(2000, 128, 8) <= 128


def test_cost_per_token_falls_with_the_pool():
    costs = [seconds_per_token(SYNTH, RATES, t, 500) for t in (1, 8, 64, 512, 2048)]
    assert costs == sorted(costs, reverse=True)
    one, big = layer_step_seconds(SYNTH, RATES, 1, 500), layer_step_seconds(SYNTH, RATES, 2048, 500)
    assert one["read"] == pytest.approx(8 * (1 - 11 / 128) * 2_650_000 / 1e9)
    assert big["read"] < 128 * 2_650_000 / 1e9  # each expert read at most once per layer step
    assert big["total"] == pytest.approx(sum(v for k, v in big.items() if k != "total"))


def test_pools_follow_memory_cap_and_documents():
    roomy = choose_pools(SYNTH, RATES, 900, 64, 64 << 30)
    assert roomy.decode_pool == MAX_DECODE_POOL and roomy.limited_by == "cap"
    assert roomy.prefill_tokens >= 256 and roomy.docs_per_hour > roomy.batch1_docs_per_hour
    tight = choose_pools(SYNTH, RATES, 900, 64, 1 << 30)  # 1 GiB: ~11 sequences of 964 tokens at 96 KiB/token
    assert tight.limited_by == "memory" and tight.decode_pool * 964 * 98_304 <= 1 << 30
    assert choose_pools(SYNTH, RATES, 900, 64, 64 << 30, cap=4).decode_pool == 4
    assert choose_pools(SYNTH, RATES, 900, 64, 64 << 30, documents=3).decode_pool == 3
    assert choose_pools(SYNTH, RATES, 900, 64, 1 << 20).decode_pool == 1  # never zero: the scheduler splits
    assert 1 <= roomy.prefill_batch <= roomy.decode_pool
