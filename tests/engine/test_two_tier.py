"""The CUDA path's two-tier cache, run here with the "GPU" slabs on the CPU.

Invariant 1: a two-tier model (hot slots + warm host slots, warm experts
computed on the CPU stream, copies decided by the cost model) generates exactly
the greedy tokens of mlx-lm fully resident — and so of the single-tier path,
which tests/engine/test_tiered_equals_resident.py holds to the same reference — for several hot and
warm sizes; with the warm tier on the CPU expert kernel, logits stay within
its fp32 bound and the greedy tokens are equal. The live
hit/miss/promotion/demotion sequence equals what mlx_tier.routing.simulate_tiers
predicts from the recorded trace, warm -> hot prefetch and pre-warm (hot, then
warm, by profile rank; pinned) included. Invariant 2 holds per tier.
"""

import math
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.engine import budgets as tier_budgets
from mlx_tier.policy.cost_model import TransferCosts
from mlx_tier.routing import profile as prof
from mlx_tier.routing.simulate_tiers import simulate_two_tier

LONG = (
    "In the beginning the river carried salt and silt down from the mountains, and the people who "
    "lived along its banks learned to read its moods, planting after the floods and fishing in the "
    "long dry months when the water ran clear and slow over the stones."
)
NEVER_COPY = TransferCosts(cpu_gbps=math.inf)
ALWAYS_COPY = TransferCosts(pcie_gbps=math.inf, gpu_gbps=math.inf)
DEFAULT = TransferCosts()  # copies experts with >= 3 tokens: prefill promotes, decode computes warm


_SLOT_ROW_GB = {}  # checkpoint -> GiB of one slot in every layer


def load_two_tier(path, hot, warm, costs, **kw):
    """A two-tier model with exactly ``hot`` and ``warm`` slots per layer."""
    if path not in _SLOT_ROW_GB:
        one, _ = mlx_tier.load(path, config=TierConfig(slots_per_layer=1))
        _SLOT_ROW_GB[path] = one.expert_cache.layers[0].slot_nbytes * len(one.expert_cache.layers) / 2**30
    slot_gb = _SLOT_ROW_GB[path]
    cfg = TierConfig(slots_per_layer=hot, host_cache_gb=warm * slot_gb * 1.0001, transfer_costs=costs, **kw)
    model, tokenizer = mlx_tier.load(path, config=cfg)
    assert model.expert_cache.warm_slots == (warm,) * len(model.expert_cache.layers)
    return model, tokenizer


@pytest.fixture(scope="module", params=["q4", "fp32"])
def checkpoint(request, tiny_moe, tiny_moe_fp):
    path = tiny_moe if request.param == "q4" else tiny_moe_fp
    model, tokenizer = mlx_load(str(path))
    return path, generate(model, tokenizer, LONG, max_tokens=10, verbose=False)


@pytest.mark.parametrize("hot,warm,costs", [(1, 1, DEFAULT), (1, 7, ALWAYS_COPY), (2, 3, NEVER_COPY),
                                            (3, 5, DEFAULT), (2, 0, DEFAULT)])
def test_greedy_tokens_equal_mlx_lm(checkpoint, hot, warm, costs):
    path, ref = checkpoint
    model, tokenizer = load_two_tier(path, hot, warm, costs)
    assert generate(model, tokenizer, LONG, max_tokens=10, verbose=False) == ref
    s = model.expert_cache.stats
    assert s.misses > 0 and s.hits == s.hot_hits + s.warm_hits + s.promotions
    if warm and costs is not ALWAYS_COPY:
        assert s.warm_hits + s.misses_warm > 0 and s.cpu_entries > 0  # the CPU stream really computed
    if costs is ALWAYS_COPY:
        assert s.promotions > 0 and s.demotions > 0
    if warm == 0:
        assert s.cpu_entries == 0 and s.warm_hits == s.misses_warm == 0


