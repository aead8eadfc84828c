"""Cold tier: reading one expert reads only that expert's byte ranges, exactly,
whatever the read method and page-cache setting."""

import errno
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlx_tier import TierConfig
from mlx_tier.engine import store as store_mod
from mlx_tier.engine.checkpoint import index_checkpoint
from mlx_tier.engine.store import ExpertStore, direct_reads_work
from mlx_tier.errors import CheckpointError

# Every valid (read_method, page_cache) pair; mmap with direct is refused.
READ_SETTINGS = [("pread", "keep"), ("pread", "drop"), ("pread", "direct"), ("mmap", "keep"), ("mmap", "drop")]


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(0)
    a = {
        "l0.w": rng.integers(0, 2**32, size=(6, 5, 3), dtype=np.uint32),
        "l0.s": rng.standard_normal((6, 5, 2)).astype(np.float16),
        "other": rng.standard_normal((7,)).astype(np.float32),
    }
    # 6004-byte experts: unaligned starts, ranges across 4 KiB pages, the last
    # expert ending at the end of the file (O_DIRECT's aligned tail passes it).
    b = {
        "l1.w": rng.standard_normal((4, 3, 8)).astype(np.float32),
        "l2.w": rng.integers(0, 255, size=(5, 6004), dtype=np.uint8),
    }
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    return tmp_path, {**a, **b}


def test_reads_exact_slices_and_only_their_bytes(shards):
    path, tensors = shards
    store = ExpertStore(path, threads=3)
    got = store.read_experts(["l0.w", "l0.s"], [4, 0, 5])
    np.testing.assert_array_equal(got["l0.w"], tensors["l0.w"][[4, 0, 5]])
    np.testing.assert_array_equal(got["l0.s"], tensors["l0.s"][[4, 0, 5]])
    assert store.stats.bytes_read == 3 * (5 * 3 * 4 + 5 * 2 * 2)  # never a whole tensor
    got = store.read_experts(["l1.w"], [2])
    np.testing.assert_array_equal(got["l1.w"], tensors["l1.w"][[2]])
    assert store.stats.reads == 3 * 2 + 1
    store.close()


def test_index_spans_shards(shards):
    path, tensors = shards
    index = index_checkpoint(path)
    assert set(index) == set(tensors)
    assert index["l0.w"].shape == (6, 5, 3) and index["l0.w"].dtype == "U32"


def test_bad_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="no .safetensors"):
        ExpertStore(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match="too short"):
        ExpertStore(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((10).to_bytes(8, "little") + b"not json!!")
    with pytest.raises(CheckpointError, match="bad safetensors header"):
        ExpertStore(tmp_path)


def test_truncated_or_unknown_dtype_is_a_clear_error(shards, tmp_path):
    path, _ = shards
    f = path / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-16])  # a truncated download
    with pytest.raises(CheckpointError, match="lies outside the file"):
        index_checkpoint(path)
    import json
    import struct

    header = json.dumps({"x": {"dtype": "F4", "shape": [1], "data_offsets": [0, 1]}}).encode()
    g = tmp_path / "odd"
    g.mkdir()
    (g / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(CheckpointError, match="dtype F4, which mlx-tier cannot read"):
        index_checkpoint(g)


@pytest.mark.parametrize(("method", "page_cache"), READ_SETTINGS)
def test_every_read_setting_returns_the_default_bytes(shards, method, page_cache):
    path, tensors = shards
    names, experts = ["l0.w", "l0.s", "l1.w", "l2.w"], [3, 0, 3, 1]
    with_default = ExpertStore(path)
    want = with_default.read_experts(names, experts)
    store = ExpertStore(path, threads=2, read_method=method, page_cache=page_cache)
    for _ in range(2):  # the second time from open fds, maps and scratch buffers
        got = store.read_experts(names, experts)
        for name in names:
            np.testing.assert_array_equal(got[name], want[name])
            np.testing.assert_array_equal(got[name], tensors[name][experts])
    last = store.read_experts(["l2.w"], [4])  # ends exactly at the end of the shard
    np.testing.assert_array_equal(last["l2.w"], tensors["l2.w"][[4]])
    assert store.stats.bytes_read == 2 * sum(want[n].nbytes for n in names) + 6004
    store.close()
    with_default.close()


@pytest.mark.parametrize(
    ("method", "page_cache", "message"),
    [
        ("aio", "keep", "read_method must be one of pread, mmap; got 'aio'"),
        ("pread", "none", "page_cache must be one of keep, drop, direct; got 'none'"),
        ("mmap", "direct", "needs read_method='pread'"),
    ],
)
def test_bad_read_settings_are_refused(shards, method, page_cache, message):
    path, _ = shards
    with pytest.raises(ValueError, match=message):
        ExpertStore(path, read_method=method, page_cache=page_cache)
    with pytest.raises(ValueError, match=message):
        TierConfig(read_method=method, page_cache=page_cache)


def test_drop_without_posix_fadvise_is_refused(shards, monkeypatch):
    path, _ = shards
    monkeypatch.delattr(store_mod.os, "posix_fadvise")  # as on macOS
    with pytest.raises(ValueError, match="page_cache='drop' needs posix_fadvise"):
        ExpertStore(path, page_cache="drop")
    ExpertStore(path, page_cache="keep").close()


def test_o_direct_refused_by_the_filesystem_is_a_clear_error(shards, monkeypatch):
    path, _ = shards
    real_open = os.open

    def no_direct(file, flags, *args):  # what tmpfs before Linux 6.6 and some FUSE mounts do
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(file, flags, *args)

    monkeypatch.setattr(store_mod.os, "open", no_direct)
    store = ExpertStore(path, page_cache="direct")
    with pytest.raises(CheckpointError, match=r"refuses direct I/O \(O_DIRECT\); use page_cache='keep' or 'drop'"):
        store.read_experts(["l0.w"], [0])
    store.close()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's (macOS has F_NOCACHE)")
def test_direct_reads_work_asks_every_file_with_o_direct(shards, monkeypatch):
    path, _ = shards
    files = sorted(path.glob("*.safetensors"))
    real_open, opened = os.open, []

    def taken(file, flags, *args):  # a filesystem that accepts O_DIRECT (tmp_path's may not)
        opened.append((file, bool(flags & os.O_DIRECT)))
        return real_open(file, flags & ~os.O_DIRECT, *args)

    monkeypatch.setattr(store_mod.os, "open", taken)
    assert direct_reads_work(files) and opened == [(f, True) for f in files]

    def second_refused(file, flags, *args):
        if flags & os.O_DIRECT and file == files[1]:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(file, flags & ~os.O_DIRECT, *args)

    monkeypatch.setattr(store_mod.os, "open", second_refused)
    assert not direct_reads_work(files)
    assert direct_reads_work(files[:1])


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's (macOS's F_NOCACHE store reads anyway)")
def test_direct_reads_work_agrees_with_a_direct_store(shards):
    """Whatever this machine's tmp filesystem does, the probe says what a direct store
    then meets: exact reads, or the refusal at its first read."""
    path, tensors = shards
    store = ExpertStore(path, page_cache="direct")
    try:
        if direct_reads_work(sorted(path.glob("*.safetensors"))):
            assert np.array_equal(store.read_experts(["l2.w"], [4])["l2.w"][0], tensors["l2.w"][4])
        else:
            with pytest.raises(CheckpointError, match="refuses direct I/O"):
                store.read_experts(["l2.w"], [4])
    finally:
        store.close()


