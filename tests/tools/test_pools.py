"""The pool model: a layer step's cost falls per token as the pool grows, and the
chosen pools respect memory, the user's batch size and the job's size.

Invariant guarded: the throughput schedule never plans more sequences than
their KV caches fit in the memory given (sequences that do not fit wait), and
``--batch-size`` stays an upper bound.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlx_tier.tools.pools import (
    MAX_DECODE_POOL,
    ROOM_MARGIN,
    Observed,
    Rates,
    Shape,
    calibrate,
    choose_pools,
    distinct_experts,
    head_seconds,
    head_terms,
    layer_step_seconds,
    output_layer_bytes,
    routed_experts,
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


def test_read_ahead_hides_reads_behind_the_rounds_compute():
    """A step of more experts than slots reads in rounds, the resident experts first; read
    ahead overlaps each later round's read with the round before's compute: the step waits
    for what the reads take beyond the compute of all rounds but the last. One pass: no change."""
    plain = replace(SYNTH, read_ahead=False)
    for tokens in (256, 2048):
        on, off = layer_step_seconds(SYNTH, RATES, tokens, 500), layer_step_seconds(plain, RATES, tokens, 500)
        d = distinct_experts(tokens, 128, 8)
        rounds = -(-d // 11)
        last = d - 11 * (rounds - 1)  # the last round's experts: the others' compute hides reads
        want = max(0.0, off["read"] - off["expert"] * (d - last) / d)
        assert on["read"] == pytest.approx(want) and on["read"] < off["read"]
        assert on["expert"] == off["expert"] and on["total"] == pytest.approx(off["total"] - off["read"] + want)
    roomy = replace(SYNTH, slots=128)  # every expert resident: nothing read
    one = replace(SYNTH, slots=8)  # a decode step of one token: its top-8 fit the slots, one pass
    for shape, tokens in ((roomy, 2048), (one, 1)):
        assert layer_step_seconds(shape, RATES, tokens, 500) == layer_step_seconds(
            replace(shape, read_ahead=False), RATES, tokens, 500)


def test_wide_rounds_are_fewer_and_each_later_one_holds_the_width():
    """With the CPU kernel's wide rounds (Shape.width) the first round holds the slots'
    count, each later one the width: the compute of every round but the last hides reads
    (fewer, larger rounds: a larger last one); the compute itself is the same."""
    plain, one_slot = replace(SYNTH, read_ahead=False, slots=1), replace(SYNTH, slots=1)
    for tokens in (1, 8, 256):
        off = layer_step_seconds(plain, RATES, tokens, 500)
        d = distinct_experts(tokens, 128, 8)
        for width, rounds in ((0, -(-d // 1)), (8, 1 + -(-(d - 1) // 8))):
            got = layer_step_seconds(replace(one_slot, width=width), RATES, tokens, 500)
            last = d - 1 - max(1, width) * (rounds - 2) if rounds > 1 else d
            assert got["read"] == pytest.approx(max(0.0, off["read"] - off["expert"] * (d - last) / d))
            assert got["expert"] == off["expert"]


def test_pools_follow_memory_cap_and_documents():
    roomy = choose_pools(SYNTH, RATES, 900, 64, 64 << 30)
    assert roomy.decode_pool == MAX_DECODE_POOL and roomy.limited_by == "cap"
    assert roomy.prefill_tokens >= 256 and roomy.docs_per_hour > roomy.batch1_docs_per_hour
    tight = choose_pools(SYNTH, RATES, 900, 64, 1 << 30)  # 1 GiB: ~11 sequences of 964 tokens at 96 KiB/token
    assert tight.limited_by == "memory" and tight.decode_pool * 964 * 98_304 <= 1 << 30
    assert choose_pools(SYNTH, RATES, 900, 64, 64 << 30, cap=4).decode_pool == 4
    assert choose_pools(SYNTH, RATES, 900, 64, 64 << 30, documents=3).decode_pool == 3
    assert choose_pools(SYNTH, RATES, 900, 64, 1 << 20).decode_pool == 1  # never zero: the scheduler splits
    # the prompts a pool covers, and one more (a prompt ending inside a step leaves the rest to the next)
    assert roomy.prefill_batch == -(-roomy.prefill_tokens // 900) + 1
    short = choose_pools(SYNTH, RATES, 50, 64, 64 << 30, documents=4)  # 4 short prompts: all in one pool, no more
    assert short.prefill_batch == short.decode_pool == 4


def test_routed_experts_inverts_distinct_experts():
    for spread in (8.5, 20.0, 64.0, 127.0):
        d = distinct_experts(40, spread, 8)
        assert routed_experts(d, 40, 128, 8) == pytest.approx(spread, rel=1e-6)
    assert routed_experts(distinct_experts(40, 128, 8) + 1, 40, 128, 8) == 128  # at least uniform: all
    assert routed_experts(8, 40, 128, 8) == pytest.approx(8)  # every token to the same top-k


def test_calibrate_from_a_concentrated_router_and_a_fast_step():
    """A router that spreads 40 tokens over 20 distinct experts (uniform: 118) and a forward
    call that spent 1 ms per distinct expert beyond its compute (the fitted default: 3 ms):
    both are learnt, and the model then predicts the observed call's time (its cache empty:
    every distinct expert read)."""
    spread, _ = calibrate(SYNTH, RATES, Observed(tokens=40, seconds=1.0, distinct=20.0))
    assert 20 < spread.spread < 40 and spread.experts == 128
    bare = replace(RATES, overhead_s=0.0, per_expert_s=0.0, disk_gbps=1e9)  # reads: in stall_seconds
    compute = layer_step_seconds(spread, bare, 40, 20)["total"]
    seen = Observed(tokens=40, seconds=24 * (compute + 0.005 + 20 * 0.001) + 2.0, distinct=20.0, stall_seconds=2.0)
    shape, rates = calibrate(SYNTH, RATES, seen)
    assert rates.per_expert_s == pytest.approx(0.001)
    no_reads, cold = replace(rates, disk_gbps=1e9), replace(shape, slots=0)  # a first call: every expert read
    assert 24 * layer_step_seconds(cold, no_reads, 40, 20)["total"] + 2.0 == pytest.approx(seen.seconds)
    assert seconds_per_token(shape, rates, 64, 500) < seconds_per_token(SYNTH, RATES, 64, 500)


def test_calibrate_keeps_the_defaults_when_the_call_was_slow_or_missing():
    slow = Observed(tokens=40, seconds=60.0, distinct=118.0)  # a first call that compiled its kernels
    shape, rates = calibrate(SYNTH, RATES, slow)
    assert rates.per_expert_s == RATES.per_expert_s and shape.spread == pytest.approx(128, rel=0.05)
    assert calibrate(SYNTH, RATES, None) == (SYNTH, RATES)
    assert calibrate(SYNTH, RATES, Observed(0, 0.0, 0.0)) == (SYNTH, RATES)


def test_slots_given_back_to_the_kv_caches_under_a_cap():
    """Under a tight cap the expert cache gives slots back to the KV caches when larger pools
    predict more documents/hour; with room to spare it keeps the most slots."""
    from mlx_tier.tools.pools import choose_slots

    row = 24 * 2_950_000  # one slot in each of the 24 layers (resident bytes)
    tight = int(0.73 * 2**30)  # the synthetic under a 2 GiB cap: cache + KV
    slots, plan, full = choose_slots(SYNTH, RATES, 600, 32, tight, row, 8, documents=6)
    left = int((tight - 8 * row) * (1 - ROOM_MARGIN))  # priced with a share less of the room it leaves
    assert full == choose_pools(replace(SYNTH, slots=8), RATES, 600, 32, left, documents=6)
    assert slots < 8 and plan.docs_per_hour > full.docs_per_hour  # pools bought with slots
    assert plan.decode_pool > full.decode_pool or plan.prefill_tokens > full.prefill_tokens
    roomy = choose_slots(SYNTH, RATES, 600, 32, 64 * 2**30, row, 8, documents=6)[0]
    assert roomy == 8  # memory to spare: every slot the split allows
    concentrated = replace(SYNTH, routed=12.0)  # a router whose tokens go to few experts: slots save reads
    assert choose_slots(concentrated, RATES, 600, 32, tight, row, 8, documents=6)[0] >= slots
    with pytest.raises(ValueError):
        choose_slots(SYNTH, RATES, 600, 32, row // 2, row, 8)


def test_prefill_pools_stay_within_the_splits_prompt_step():
    """The executor caps a prefill step at the memory split's prompt step; the plan (and its
    prediction) is made for that pool, not a larger one it would prefer."""
    free = 64 * 2**30
    roomy = choose_pools(SYNTH, RATES, 2000, 32, free)
    capped = choose_pools(SYNTH, RATES, 2000, 32, free, max_pool=512)
    assert roomy.prefill_tokens > 512 >= capped.prefill_tokens
    assert capped.prompt_tok_s <= roomy.prompt_tok_s
    assert choose_pools(SYNTH, RATES, 2000, 32, free, max_pool=10).prefill_tokens == 10  # below every candidate


def test_a_shared_prefix_is_in_each_kv_cache_but_read_once():
    """A prompt's shared prefix (the instruction, prefilled once and copied) takes KV memory
    in every sequence but no reading time per document: same pools, fewer seconds a
    document, by the prefix's share of the prompt at the prefill rate (prefill and decode
    steps apart: with module batching fewer prefill steps also decode fewer tokens)."""
    plain = choose_pools(SYNTH, RATES, 600, 32, 1 << 30, documents=6, merged=False)
    shared = choose_pools(SYNTH, RATES, 600, 32, 1 << 30, documents=6, shared_tokens=60, merged=False)
    assert (shared.prefill_tokens, shared.decode_pool) == (plain.prefill_tokens, plain.decode_pool)
    saved = 3600 / plain.docs_per_hour - 3600 / shared.docs_per_hour
    assert saved == pytest.approx(60 / plain.prompt_tok_s)


def test_popularity_keeps_each_layers_shares_and_estimates_the_unseen():
    """Each layer's experts' shares of its routed entries, most used first. Experts a call did
    not use share the Good-Turing unseen mass (entries on experts used once) over Chao's
    estimate of how many there are, none above an expert seen once; a layer whose experts
    were all used keeps its shares as counted; a layer where nothing was routed is left
    out; narrower layers are padded with zero shares."""
    from mlx_tier.tools.pools import popularity

    first = [40, 30, 20, 5, 2, 1, 1, 0, 0, 0]  # 99 entries; f1 = 2, f2 = 1: one unseen expert estimated
    shares = popularity([first, [10] * 10, [0] * 10, [25] * 4])
    assert len(shares) == 3 and all(len(r) == 10 and sum(r) == pytest.approx(1) for r in shares)
    assert shares[0] == pytest.approx([0.40, 0.30, 0.20, 0.05, 0.02, 0.01, 0.01, 0.01, 0, 0])
    assert shares[1] == pytest.approx([0.1] * 10)
    assert shares[2] == pytest.approx([0.25] * 4 + [0] * 6)
    assert popularity([[0] * 4, [0] * 4]) == ()


def test_popularity_is_not_measured_from_a_sample_too_small_to_cover_the_routing():
    """A few tokens over many experts make any router look concentrated (each expert used once
    or not at all): under 90% coverage the routing stays unmeasured (uniform over the
    fitted spread), so a short prefix cannot shrink a step's predicted reads."""
    from mlx_tier.tools.pools import MIN_COVERAGE, popularity

    assert popularity([[1, 1, 1, 1, 1, 1, 0, 0]]) == ()  # every used expert used once: coverage 0
    assert popularity([[1, 1, 0, 0, 0, 0, 0, 0]]) == ()  # a one-token prefix of a top-2 model
    covered = [[9, 9, 9, 9, 9, 9, 9, 1]]  # 64 entries, one used once: coverage 0.98
    assert popularity(covered) != ()
    # at the threshold: two experts used once beside one used m times cover 1 - 2 / (m + 2)
    m = next(m for m in range(1, 10_000) if 1 - 2 / (m + 2) >= MIN_COVERAGE)  # the fewest that cover it
    assert popularity([[m, 1, 1, 0]]) != () and popularity([[m - 1, 1, 1, 0]]) == ()