def test_wrong_warm_expert_is_detected(tiny_moe):
    """The exactness test can fail: a warm pool holding other experts changes the output."""
    model, tokenizer = load_two_tier(tiny_moe, 1, 7, NEVER_COPY)
    x = mx.array(tokenizer.encode(LONG))[None]
    good = model(x)
    mx.eval(good)
    layer = model.expert_cache.tier_layers[0]
    assert layer.index.counts["miss_warm"] > 0
    for name in layer.warm.arrays:
        layer.warm.arrays[name] = mx.roll(layer.warm.arrays[name], 1, axis=0)
    assert not mx.allclose(good, model(x), atol=1e-3).item()


def one_token_calls(model, tokenizer, prompt, n):
    """Greedy decode feeding every token alone (prompt too), so that each
    layer call is one trace record. Returns the generated token ids."""
    cache = make_prompt_cache(model)
    for t in tokenizer.encode(prompt):
        logits = model(mx.array([[t]]), cache=cache)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


def traced_tokens_equal_mlx_lm(model, tokenizer, checkpoint):
    """Decode 8 tokens one call at a time with a fresh event log and routing trace,
    check them against mlx-lm's on the same checkpoint; return the trace."""
    cache = model.expert_cache
    for t in cache.tier_layers:
        t.index.log = []
    cache.start_trace()
    tokens = one_token_calls(model, tokenizer, LONG[:120], 8)
    trace = cache.stop_trace()
    ref_model, ref_tok = mlx_load(str(checkpoint))
    assert tokens == one_token_calls(ref_model, ref_tok, LONG[:120], 8)
    return trace


@pytest.mark.parametrize("policy,hot,warm,costs,prefetch", [
    ("lru", 2, 3, DEFAULT, False), ("lfu", 1, 4, ALWAYS_COPY, True), ("2q", 3, 2, NEVER_COPY, False),
    ("lfu", 2, 4, DEFAULT, True), ("lru", 1, 3, NEVER_COPY, True)])
def test_live_sequence_equals_the_simulator(tiny_moe, policy, hot, warm, costs, prefetch):
    """Prefetch included: its warm -> hot promotions (recorded predictions) replay identically."""
    model, tokenizer = load_two_tier(tiny_moe, hot, warm, costs, policy=policy, prefetch=prefetch)
    cache = model.expert_cache
    trace = traced_tokens_equal_mlx_lm(model, tokenizer, tiny_moe)
    assert (trace.predicted is not None) == prefetch
    sim = simulate_two_tier(trace, policy, hot, warm, costs, cache.layers[0].slot_nbytes, keep_events=True,
                            prefetch=prefetch)
    assert sim.events == tuple(tuple(t.index.log) for t in cache.tier_layers)
    s = cache.stats
    assert (s.hot_hits, s.warm_hits, s.promotions, s.misses_hot, s.misses_warm, s.demotions,
            s.promotions_ahead) == (
        sim.counts["hot_hit"], sim.counts["warm_hit"], sim.counts["promote"], sim.counts["miss_hot"],
        sim.counts["miss_warm"], sim.counts["demote"], sim.counts["promote_ahead"])
    assert len(sim.events[0]) > 20  # a real sequence was compared
    if prefetch and costs is not NEVER_COPY:
        assert s.promotions_ahead > 0  # warm -> hot prefetch really happened
        without = simulate_two_tier(trace, policy, hot, warm, costs, cache.layers[0].slot_nbytes)
        assert without.counts["promote_ahead"] == 0 and without.counts != sim.counts


def test_each_tier_stays_within_its_budget(tiny_moe):
    model, tokenizer = load_two_tier(tiny_moe, 2, 3, DEFAULT)
    generate(model, tokenizer, LONG, max_tokens=6, verbose=False)
    cache = model.expert_cache
    hot = sum(t.module[t.attr].nbytes for layer in cache.layers for t in layer.tensors.values())
    warm = sum(a.nbytes for t in cache.tier_layers for a in t.warm.arrays.values())
    assert hot == cache.resident_bytes <= cache.budget_bytes
    assert warm == cache.warm_resident_bytes <= cache.warm_budget_bytes
    for t in cache.tier_layers:
        assert (t.index.hot_slot >= 0).sum() <= 2 and (t.index.warm_slot >= 0).sum() <= 3


