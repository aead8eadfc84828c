"""A fully resident layer with the device-side slot remap (kernel ``metal``:
``mlx_tier/kernels/msl/slot_remap.metal``) serves the same slots, hence the same
outputs, and counts the same hits and expert uses as the default path (an
MLX take, router outputs counted on the host), keeping only ``[E]`` counts.

Here the remap body runs compiled with g++ (``tests/metal_harness.py``),
injected through :func:`mlx_tier.kernels.registry.remap_for`'s ``launch``, with MLX's
own expert block (the Metal expert kernels need a Mac). Tests marked
``metal`` run the real kernel on a Mac and are skipped elsewhere.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_tokenizer
from support.metal_harness import Harness, gxx_missing

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.engine.load import TieredExperts
from mlx_tier.kernels import metal as mk
from mlx_tier.kernels import registry as kernels

PROMPTS = ("The weather today", "In the beginning the river carried salt")
STEPS = 6  # decode steps after the prompt

needs_gxx = pytest.mark.skipif(gxx_missing(), reason="g++ not found: cannot compile the Metal bodies on the CPU")


@pytest.fixture(scope="module")
def harness(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)
    where = cache.mkdir("metal_harness") if cache is not None else tmp_path_factory.mktemp("metal_harness")
    return Harness(where, {mk.REMAP.name: [[]]})


def wrappers(model) -> list[TieredExperts]:
    return [m for _, m in model.named_modules() if isinstance(m, TieredExperts)]


def load_full(path, remap=None):
    """The checkpoint with every expert resident (8 slots), MLX's expert ops;
    with ``remap``, every layer's fully resident calls go through it."""
    model, tokenizer = mlx_tier.load(path, config=TierConfig(slots_per_layer=8, kernel="mlx"))
    for w in wrappers(model):
        assert w.remap is None  # the default path, unless a test swaps it in
        w.remap = remap
    return model, tokenizer


def counted(remap):
    """``remap`` that records how many calls it served (so a test can fail
    when the device path is silently not taken)."""
    calls = []

    def run(inds, lut):
        calls.append(inds.shape[0])
        return remap(inds, lut)

    return run, calls


def decode(model, tokens: mx.array, traced: range = range(0)) -> tuple[list[mx.array], object]:
    """Logits of the prompt ``tokens [B, L]``, then of ``STEPS`` greedy steps;
    the routing trace of the steps in ``traced`` (``None`` if empty)."""
    cache, trace = make_prompt_cache(model), None
    logits = model(tokens, cache=cache)[:, -1]  # [B, V]
    out = [logits]
    for step in range(STEPS):
        if traced and step == traced.start:
            model.expert_cache.start_trace()
        if traced and step == traced.stop:
            trace = model.expert_cache.stop_trace()
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache)[:, -1]
        out.append(logits)
    mx.eval(out)
    return out, trace


def assert_same_run(path, tokens: mx.array, remap, traced: range = range(0)) -> None:
    base, _ = load_full(path)
    dev_remap, calls = counted(remap)
    dev, _ = load_full(path, dev_remap)
    (want, trace_a), (got, trace_b) = decode(base, tokens, traced), decode(dev, tokens, traced)
    layers = len(dev.expert_cache.layers)
    # the prompt fills every layer (one call each), then each step not traced
    # (a trace needs the ids on the host) is remapped on the device
    assert len(calls) == (STEPS - len(traced)) * layers and set(calls) == {tokens.shape[0] * 2}
    if traced:
        assert np.array_equal(trace_a.experts, trace_b.experts)
        assert trace_b.experts.shape == (len(traced) * layers * tokens.shape[0], 2)
    for w, g in zip(want, got):
        assert mx.array_equal(w, g)  # same slots -> the same MLX computation, bit for bit
    a, b = base.expert_cache.snapshot(), dev.expert_cache.snapshot()
    counters = ("hits", "misses", "evictions", "bytes_read", "rounds")  # all but wall times
    assert [getattr(a, c) for c in counters] == [getattr(b, c) for c in counters]
    # the prompt reads every expert once (misses); each step uses 2 distinct experts per sequence (hits)
    assert a.misses == 8 * layers and 2 * STEPS * layers <= a.hits <= 2 * STEPS * layers * tokens.shape[0]
    assert np.array_equal(base.expert_cache.profile_counts(), dev.expert_cache.profile_counts())
    assert dev.expert_cache.profile_counts().sum() == layers * 2 * tokens.shape[0] * (tokens.shape[1] + STEPS)


def test_remap_is_chosen_by_the_kernel_setting():
    for name in ("mlx", "cpu", "auto"):  # auto: cpu on this machine
        assert kernels.remap_for(name) is None
    assert callable(kernels.remap_for("metal"))
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernels.remap_for("cuda")