def test_measured_routing_prices_distinct_and_resident_experts():
    """With each layer's shares measured, a step's distinct experts and the resident ones (the
    most used, which the eviction policy keeps) follow them: a concentrated router reads far
    fewer experts a step than uniform routing, and its decode steps mostly hit."""
    from mlx_tier.tools.pools import routed_split

    uniform = routed_split(SYNTH, 4)
    assert uniform == pytest.approx((distinct_experts(4, 128, 8), distinct_experts(4, 128, 8) * 11 / 128))
    hot = tuple([0.1] * 8 + [0.2 / 120] * 120)  # 80% of the entries on 8 experts, the rest spread
    shape = replace(SYNTH, slots=8, popularity=(hot, hot))
    d, resident = routed_split(shape, 4)
    assert d < uniform[0] / 2 and resident > 0.9 * 8 * (1 - 0.2 ** 4)  # the hot eight nearly all hit
    assert routed_split(replace(shape, popularity=(hot,)), 4) == pytest.approx((d, resident))  # an average
    plain = replace(shape, read_ahead=False)  # the reads themselves, none hidden behind compute
    reads = layer_step_seconds(plain, RATES, 4, 500)["read"]
    assert reads == pytest.approx((d - resident) * SYNTH.expert_bytes / 1e9)
    assert reads < layer_step_seconds(replace(plain, popularity=()), RATES, 4, 500)["read"] / 2


