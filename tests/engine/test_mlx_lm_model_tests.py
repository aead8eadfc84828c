"""The drop-in promise, checked with mlx-lm's own model tests.

Every MoE configuration of mlx-lm's ``tests/test_models.py``
(:mod:`support.mlx_lm_models`), saved with mlx-lm's ``save_model`` as float32,
4-bit group 32 (float32 scales) and bf16 with 4-bit weights (bf16 scales), loaded as
``mlx_lm.load`` and ``mlx_tier.load`` load models (the tokenizer aside), at 1,
2 and all slots per layer:

- greedy tokens of ``mlx_tier.load`` equal ``mlx_lm.load``'s of the same
  folder: nothing is cast by default, as mlx-lm casts nothing;
- with ``TierConfig(dtype=...)`` they equal mlx-lm's model cast the same way
  (``cast_model``: what the model's ``cast_predicate`` keeps in float32 stays so);
- mlx-lm's ``model_test_runner`` checks pass on the tiered model as they do on
  mlx-lm's: casts after load reach the cached experts, prompt caches, a batch
  of two, ``copy.deepcopy``.

A representative subset runs by default (the models whose dtype rules or
expert blocks differ most); marked ``slow``, every model once in each test, its kind,
slot count and cast rotating; the whole matrix on demand (``MLX_TIER_FULL_MATRIX=1``).
"""

import itertools
import os

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from support.exactness import PROMPTS, greedy_ids
from support.mlx_lm_models import (
    KINDS,
    MODELS,
    check_like_mlx_lm,
    load_tiered,
    save,
    vocab_size,
)

from mlx_tier import TierConfig
from mlx_tier.engine.checkpoint import model_shape
from mlx_tier.engine.dtypes import cast_model
from mlx_tier.errors import BudgetError, ConfigError

SLOTS = (1, 2, "all")
# Models with parameters mlx-lm keeps in float32 when it casts (their cast_predicate).
KEEPS_FLOAT32 = ("kimi_k3", "deepseek_v41", "kimi_linear", "qwen3_5_moe", "longcat_flash")
FAST_LOAD = {("olmoe", "bf16-q4", 1), ("olmoe", "q4", 2), ("olmoe", "fp32", "all"), ("kimi_linear", "bf16-q4", 2),
             ("gemma4_moe_router_quantizes_to_8bit", "bf16-q4", "all"), ("mixtral", "fp32", 1),
             ("deepseek_v41", "q4", 1)}
# Among them every model whose cached experts used to ignore a cast after load.
FAST_CHECKS = {("gemma4_moe_router_quantizes_to_8bit", "q4", 1), ("dots1", "bf16-q4", 2), ("llama4", "q4", "all"),
               ("kimi_linear", "fp32", 1), ("olmoe", "q4", 2), ("longcat_flash", "q4", 2),
               ("ernie4_5_moe", "bf16-q4", 1), ("kimi_vl", "q4", "all")}


def _cases(fast: set, turn: int = 0) -> list:
    """``fast`` by default; marked slow, every model once, its kind and slot count
    rotating over the models (``turn`` shifts the kind, so two tests see each model
    in two kinds), so every kind and every slot count meets many models. The whole
    product (459 cases a test, about an hour on 2 cores) with ``MLX_TIER_FULL_MATRIX=1``."""
    if os.environ.get("MLX_TIER_FULL_MATRIX") == "1":
        cases = list(itertools.product(sorted(MODELS), KINDS, SLOTS))
    else:
        chosen = {(name, KINDS[(i + turn) % len(KINDS)], SLOTS[(i + 1) % len(SLOTS)])
                  for i, name in enumerate(sorted(MODELS))}
        cases = sorted(chosen | fast, key=str)
    return [pytest.param(*c, marks=() if c in fast else pytest.mark.slow, id="-".join(map(str, c))) for c in cases]