def test_bad_settings_are_clear_errors(tiny_moe):
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="host_cache_gb must be a finite number of GiB >= 0"):
            mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=2, host_cache_gb=bad))


def test_failed_read_resets_both_tiers_and_stays_exact(tiny_moe):
    model, tokenizer = load_two_tier(tiny_moe, 1, 2, DEFAULT)
    store = model.expert_cache.store
    real, calls = store.read_experts, {"n": 0}

    def flaky(names, experts):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(5, "Input/output error")
        return real(names, experts)

    store.read_experts = flaky
    with pytest.raises(OSError):
        generate(model, tokenizer, LONG, max_tokens=6, verbose=False)
    store.read_experts = real
    ref_model, ref_tok = mlx_load(str(tiny_moe))
    assert generate(model, tokenizer, LONG, max_tokens=6, verbose=False) == generate(
        ref_model, ref_tok, LONG, max_tokens=6, verbose=False)


@pytest.fixture(scope="module")
def saved_profile(tiny_moe, tmp_path_factory):
    """A profile file from a run of the tiny MoE (kept out of its folder)."""
    model, tokenizer = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=3))
    generate(model, tokenizer, LONG, max_tokens=6, verbose=False)
    path = tmp_path_factory.mktemp("profile") / "p.json"
    prof.save(prof.from_counts(model.expert_cache.profile_counts()), path)
    return path


@pytest.mark.parametrize("policy,hot,warm,costs,prewarm", [
    ("pinned", 2, 3, DEFAULT, None), ("lfu", 1, 4, ALWAYS_COPY, True), ("pinned", 1, 2, NEVER_COPY, None)])
def test_prewarm_and_pinned_fill_hot_then_warm(tiny_moe, saved_profile, policy, hot, warm, costs, prewarm):
    p = prof.load(saved_profile)
    model, tokenizer = load_two_tier(tiny_moe, hot, warm, costs, policy=policy, profile=saved_profile,
                                     prewarm=prewarm)
    cache = model.expert_cache
    for i, t in enumerate(cache.tier_layers):
        ranked = p.hottest(i, hot + warm)
        assert len(ranked) == hot + warm  # the profile ranks enough experts for both tiers
        assert sorted(np.flatnonzero(t.index.hot_slot >= 0)) == sorted(ranked[:hot])
        assert sorted(np.flatnonzero(t.index.warm_slot >= 0)) == sorted(ranked[hot:])
    s = cache.stats
    assert s.prewarmed == (hot + warm) * len(cache.layers) and s.prewarm_bytes > 0
    assert (s.hits, s.misses, s.bytes_read) == (0, 0, 0)  # pre-warm reads are neither
    trace = traced_tokens_equal_mlx_lm(model, tokenizer, tiny_moe)
    nbytes = cache.layers[0].slot_nbytes
    sim = simulate_two_tier(trace, policy, hot, warm, costs, nbytes, profile=p, keep_events=True, prewarm=True)
    assert sim.events == tuple(tuple(t.index.log) for t in cache.tier_layers)
    assert simulate_two_tier(trace, policy, hot, warm, costs, nbytes, profile=p).counts != sim.counts


BOUND = 1e-4  # the CPU kernel's bound (tests/kernels/test_cpu_kernel.py): max|d| <= BOUND * max|reference|