def test_loops_share_a_slots_pass_among_its_rows():
    """Below the GEMM's rows the loops compute each pair, a slot's pass over its weights shared
    by its rows: a pair costs ``matvec_gbps`` at one row a slot, ``loop_gbps`` at many. A
    prompt pool's small slots are priced at the loops' rate, not a decode step's."""
    fast = replace(RATES, loop_gbps=24.0, gemm_min_rows=64)
    assert fast.pair_seconds(8e9, 1) == pytest.approx(1.0)  # 8 GB at matvec's 8 GB/s
    assert fast.pair_seconds(8e9, 1e9) == pytest.approx(1 / 3, rel=1e-6)
    assert fast.pair_seconds(8e9, 2) == pytest.approx(1 / 3 + (1 - 1 / 3) / 2)
    assert replace(fast, loop_gbps=0.0).pair_seconds(8e9, 16) == pytest.approx(1.0)  # unmeasured: matvec's
    pool = 128  # 128 tokens x 8 over ~128 experts: ~8 rows a slot, below 64
    slow = replace(fast, loop_gbps=0.0)
    assert layer_step_seconds(SYNTH, fast, pool, 500)["expert"] < 0.5 * layer_step_seconds(SYNTH, slow, pool, 500)["expert"]


def test_calibrate_fits_the_fixed_cost_per_expert_read():
    """The fixed cost a layer step pays is per expert it reads into a slot: fitted over the
    call's misses when they are known, over its distinct experts when not."""
    bare = replace(RATES, overhead_s=0.0, per_expert_s=0.0, disk_gbps=1e9)
    spread, _ = calibrate(SYNTH, RATES, Observed(tokens=40, seconds=1.0, distinct=20.0))
    compute = layer_step_seconds(spread, bare, 40, 20)["total"]
    seen = Observed(tokens=40, seconds=24 * (compute + 0.005 + 10 * 0.001), distinct=20.0, misses=10.0)
    assert calibrate(SYNTH, RATES, seen)[1].per_expert_s == pytest.approx(0.001)
    assert calibrate(SYNTH, RATES, replace(seen, misses=None))[1].per_expert_s == pytest.approx(0.0005)
    assert calibrate(SYNTH, RATES, replace(seen, misses=0.0))[1].per_expert_s == RATES.per_expert_s