@needs_gxx
def test_device_remap_equals_default_path(tiny_moe, harness):
    """One sequence: same logits at every step, same hits, misses and profile counts."""
    ids = load_tokenizer(tiny_moe).encode(PROMPTS[1])
    assert_same_run(tiny_moe, mx.array(ids)[None], kernels.remap_for("metal", harness.launcher))


@needs_gxx
def test_device_remap_equals_default_path_batch_of_two(tiny_moe_fp, harness):
    """Two sequences in one batch (float experts), decoded together."""
    tok = load_tokenizer(tiny_moe_fp)
    a, b = (tok.encode(p) for p in PROMPTS)
    n = min(len(a), len(b))
    assert_same_run(tiny_moe_fp, mx.array([a[:n], b[-n:]]), kernels.remap_for("metal", harness.launcher))


@needs_gxx
def test_device_remap_around_a_trace_recorded_mid_run(tiny_moe, harness):
    """Recording a routing trace takes layers off the lazy path for steps 2-3,
    then back: the counts of both kinds of call add up as on the default path."""
    ids = load_tokenizer(tiny_moe).encode(PROMPTS[0])
    assert_same_run(tiny_moe, mx.array(ids)[None], kernels.remap_for("metal", harness.launcher), range(2, 4))


def test_device_counts_keep_per_call_hit_semantics(tiny_moe):
    """A hit is one expert used by one call: summing the calls' uses first
    would count expert 0 once below; both paths count it in each call."""
    model, _ = load_full(tiny_moe)
    mx.eval(model(mx.array([[1, 2, 3]])))  # fills every layer
    base, dev = model.expert_cache.layers
    calls = [mx.array([[0, 0], [1, 0]], mx.uint32), mx.array([[0, 5]], mx.uint32)] * 150  # 300 > 256
    stats = model.expert_cache.snapshot
    start, counts_before = stats(), (base.counts.copy(), dev.counts.copy())
    for ids in calls:
        base.defer_count(ids)
    middle = stats()
    for ids in calls:
        dev.add_device_counts(mk.slot_remap_reference(ids.reshape(-1), dev.lut)[1])
    end = stats()
    assert (middle - start).hits == (end - middle).hits == 150 * (2 + 2)
    assert (end - middle).misses == 0
    uses = dev.counts - counts_before[1]
    assert np.array_equal(base.counts - counts_before[0], uses)
    assert uses[[0, 1, 5]].tolist() == [600, 150, 150] and uses.sum() == 900


@pytest.mark.metal
@pytest.mark.skipif(not mk.metal_available(), reason="needs Apple Metal")
def test_real_remap_kernel_equals_default_path_on_a_mac(tiny_moe):
    ids = load_tokenizer(tiny_moe).encode(PROMPTS[1])
    assert_same_run(tiny_moe, mx.array(ids)[None], kernels.remap_for("metal"))
    model, _ = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=8, kernel="metal"))
    assert all(w.remap is not None for w in wrappers(model))


def test_reading_the_stats_evaluates_every_layers_device_sums_at_once(tiny_moe, monkeypatch):
    """Reading the stats after a step waits for the device once: every layer's
    pending sums (and remembered router outputs) go into one ``mx.eval``, not
    an ``item()`` and an ``np.array`` per layer (2 x L waits)."""
    model, _ = load_full(tiny_moe)
    mx.eval(model(mx.array([[1, 2, 3]])))  # fills every layer
    layers = model.expert_cache.layers
    start = model.expert_cache.snapshot()
    for i, layer in enumerate(layers):  # layer i: expert i used twice, expert 7 once, per call
        for _ in range(3):
            layer.add_device_counts(mk.slot_remap_reference(mx.array([i, i, 7], mx.uint32), layer.lut)[1])
    layers[0].defer_count(mx.array([[4, 5]], mx.uint32))  # a router output on the host path too
    pending = {id(a) for layer in layers for a in layer.deferred_arrays()}
    assert len(pending) == 2 * len(layers) + 1
    real_eval, evals = mx.eval, []

    def spy(*arrays):
        evals.append({id(a) for a in arrays})
        return real_eval(*arrays)

    monkeypatch.setattr(mx, "eval", spy)
    end = model.expert_cache.snapshot()
    assert evals == [pending]  # one evaluation, of all layers' pending arrays
    assert (end - start).hits == len(layers) * 3 * 2 + 2
    assert all(layer.deferred_arrays() == [] for layer in layers)
    model.expert_cache.snapshot()
    assert len(evals) == 1  # nothing left to evaluate: no further wait