def test_no_o_direct_no_direct_reads(shards, monkeypatch):
    monkeypatch.delattr(store_mod.os, "O_DIRECT", raising=False)  # as on macOS
    assert not direct_reads_work(sorted(shards[0].glob("*.safetensors")))


def test_reads_into_caller_buffers_and_refuses_a_wrong_one(shards):
    path, tensors = shards
    store = ExpertStore(path, threads=2)
    out = {"l0.w": np.zeros((4, 5, 3), np.uint32), "l2.w": np.zeros((2, 6004), np.uint8)}
    for experts in ([4, 1], [2]):  # the same buffers again, fewer rows
        got = store.read_experts(["l0.w", "l2.w"], experts, out=out)
        for name, buf in out.items():
            assert np.shares_memory(got[name], buf) and len(got[name]) == len(experts)
            np.testing.assert_array_equal(got[name], tensors[name][experts])
    with pytest.raises(ValueError, match=r"out\['l0.w'\]: need a C-contiguous uint32 array \[>= 2, 5, 3\]"):
        store.read_experts(["l0.w"], [0, 1], out={"l0.w": np.zeros((1, 5, 3), np.uint32)})
    with pytest.raises(ValueError, match="need a C-contiguous uint32"):
        store.read_experts(["l0.w"], [0], out={"l0.w": np.zeros((2, 5, 3), np.float32)})
    with pytest.raises(ValueError, match=r"l2.w: expert 5 out of range \[0, 5\)"):
        store.read_experts(["l2.w"], [5])
    store.close()


def _load_bench(name: str):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benches" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_synthetic_checkpoint_tiers_with_every_read_path(tmp_path, tokenizer_dir):
    """benches/make_synthetic_moe.py at a tiny size: mlx-lm loads it, mlx-tier tiers it,
    and the read settings reach the store without changing a single logit."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    import mlx_tier
    from mlx_tier.engine.load import tier_model

    synth = _load_bench("make_synthetic_moe")
    spec = synth.SyntheticSpec(num_layers=2, hidden_size=64, moe_intermediate_size=64, num_experts=8, top_k=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    path = synth.make_synthetic_moe(tmp_path / "synth", spec, tokenizer_dir=tokenizer_dir, progress=lambda m: None)
    assert len(list(path.glob("model-*.safetensors"))) == 3  # one shard per layer, one dense
    index = index_checkpoint(path)
    assert index["model.layers.1.mlp.switch_mlp.up_proj.weight"].shape == (8, 64, 8)  # [E, out, in * 4 / 32]
    assert index["model.layers.1.mlp.switch_mlp.up_proj.scales"].dtype == "BF16"
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert abs(total - (2 * spec.layer_bytes() + spec.dense_bytes())) < 0.01 * total  # the size model holds
    tokens = mx.array([[1, 5, 9, 200, 7]])
    logits = {}
    mlx_tier.load(path, config=TierConfig(slots_per_layer=2))  # the whole checkpoint, tokenizer included
    for method, page_cache in [("pread", "keep"), ("mmap", "drop"), ("pread", "direct")]:
        model, _ = load_model(path, lazy=True)  # what mlx_tier.load does, without the tokenizer again
        tier_model(model, path, TierConfig(slots_per_layer=2, read_method=method, page_cache=page_cache))
        store = model.expert_cache.store
        assert (store.read_method, store.page_cache) == (method, page_cache)
        logits[method, page_cache] = model(tokens)
        assert model.expert_cache.stats.misses > 0
    first = logits["pread", "keep"]
    for out in logits.values():
        assert mx.array_equal(out, first).item()