def test_a_cache_whose_pools_barely_fit_is_priced_at_the_room_a_run_may_find(monkeypatch):
    """The split foresees the room a cache leaves; the run measures its own at its start, a
    few percent apart. A cache whose prompt pool fits only in the foreseen room is priced
    as if it fell to the next pool size down: the chooser does not stand at that edge
    (without the margin it does: one document, so slots buy no decode pool)."""
    import mlx_tier.tools.pools as pools_module
    from mlx_tier.tools.pools import choose_slots, prefill_transient

    row, seq = 24 * 2_950_000, 632
    edge = prefill_transient(SYNTH, 256, seq) + SYNTH.kv_bytes * seq  # a 256-token pool and one sequence
    room = int(2 * edge) + 6 * row + 1024  # 6 slots leave just the room it needs (free / 2)
    at_edge = choose_pools(replace(SYNTH, slots=6), RATES, 600, 32, room - 6 * row, max_pool=256, documents=1)
    assert at_edge.prefill_tokens == 256  # fits, barely, in the room foreseen
    slots, plan, _ = choose_slots(SYNTH, RATES, 600, 32, room, row, 6, documents=1, max_pool=256)
    assert slots < 6 and plan.prefill_tokens == 256
    monkeypatch.setattr(pools_module, "ROOM_MARGIN", 0.0)
    assert choose_slots(SYNTH, RATES, 600, 32, room, row, 6, documents=1, max_pool=256)[0] == 6