@pytest.mark.parametrize("hot,warm,costs", [(1, 7, NEVER_COPY), (2, 3, DEFAULT), (1, 2, DEFAULT)])
def test_cpu_kernel_on_the_warm_tier_stays_within_its_bound(checkpoint, hot, warm, costs):
    path, ref = checkpoint
    model, tokenizer = load_two_tier(path, hot, warm, costs, kernel="cpu")
    assert model.expert_cache.kernel == "cpu" and model.expert_cache.tier_layers[0].warm.kernel is not None
    x = mx.array(tokenizer.encode(LONG))[None]
    full, _ = load_model(path)
    full.set_dtype(mx.float32)
    want = full(x)
    got = model(x)
    assert (mx.abs(want - got).max() / mx.abs(want).max()).item() <= BOUND
    assert generate(model, tokenizer, LONG, max_tokens=10, verbose=False) == ref
    s = model.expert_cache.stats
    assert s.cpu_entries > 0 and s.warm_hits + s.misses_warm > 0


def test_warm_tier_computes_on_its_own_cpu_stream(tiny_moe):
    """Not the default stream: the warm share runs beside the hot one (here on a second CPU thread)."""
    model, _ = load_two_tier(tiny_moe, 1, 3, NEVER_COPY)
    pools = [t.warm for t in model.expert_cache.tier_layers]
    assert all(p.kernel is None and p.stream.device == mx.cpu for p in pools)
    assert all(p.stream != mx.default_stream(mx.default_device()) for p in pools)
    assert all(p.stream == pools[0].stream for p in pools)  # one for the model, not a thread per layer


def _bf16_two_tier(path, warm_rows_of_hot: float, kernel: str):
    """A two-tier model keeping the checkpoint's bf16 (as on a GPU): 1 hot slot per layer,
    a warm budget of ``warm_rows_of_hot`` hot slots per layer."""
    one, _ = mlx_tier.load(path, config=TierConfig(slots_per_layer=1, dtype=mx.bfloat16))
    hot_row = one.expert_cache.layers[0].slot_nbytes * len(one.expert_cache.layers)
    cfg = TierConfig(slots_per_layer=1, dtype=mx.bfloat16, kernel=kernel, transfer_costs=NEVER_COPY,
                     host_cache_gb=warm_rows_of_hot * hot_row / 2**30)
    return mlx_tier.load(path, config=cfg)


def test_cpu_kernel_warm_pool_holds_float32_and_counts_it(tiny_moe_bf16):
    """With the CPU kernel a warm pool keeps bf16 scales/biases as float32 (converted once, on
    entry); its slots are sized and budgeted at those bytes. With MLX's ops it keeps bf16."""
    model, _ = _bf16_two_tier(tiny_moe_bf16, 3, "cpu")
    cache = model.expert_cache
    hot, warm = cache.layers[0], cache.tier_layers[0].warm
    floating = [n for n, t in hot.tensors.items() if mx.issubdtype(t.dtype, mx.floating)]
    assert floating and all(hot.tensors[n].dtype == mx.bfloat16 for n in floating)  # the "GPU" keeps bf16
    assert all(warm.arrays[n].dtype == mx.float32 for n in floating)
    assert warm.slot_nbytes == 1.2 * hot.slot_nbytes  # 4-bit, group 32: scales + biases double, 0.625 -> 0.75 B/w
    # 3 hot slots' bytes per layer hold 2.5 warm slots: 2 (by the hot bytes it would be 3)
    assert cache.warm_slots == (2,) * len(cache.layers)
    assert cache.warm_resident_bytes == 2 * len(cache.layers) * warm.slot_nbytes <= cache.warm_budget_bytes
    mlx_model, _ = _bf16_two_tier(tiny_moe_bf16, 3, "mlx")
    mlx_warm = mlx_model.expert_cache.tier_layers[0].warm
    assert all(mlx_warm.arrays[n].dtype == mx.bfloat16 for n in floating)
    assert mlx_model.expert_cache.warm_slots == (3,) * len(cache.layers)


