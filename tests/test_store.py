"""Cold tier: reading one expert reads only that expert's byte ranges, exactly."""

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlx_tier.store import CheckpointError, ExpertStore, index_checkpoint


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(0)
    a = {
        "l0.w": rng.integers(0, 2**32, size=(6, 5, 3), dtype=np.uint32),
        "l0.s": rng.standard_normal((6, 5, 2)).astype(np.float16),
        "other": rng.standard_normal((7,)).astype(np.float32),
    }
    b = {"l1.w": rng.standard_normal((4, 3, 8)).astype(np.float32)}
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