def test_a_decode_steps_attention_reads_every_sequences_kv_cache():
    """One query a sequence does a few FLOPs per byte of its KV cache: a decode step's attention
    is priced at the caches' read rate when that is slower than its products, every sequence's
    cache read once; a prompt chunk reads its sequence's once for all its tokens."""
    slow_reads = replace(RATES, kv_read_gbps=1.0)
    kv = 32 * 1000 * SYNTH.kv_bytes / SYNTH.layers  # 32 sequences' caches of 1,000 tokens, one layer
    assert layer_step_seconds(SYNTH, slow_reads, 32, 1000)["attn"] == pytest.approx(kv / 1e9)
    assert layer_step_seconds(SYNTH, RATES, 32, 1000)["attn"] < kv / 1e9  # unmeasured: the products alone
    dequantised = replace(SYNTH, kv_read_bytes=4 * SYNTH.kv_bytes)  # stored quantized, read as float32
    assert layer_step_seconds(dequantised, slow_reads, 32, 1000)["attn"] == pytest.approx(4 * kv / 1e9)
    chunk = layer_step_seconds(SYNTH, slow_reads, 512, 1000, sequences=1)["attn"]
    assert chunk == pytest.approx(512 * 1000 * SYNTH.attn_flops / 20e9)  # compute-bound: read once


def test_tokens_decoded_in_prefill_steps_are_priced_as_rows_of_them():
    """Module batching: each prefill step a document's prompt takes gives a token to each
    sequence generating beside it, priced as a prompt token plus its KV reads; the rest
    of its summary at the decode pool's rate. One sequence at a time gains nothing."""
    rates = replace(RATES, kv_read_gbps=6.0)
    apart = choose_pools(SYNTH, rates, 900, 64, 1 << 30, merged=False)
    merged = choose_pools(SYNTH, rates, 900, 64, 1 << 30)
    assert apart.merged_tokens == 0 and (apart.prefill_tokens, apart.decode_pool) == (
        merged.prefill_tokens, merged.decode_pool)
    want = min(64, 900 / merged.prefill_tokens * (merged.decode_pool - merged.prefill_batch))
    assert 0 < merged.merged_tokens == pytest.approx(want)
    kv = (900 + 32) * SYNTH.kv_bytes / (rates.kv_read_gbps * 1e9)
    row = 1 / merged.prompt_tok_s + kv
    summary = want * row + (64 - want) / apart.decode_tok_s  # seconds of a document's 64 tokens
    assert 64 / merged.decode_tok_s == pytest.approx(summary)
    assert 3600 / merged.docs_per_hour == pytest.approx(900 / merged.prompt_tok_s + summary)
    assert merged.docs_per_hour > apart.docs_per_hour  # a merged token costs a row, not a decode step's share
    alone = choose_pools(SYNTH, rates, 900, 64, 1 << 30, cap=1)
    assert alone.merged_tokens == 0 and alone.docs_per_hour == choose_pools(
        SYNTH, rates, 900, 64, 1 << 30, cap=1, merged=False).docs_per_hour