def test_cpu_kernel_gets_float32_and_the_same_outputs(tiny_moe_bf16, monkeypatch):
    """No per-call conversion: every stacked array the CPU kernel reads from a warm pool is
    already float32 (or packed ints); the outputs equal those of the kernel reading the
    same experts from a bf16 pool (which converts on each call)."""
    from mlx_tier.kernels import cpu as cpu_kernel

    model, tokenizer = _bf16_two_tier(tiny_moe_bf16, 7 * 1.2, "cpu")
    x = mx.array(tokenizer.encode(LONG))[None]
    model(x)  # fills the pools
    seen = []
    real_host = cpu_kernel._host
    def spy(a, float32=True):
        if a.ndim == 3:  # a stacked [S, O, ...] array (activations are [T, D], in the model's bf16)
            seen.append(a.dtype)
        return real_host(a, float32)

    monkeypatch.setattr(cpu_kernel, "_host", spy)
    mx.eval(model(x[:, :5]))
    assert model.expert_cache.stats.warm_hits > 0
    assert seen.count(mx.float32) > 0 and set(seen) <= {mx.float32, mx.uint32}
    layer = model.expert_cache.tier_layers[0]
    block = model.layers[0].block_sparse_moe.switch_mlp._inner
    W = layer.index.W
    xs = mx.random.normal((W, model.args.hidden_size), key=mx.random.key(3)).astype(mx.bfloat16)
    slots = np.arange(W)
    got = layer.warm.compute(block, xs, slots)
    f32 = dict(layer.warm.arrays)
    layer.warm.arrays = {n: a.astype(layer.warm.tensors[n].dtype) for n, a in f32.items()}  # a bf16 pool
    want = layer.warm.compute(block, xs, slots)
    layer.warm.arrays = f32
    assert got.dtype == want.dtype == mx.bfloat16 and mx.array_equal(got, want).item()


def test_device_placement_of_the_warm_tier(tiny_moe, monkeypatch):
    """What a CUDA machine needs and the CPU backend cannot show by itself: each round's warm
    rows are taken to the CPU before the hot share is started (a CPU read of GPU memory
    synchronises the device on CUDA), and every write to a warm pool runs on the warm
    tier's CPU stream (a GPU write would move the pool out of host memory)."""
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlx_tier.engine.two_tier import TwoTierLayer
    from mlx_tier.engine.warm_pool import WarmPool

    model, tokenizer = load_two_tier(tiny_moe, 1, 3, NEVER_COPY)
    ws = model.expert_cache.tier_layers[0].warm.stream
    events, writes = [], []
    real_rows, real_call, real_write, real_stream = WarmPool.rows, SwitchGLU.__call__, TwoTierLayer._write, mx.stream
    monkeypatch.setattr(WarmPool, "rows", lambda self, x, r: events.append("rows") or real_rows(self, x, r))

    def call(self, x, idx):  # the block: on the warm stream for the warm share, else the hot share
        events.append("warm" if mx.default_stream(mx.cpu) == ws else "hot")
        return real_call(self, x, idx)

    def write(self, name, tier, slot, rows):
        writes.append([tier])
        return real_write(self, name, tier, slot, rows)

    def stream(s):
        if writes and len(writes[-1]) == 1:
            writes[-1].append(s)  # the stream the write entered
        return real_stream(s)

    monkeypatch.setattr(SwitchGLU, "__call__", call)
    monkeypatch.setattr(TwoTierLayer, "_write", write)
    monkeypatch.setattr(mx, "stream", stream)
    mx.eval(model(mx.array(tokenizer.encode(LONG))[None]))
    mixed = [i for i in range(1, len(events) - 1) if events[i : i + 2] == ["hot", "warm"]]
    assert mixed and all(events[i - 1] == "rows" for i in mixed)
    assert {tier for tier, _ in writes} == {"hot", "warm"}
    assert all((s == ws) == (tier == "warm") for tier, s in writes)