class Checkpoints:
    """Checkpoints of :data:`MODELS` and mlx-lm's greedy tokens on them, each made once."""

    def __init__(self, root, tokenizer_dir):
        self.root, self.tokenizer_dir = root, tokenizer_dir
        self.paths, self.refs = {}, {}

    def path(self, name: str, kind: str, group_size: int = 32):
        if (name, kind, group_size) not in self.paths:
            self.paths[name, kind, group_size] = save(self.root / f"{name}-{kind}-{group_size}", name, kind,
                                                      self.tokenizer_dir, group_size)
        return self.paths[name, kind, group_size]

    def reference(self, name: str, kind: str, dtype=None, group_size: int = 32):
        """mlx-lm's model of the checkpoint, cast to ``dtype`` as ``cast_model`` does (``None``: as loaded)."""
        model, _ = load_model(self.path(name, kind, group_size))
        if dtype is not None:
            cast_model(model, dtype)
        return model

    def tokens(self, name: str, kind: str, dtype=None) -> list[list[int]] | None:
        """mlx-lm's greedy tokens on the prompts; ``None`` where mlx-lm's model
        cannot compute here (unquantized bf16 experts on MLX's CPU backend)."""
        if (name, kind, dtype) not in self.refs:
            try:
                self.refs[name, kind, dtype] = greedy_all(self.reference(name, kind, dtype))
            except RuntimeError:  # "[GatherMM::eval] Currently only supports float32."
                self.refs[name, kind, dtype] = None
        return self.refs[name, kind, dtype]


def parameters(model) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def greedy_all(model) -> list[list[int]]:
    """Greedy tokens of ``model`` on the test prompts (ids folded into its vocabulary)."""
    vocab = vocab_size(model)
    return [greedy_ids(model, [t % vocab for t in p]) for p in PROMPTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("mlx-lm-models"), tokenizer_dir)


def tiered(path, slots, **settings):
    """The tiered model at ``slots`` per layer (``"all"``: every expert)."""
    count = model_shape(path)[1] if slots == "all" else slots
    return load_tiered(path, TierConfig(slots_per_layer=count, **settings))


@pytest.mark.parametrize("name, kind, slots", _cases(FAST_LOAD))
def test_tiered_equals_mlx_lm_load(checkpoints, name, kind, slots):
    """Greedy tokens equal ``mlx_lm.load``'s of the same folder; where mlx-lm cannot
    compute the model here (unquantized bf16 experts on MLX's CPU backend), load
    refuses it, naming the fix."""
    want, path = checkpoints.tokens(name, kind), checkpoints.path(name, kind)
    if want is None:
        with pytest.raises(ConfigError, match="cannot compute.*dtype=mx.float32"):
            load_tiered(path, TierConfig())
        return
    model = tiered(path, slots)
    assert greedy_all(model) == want, (name, kind, slots)
    assert model.expert_cache.stats.misses > 0


# Both casts for every model with MLX_TIER_FULL_MATRIX=1; else one a model, alternating.
CAST_CASES = [c for i, name in enumerate(sorted(MODELS))
              for k, c in enumerate([(name, "q4", mx.bfloat16), (name, "bf16-q4", mx.float32)])
              if os.environ.get("MLX_TIER_FULL_MATRIX") == "1" or k == i % 2]
FAST_CAST = {(name, "q4", mx.bfloat16) for name in KEEPS_FLOAT32} | {("olmoe", "bf16-q4", mx.float32)}
CAST_CASES += sorted(FAST_CAST - set(CAST_CASES), key=str)


@pytest.mark.parametrize("name, kind, dtype", [
    pytest.param(*c, marks=() if c in FAST_CAST else pytest.mark.slow, id=f"{c[0]}-{c[1]}-{str(c[2])[9:]}")
    for c in CAST_CASES])
def test_cast_at_load_equals_mlx_lm_cast(checkpoints, name, kind, dtype):
    """``TierConfig(dtype=...)`` equals mlx-lm's model cast as ``mlx_lm.convert --dtype``
    casts (``cast_model``), parameters the model keeps in float32 included."""
    want, path = checkpoints.tokens(name, kind, dtype), checkpoints.path(name, kind)
    if want is None:  # unquantized experts cast to bf16 on MLX's CPU backend
        with pytest.raises(ConfigError, match="cannot compute"):
            load_tiered(path, TierConfig(dtype=dtype))
        return
    model = tiered(path, 2, dtype=dtype)
    assert greedy_all(model) == want, (name, kind, dtype)
    ref = parameters(checkpoints.reference(name, kind, dtype))
    assert {k: v.dtype for k, v in parameters(model).items()} == {k: v.dtype for k, v in ref.items()}