def test_the_output_layer_is_priced_once_a_step_on_one_row_a_sequence():
    """A decode step runs the output layer (vocabulary x hidden: on the demo model as many
    weights as all its attention projections) on one position a sequence: its pass over
    the weights shared by the rows below the GEMM's, one dequantisation and a GEMM above;
    a prompt's tokens do not run it (only its last, priced with what it generates). The
    job's price of a summary carries each decode step's and each riding token's share."""
    head = replace(SYNTH, **head_terms(60_000_000, 49_152, 2048))
    assert head.head_flops == 2 * 49_152 * 2048 and head_terms(0, 49_152, 2048)["head_bytes"] == 0.0
    rates = replace(RATES, loop_gbps=30.0, gemm_min_rows=64)
    assert head_seconds(SYNTH, rates, 32) == 0.0  # not priced without its bytes
    assert head_seconds(head, rates, 32) == pytest.approx(32 * rates.pair_seconds(60e6, 32))
    assert head_seconds(head, rates, 128) == pytest.approx(60e6 / 8e9 + 128 * head.head_flops / 40e9)
    for pool in (1, 5, 32, 128):  # decode steps: the layer's share per token
        assert seconds_per_token(head, rates, pool, 900) - seconds_per_token(SYNTH, rates, pool, 900) == (
            pytest.approx(head_seconds(head, rates, pool) / pool))
    assert seconds_per_token(head, rates, 256, 450, 1) == seconds_per_token(SYNTH, rates, 256, 450, 1)  # a prompt
    rates = replace(rates, kv_read_gbps=6.0)
    bare, priced = (choose_pools(sh, rates, 900, 64, 1 << 30, documents=32) for sh in (SYNTH, head))
    assert (bare.prefill_tokens, bare.decode_pool, bare.merged_tokens) == (
        priced.prefill_tokens, priced.decode_pool, priced.merged_tokens)
    assert priced.merged_tokens > 0 and priced.decode_pool < rates.gemm_min_rows  # both shares, on the loops
    riding = max(1, priced.decode_pool - priced.prefill_batch)
    added = (priced.merged_tokens * head_seconds(head, rates, riding) / riding
             + (64 - priced.merged_tokens) * head_seconds(head, rates, priced.decode_pool) / priced.decode_pool)
    assert 0 < added and 3600 / priced.docs_per_hour - 3600 / bare.docs_per_hour == pytest.approx(added)


def test_the_output_layers_bytes_are_lm_heads_or_the_tied_embeddings():
    """Checkpoint or loaded model: ``lm_head``'s tensors (also under a wrapper's prefix),
    else the token embedding's (a tied output layer); nothing else counts."""
    untied = [("model.embed_tokens.weight", 10), ("lm_head.weight", 7), ("lm_head.scales", 2),
              ("model.layers.0.self_attn.q_proj.weight", 100)]
    assert output_layer_bytes(untied) == 9
    assert output_layer_bytes([("language_model.lm_head.weight", 5), ("language_model.model.embed_tokens.weight", 3)]) == 5
    tied = [("model.embed_tokens.weight", 10), ("model.embed_tokens.biases", 1), ("model.norm.weight", 4)]
    assert output_layer_bytes(iter(tied)) == 11
    assert output_layer_bytes([("model.norm.weight", 4), ("lm_header.weight", 3)]) == 0


def test_the_attention_probes_run_as_the_job_does(monkeypatch):
    """probe_rates times attention with grouped heads and mlx-lm's masks (a prompt chunk's
    causal mask over a cache, a decode pool's), through the CPU kernel or MLX: rates
    measured, positive and finite, on both paths."""
    import math

    from mlx_tier.kernels import cpu, cpu_attention
    from mlx_tier.tools import pools

    monkeypatch.setattr(pools, "PROBE_SECONDS", 0.01)
    seen = []
    real = cpu_attention.sdpa
    monkeypatch.setattr(cpu_attention, "sdpa", lambda q, k, v, scale, mask: seen.append(
        (q.shape, k.shape, None if mask is None else mask.shape)) or real(q, k, v, scale, mask))
    for attention in ("cpu", "mlx"):
        r = pools.probe_rates(1.0, (64, 32), 4, 32, heads=6, head_dim=16, attention=attention, kv_heads=2)
        assert all(math.isfinite(x) and x > 0 for x in (r.attention_gflops, r.kv_read_gbps))
    assert (1, 6, 256, 16) in [s[0] for s in seen] and {s[1][1] for s in seen} == {2}
    assert {s[2] for s in seen} == {(1, 1, 256, 1024), (max(8, 2 * cpu.THREADS), 1, 1, 1024)}