class _FakeCudaMLX:
    """``mlx.core`` as a CUDA machine reports it, with a settable memory limit."""

    def __init__(self, limit, cuda=True):
        self.metal = SimpleNamespace(is_available=lambda: False)
        self.cuda = SimpleNamespace(is_available=lambda: cuda)
        self.limit, self.set_calls = limit, 0

    def get_memory_limit(self):
        return self.limit

    def set_memory_limit(self, n):
        self.limit, self.set_calls = n, self.set_calls + 1
        return n


def test_mlx_memory_limit_widened_by_the_warm_pools_on_cuda():
    """MLX's CUDA limit (a fraction of GPU memory) counts host-resident warm pools too; above it
    every evaluation waits for work in flight. The limit becomes its earlier value plus the
    pools' bytes, is never lowered, does not grow with repeated loads, and elsewhere is left alone."""
    from mlx_tier.engine.budgets import widen_memory_limit

    gib = 2**30
    api = _FakeCudaMLX(limit=72 * gib)
    assert widen_memory_limit(100 * gib, api) == 172 * gib == api.limit
    assert widen_memory_limit(100 * gib, api) == 172 * gib and api.set_calls == 1  # a second load: no growth
    assert widen_memory_limit(120 * gib, api) == 192 * gib == api.limit  # a bigger pool: 72 + 120
    assert widen_memory_limit(10 * gib, api) == 192 * gib == api.limit  # never lowered
    fresh = _FakeCudaMLX(limit=72 * gib)
    assert widen_memory_limit(0, fresh) == 72 * gib and fresh.set_calls == 0
    cpu = _FakeCudaMLX(5, cuda=False)
    assert widen_memory_limit(100 * gib, cpu) is None and cpu.limit == 5
    if tier_budgets.backend_of() != "cuda":  # this machine without a GPU: untouched
        assert widen_memory_limit(gib) is None


@pytest.mark.parametrize("kernel", ["mlx", "cpu"])
def test_a_cast_after_load_reaches_both_tiers(tiny_moe, kernel):
    """What mlx-lm does to its models after load works on a two-tier one: cast to bf16
    (hot slabs and MLX pools cast; a CPU-kernel pool stays float32, its values rounded
    through bf16), the tokens then those of mlx-lm's model cast alike; ``copy.deepcopy``
    gives a model with tiers of its own that computes the same."""
    import copy

    model, tokenizer = load_two_tier(tiny_moe, 1, 3, NEVER_COPY, kernel=kernel, dtype=mx.float32)
    generate(model, tokenizer, LONG, max_tokens=4, verbose=False)  # both tiers hold experts
    model.set_dtype(mx.bfloat16)
    ref, ref_tokenizer = mlx_load(str(tiny_moe))
    ref.set_dtype(mx.bfloat16)
    want = generate(ref, ref_tokenizer, LONG, max_tokens=10, verbose=False)
    got = generate(model, tokenizer, LONG, max_tokens=10, verbose=False)  # the cast is applied at the next call
    assert got == want or kernel == "cpu"  # MLX's ops in bf16: exactly mlx-lm's
    tier = model.expert_cache.tier_layers[0]
    assert tier.index.expert_nbytes == tier.hot.slot_nbytes  # the cost model weighs the cast bytes
    for name, t in tier.hot.tensors.items():
        if mx.issubdtype(t.dtype, mx.floating):
            assert t.dtype == mx.bfloat16 and t.module[t.attr].dtype == mx.bfloat16
            pool = tier.warm.arrays[name]
            assert pool.dtype == (mx.float32 if kernel == "cpu" else mx.bfloat16)
            assert mx.array_equal(pool, pool.astype(mx.bfloat16).astype(pool.dtype)).item()  # bf16 values
    twin = copy.deepcopy(model)
    x = mx.array(tokenizer.encode(LONG))[None]
    assert mx.array_equal(model(x), twin(x)).item()
    assert twin.expert_cache.tier_layers[0].warm.arrays is not tier.warm.arrays
    assert twin.expert_cache.tier_layers[0].hot is twin.expert_cache.layers[0]
