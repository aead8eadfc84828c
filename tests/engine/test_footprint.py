"""One total is split into a run's parts that add up to it; a total or a cache that cannot
hold what the run needs besides is refused with every figure named; the prompt step
shrinks when memory is short, and as a prompt's attention grows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlx_tier.engine import footprint
from mlx_tier.engine.footprint import (
    MIN_PROMPT_STEP,
    MemoryBudget,
    ModelShape,
    Needs,
    min_kv,
    room_now,
    split,
    step_workspace,
)
from mlx_tier.errors import BudgetError

GIB, MIB = 2**30, 2**20
# The 8 GB synthetic qwen3_moe (Qwen3-30B-A3B layer shapes, 24 layers), float32 on the CPU backend.
SHAPE = ModelShape(hidden=2048, expert_inner=768, top_k=8, experts=128, heads=32, kv_heads=4, head_dim=128,
                   layers=24, vocab=49152)
SLOT = 3 * (768 * 2048 // 2 + 2 * 768 * 2048 // 64 * 4)  # gate, up, down: 4-bit codes + float32 scales, biases
NEEDS = Needs(dense=int(0.45 * GIB), slot_row=24 * SLOT, all_experts=24 * 128 * SLOT, shape=SHAPE, kernel="cpu")


def test_parts_add_up_and_the_cache_takes_its_share_in_whole_slot_rows():
    b = split(4 * GIB, NEEDS)
    assert sum(b.parts().values()) == b.total == 4 * GIB
    room = b.total - (b.runtime + b.dense + b.buffers + b.margin + b.workspace)
    assert b.cache % NEEDS.slot_row == 0 and room * footprint.CACHE_SHARE - NEEDS.slot_row < b.cache
    assert b.cache <= room * footprint.CACHE_SHARE and b.cache >= SHAPE.top_k * NEEDS.slot_row
    assert b.kv >= min_kv(SHAPE) and not b.cache_given and b.source == "memory_gb"
    # The workspace holds a layer's round of experts read ahead (one layer's slots) beside the
    # step's own; the prompt step is sized without it.
    ahead = footprint.read_ahead_bytes(b.cache, SHAPE)
    assert ahead == b.cache // 24 > 0
    assert b.workspace - ahead >= footprint.step_workspace(SHAPE, "cpu", b.prefill_step, b.prefill_step)
    assert b.prompt_step(0) == b.prefill_step


def test_a_short_total_still_gives_the_cache_one_tokens_experts_before_the_kv_cache_more():
    """The issue's machine: the 8 GB synthetic in 2 GiB. Half of the room would be 5 slots per
    layer, fewer than top-8: every token would be served in rounds; the cache takes 8."""
    b = split(2 * GIB, NEEDS)
    room = b.total - (b.runtime + b.dense + b.buffers + b.margin + b.workspace)
    assert room * footprint.CACHE_SHARE < SHAPE.top_k * NEEDS.slot_row
    assert b.cache == SHAPE.top_k * NEEDS.slot_row and b.kv >= min_kv(SHAPE)
    big = split(400 * GIB, NEEDS)  # never more cache than every expert
    assert big.cache == NEEDS.all_experts and sum(big.parts().values()) == big.total


def test_a_cache_too_large_for_the_limit_is_refused_naming_every_figure():
    """The issue: --cache-gb 1.2 inside a 2 GiB cgroup was OOM-killed; now it is one line before loading."""
    with pytest.raises(BudgetError) as e:
        split(2 * GIB, NEEDS, cache=int(1.2 * GIB), source="cgroup v1 memory.limit_in_bytes")
    msg = str(e.value)
    assert e.value.field == "cache_gb"
    assert msg.startswith("`cache_gb` 1.20 GiB does not fit in 2.00 GiB (cgroup v1 memory.limit_in_bytes)")
    for part in (f"runtime {footprint.RUNTIME_BYTES / GIB:.2f}", "dense part 0.45", "workspace", "MLX buffers",
                 "margin", "KV of one 512-token"):
        assert part in msg
    assert "GiB for the expert cache" in msg
    ok = split(2 * GIB, NEEDS, cache=int(0.3 * GIB))  # what the figures say is left fits
    assert ok.cache_given and ok.cache == int(0.3 * GIB)


def test_a_cache_too_small_for_one_slot_row_is_echoed_with_its_digits():
    """The issue: --cache-gb 0.0001 was echoed as "0.000 GiB"; the refusal says what was given."""
    from mlx_tier.engine.load import plan_slots

    with pytest.raises(BudgetError) as e:
        split(4 * GIB, NEEDS, cache=int(0.0001 * GIB))
    assert e.value.field == "cache_gb"
    assert str(e.value).startswith("`cache_gb` 0.0001 GiB is too small: one expert slot per MoE layer needs "
                                   f"{NEEDS.slot_row / GIB:.3g} GiB")
    with pytest.raises(BudgetError, match=r"^cache budget 0\.0001 GiB is too small: .* needs 0\.0659 GiB"):
        plan_slots(int(0.0001 * GIB), 24, SLOT, 128)


def test_a_total_below_the_fixed_parts_is_refused():
    with pytest.raises(BudgetError, match=r"1.00 GiB \(`memory_gb`\) is too little for this model: it needs runtime") as e:
        split(1 * GIB, NEEDS)
    assert e.value.field == "memory_gb" and "one expert slot per MoE layer" in str(e.value)


def test_the_prompt_step_shrinks_when_memory_is_short_and_as_the_prompt_grows():
    roomy, tight = split(16 * GIB, NEEDS, prefill_step=512), split(int(1.6 * GIB), NEEDS, prefill_step=512)
    assert roomy.prefill_step == 512 and MIN_PROMPT_STEP <= tight.prefill_step < 512
    assert step_workspace(SHAPE, "cpu", tight.prefill_step, tight.prefill_step) <= tight.workspace
    steps = [tight.prompt_step(done) for done in (0, 1000, 4000, 16000)]
    assert steps == sorted(steps, reverse=True) and steps[-1] < steps[0] and steps[-1] >= MIN_PROMPT_STEP
    for done, step in zip((0, 1000, 4000), steps):
        assert step == MIN_PROMPT_STEP or step_workspace(SHAPE, "cpu", step, done + step) <= tight.workspace


def test_step_workspace_grows_with_tokens_context_and_batch():
    assert step_workspace(SHAPE, "cpu", 64, 64) < step_workspace(SHAPE, "cpu", 512, 512)
    assert step_workspace(SHAPE, "cpu", 64, 64) < step_workspace(SHAPE, "cpu", 64, 4096)
    decode1, decode8 = (step_workspace(SHAPE, "cpu", b, 600, b) for b in (1, 8))
    assert decode1 < decode8 and decode8 - decode1 >= 7 * 3 * SHAPE.vocab * 4  # the logits of 7 more sequences


def test_room_for_sequences_is_the_least_of_the_share_the_total_and_the_limit():
    b = MemoryBudget(total=2 * GIB, source="memory_gb", runtime=0, dense=0, cache=0, kv=512 * MIB,
                     workspace=64 * MIB, buffers=32 * MIB, margin=128 * MIB, prefill_step=128)
    reserve = 224 * MIB
    assert room_now(b, rss=GIB, available=10 * GIB) == 512 * MIB  # the KV share
    assert room_now(b, rss=int(1.5 * GIB), available=10 * GIB) == int(0.5 * GIB) - reserve  # the total
    assert room_now(b, rss=GIB, available=300 * MIB) == 300 * MIB - reserve  # the limit, e.g. a busy cgroup
    assert room_now(b, rss=2 * GIB, available=GIB) == 0
    shaped = replace(b, shape=SHAPE)  # the split set one shortest sequence aside: never less
    assert room_now(shaped, rss=2 * GIB, available=0) == min_kv(SHAPE)


@pytest.mark.skipif(not __import__("pathlib").Path("/proc/self/status").exists(), reason="Linux /proc only")
def test_a_process_reports_its_own_peak_not_the_peak_of_the_process_that_started_it():
    """``peak_rss`` (a run's peak against its budget) is the run's own: a process started
    by a large one (pytest after many tests, a launcher) does not inherit its high-water
    mark, as ``ru_maxrss`` does on Linux across fork and exec."""
    import subprocess
    import sys

    from mlx_tier.engine.sizes import peak_rss

    ballast = bytearray(512 << 20)  # touched: resident in this process
    ballast[:: 4096] = b"\x01" * len(ballast[:: 4096])
    assert peak_rss() > 512 << 20
    child = subprocess.run([sys.executable, "-c", "from mlx_tier.engine.sizes import peak_rss; print(peak_rss())"],
                           capture_output=True, text=True, check=True)
    assert int(child.stdout) < 384 << 20, child.stdout  # the child's imports only
    del ballast


def test_the_cpu_kernels_wide_rounds_are_counted_in_the_workspace():
    """With the CPU kernel a layer call beyond its slots computes rounds of ROUND_EXPERTS
    experts from scratch slabs: the scratch, a round's reads and the next round's are
    workspace, whatever the cache (a small one reads ahead less than that)."""
    from mlx_tier.defaults import ROUND_EXPERTS

    wide = 3 * ROUND_EXPERTS * SLOT
    assert footprint.read_ahead_bytes(24 * SLOT, SHAPE, "cpu", SLOT) == wide  # 1 slot a layer
    assert footprint.read_ahead_bytes(24 * SLOT, SHAPE, "mlx", SLOT) == SLOT  # MLX's rounds: the slots
    big = 24 * 4 * ROUND_EXPERTS * SLOT  # a layer's slots more than the wide rounds' bytes
    assert footprint.read_ahead_bytes(big, SHAPE, "cpu", SLOT) == big // 24
    with_wide, without = split(2 * GIB, replace(NEEDS, expert=SLOT)), split(2 * GIB, NEEDS)
    assert with_wide.expert == SLOT and sum(with_wide.parts().values()) == 2 * GIB
    ahead = footprint.read_ahead_bytes(with_wide.cache, SHAPE, "cpu", SLOT)
    assert ahead == max(with_wide.cache // 24, wide)
    assert with_wide.workspace - without.workspace == ahead - with_wide.cache // 24
    assert with_wide.kv == without.kv - (ahead - with_wide.cache // 24)
    assert with_wide.prompt_step(0) == without.prompt_step(0)  # the step is sized without it


def test_decode_steps_borrow_the_prompt_steps_workspace_in_whole_slot_rows():
    """What a decode step leaves of the workspace a prompt step holds, less the grown cache's
    read ahead, is lent as slot rows: the largest count that fits, never one more."""
    b = split(2 * GIB, replace(NEEDS, expert=SLOT))
    n = b.decode_slots(4, 1000)
    assert n >= 1

    def held(k: int) -> int:
        cache = b.cache + k * b.slot_row
        return (k * b.slot_row + step_workspace(SHAPE, "cpu", 4, 1000, 4)
                + footprint.read_ahead_bytes(cache, SHAPE, "cpu", SLOT))

    assert held(n) <= b.workspace < held(n + 1)
    assert b.decode_slots(32, 30000) <= n  # a larger decode step borrows no more
    assert replace(b, slot_row=0).decode_slots(4, 1000) == 0 and replace(b, shape=None).decode_slots(4, 1000) == 0


@pytest.mark.parametrize("needs", [NEEDS, replace(NEEDS, expert=SLOT)], ids=["mlx rounds", "cpu wide rounds"])
def test_a_larger_total_is_never_refused_where_a_smaller_one_fits(needs):
    """A user trial: the demo ran at `--memory-gb 0.79`, was refused from 0.80 to 0.85 ("too
    little for this model: it needs ... = 0.79 GiB"), and ran again from 0.86: the default
    cache took the top-k slots without counting the read-ahead workspace they bring, and
    left the shortest sequence no room. Over a fine sweep, once a total fits every larger
    one does, each with that sequence's room."""
    fitted = False
    for mib in range(800, 4096, 4):
        try:
            b = split(mib * 2**20, needs)
        except BudgetError:
            assert not fitted, f"{mib} MiB refused after a smaller total fitted"
            continue
        fitted = True
        assert b.kv >= footprint.min_kv(needs.shape) and b.cache >= needs.slot_row
    assert fitted