def test_decode_steps_are_priced_with_the_slots_they_borrow():
    """Slots lent to decode steps price decode steps with them, prefill steps without; the
    cache chooser prices each count with what it would lend there."""
    from mlx_tier.tools.pools import choose_slots

    base = choose_pools(replace(SYNTH, slots=5), RATES, 600, 32, int(0.4 * 2**30), documents=6)
    lent = choose_pools(replace(SYNTH, slots=5), RATES, 600, 32, int(0.4 * 2**30), documents=6, decode_slots=3)
    assert (lent.prefill_tokens, lent.decode_pool, lent.prompt_tok_s) == (
        base.prefill_tokens, base.decode_pool, base.prompt_tok_s)
    pool = replace(SYNTH, slots=8)  # decode steps at 5 + 3 slots
    ctx = 600 + 32 / 2
    want = seconds_per_token(pool, RATES, lent.decode_pool, ctx)
    assert want < seconds_per_token(replace(SYNTH, slots=5), RATES, lent.decode_pool, ctx)
    assert lent.decode_tok_s > base.decode_tok_s and lent.docs_per_hour > base.docs_per_hour
    capped = choose_pools(replace(SYNTH, slots=126), RATES, 600, 32, int(0.4 * 2**30), documents=6, decode_slots=9)
    assert capped == choose_pools(replace(SYNTH, slots=126), RATES, 600, 32, int(0.4 * 2**30), documents=6,
                                  decode_slots=2)  # at most every expert resident

    row, tight = 24 * 2_950_000, int(0.73 * 2**30)
    asked = []
    n, plan, _ = choose_slots(SYNTH, RATES, 600, 32, tight, row, 8, documents=6,
                              decode_slots=lambda k: asked.append(k) or 2)
    assert sorted(asked) == list(range(1, 9))
    left = int((tight - n * row) * (1 - ROOM_MARGIN))
    assert plan == choose_pools(replace(SYNTH, slots=n), RATES, 600, 32, left, documents=6, decode_slots=2)


def test_a_near_tie_between_prompt_steps_goes_one_size_up(monkeypatch):
    """The prefill pool is the smallest within NEAR_BEST of the best rate, or the next size
    up when that is within it too: a larger step reads each expert for more tokens, which
    the model prices optimistically (a 128-token step read 0.85-0.87x a 256-token step's
    prompt rate on the capped synthetic, priced within 3%). Never further than one size:
    where the rate keeps rising by a hair, the step stays near the smallest."""
    import mlx_tier.tools.pools as pools_module

    def rate_curve(curve):
        monkeypatch.setattr(pools_module, "seconds_per_token", lambda shape, rates, t, *a: 1 / curve.get(t, 1.0))

    rate_curve({128: 100.0, 256: 98.0, 512: 90.0})  # 128 best, 256 within 3%: 256
    assert choose_pools(SYNTH, RATES, 900, 64, 64 << 30, max_pool=512).prefill_tokens == 256
    rate_curve({128: 100.0, 256: 96.0, 512: 90.0})  # none within: the best
    assert choose_pools(SYNTH, RATES, 900, 64, 64 << 30, max_pool=512).prefill_tokens == 128
    rate_curve({512: 99.0, 1024: 99.5, 2048: 100.0})  # rising by a hair: one size up from the smallest
    assert choose_pools(SYNTH, RATES, 900, 64, 64 << 30, max_pool=2048).prefill_tokens == 1024


def test_the_users_tok_s_cap_is_priced():
    """A user trial: `run --max-tok-s 2` predicted the documents/hour of an uncapped run.
    Each step lasts at least its generated tokens over the cap (the throttle's pacing):
    decode steps' tokens at least 1/cap each, prefill steps at least their merged tokens'
    share; prompts are not capped. A cap above the machine's rate changes nothing."""
    free = choose_pools(SYNTH, RATES, 900, 64, 1 << 30)
    assert choose_pools(SYNTH, RATES, 900, 64, 1 << 30, max_tok_s=1e6) == free
    capped = choose_pools(SYNTH, RATES, 900, 64, 1 << 30, max_tok_s=0.5)
    assert capped.prompt_tok_s == free.prompt_tok_s
    assert 64 * capped.docs_per_hour / 3600 <= 0.5  # the job never generates faster than the cap
    assert 64 / capped.decode_tok_s >= (64 - capped.merged_tokens) / 0.5  # decode steps' tokens: 2 s each
    assert 3600 / capped.docs_per_hour == pytest.approx(900 / capped.prompt_tok_s + 64 / capped.decode_tok_s)
    assert capped.docs_per_hour < free.docs_per_hour and 3600 / capped.batch1_docs_per_hour >= 128
    # merged tokens ride prefill steps: they cost nothing more while the steps outlast them
    apart = choose_pools(SYNTH, RATES, 900, 64, 1 << 30, max_tok_s=0.5, merged=False)
    assert capped.docs_per_hour >= apart.docs_per_hour