@pytest.mark.parametrize("name, kind, slots", _cases(FAST_CHECKS, turn=1))
def test_mlx_lm_model_checks(checkpoints, name, kind, slots):
    """mlx-lm's ``model_test_runner`` on the tiered model, beside mlx-lm's model."""
    path = checkpoints.path(name, kind)
    resident = checkpoints.reference(name, kind)
    if checkpoints.tokens(name, kind) is None:
        pytest.skip("MLX cannot compute this model's unquantized experts here (load refuses it)")
    check_like_mlx_lm(tiered(path, slots), resident, name)


def test_olmoe_bf16_4bit_is_mlx_lm_load(checkpoints):
    """The olmoe model of mlx-lm's ``test_all_models``, cast to bf16 and quantized to
    4 bits (group 64), seed 1234: sixteen greedy tokens equal ``mlx_lm.load``'s as
    loaded (bf16), at every cache size; with ``dtype=mx.float32`` (the job's choice
    on the CPU backend) they equal mlx-lm's model cast to float32."""
    path = checkpoints.path("olmoe", "bf16-q4", group_size=64)
    prompt = [0, 1]
    want = [greedy_ids(checkpoints.reference("olmoe", "bf16-q4", group_size=64), prompt, n=16)]
    for slots in SLOTS:
        model = tiered(path, slots)
        assert model.layers[0].self_attn.q_proj.scales.dtype == mx.bfloat16  # nothing cast
        assert [greedy_ids(model, prompt, n=16)] == want, slots
    want32 = [greedy_ids(checkpoints.reference("olmoe", "bf16-q4", mx.float32, group_size=64), prompt, n=16)]
    assert [greedy_ids(tiered(path, 2, dtype=mx.float32), prompt, n=16)] == want32


def test_experts_read_after_casts_go_through_them(checkpoints):
    """Cast after load twice (bf16, then float16): every resident expert, read
    before or after the casts, holds what mlx-lm's resident model holds for it --
    ``f16(bf16(x))``, not ``f16(x)`` -- and the tokens stay equal."""
    path = checkpoints.path("olmoe", "q4")
    model, resident = tiered(path, 2), checkpoints.reference("olmoe", "q4")
    for dtype in (None, mx.bfloat16, mx.float16):
        if dtype is not None:
            model.set_dtype(dtype)
            resident.set_dtype(dtype)
        misses = model.expert_cache.stats.misses
        assert greedy_all(model) == greedy_all(resident), dtype
        assert model.expert_cache.stats.misses > misses  # experts were read after this cast
    stacked = parameters(resident)
    for layer in model.expert_cache.layers:
        for name, t in layer.tensors.items():
            slab = t.module[t.attr]
            for e in layer.resident_experts():
                assert mx.array_equal(slab[int(layer.slot_of[e])], stacked[name][e]).item(), (name, e)
            floating = mx.issubdtype(slab.dtype, mx.floating)
            assert slab.dtype == stacked[name].dtype and t.casts == ((mx.bfloat16, mx.float16) if floating else ())


def test_a_widening_cast_keeps_the_budget(checkpoints):
    """Invariant 2 across a cast after load: a budget given as slots is restated in
    the new dtype; a byte budget too small for the wider slabs refuses the cast."""
    path = checkpoints.path("olmoe", "bf16-q4")
    model = tiered(path, 2)
    before = model.expert_cache.budget_bytes
    model.set_dtype(mx.float32)
    greedy_all(model)
    cache = model.expert_cache
    assert cache.resident_bytes == cache.budget_bytes > before
    tight = load_tiered(path, TierConfig(cache_gb=before * 1.01 / 2**30))  # 2 slots, as bf16
    assert tight.expert_cache.slots_per_layer == 2
    tight.set_dtype(mx.float32)
    with pytest.raises(BudgetError, match="casting the experts to float32 needs"):
        greedy_all(tight)
