"""Checkpoint folders as downloads leave them (:mod:`mlx_tier.engine.checkpoint`).

Invariants: when ``model.safetensors.index.json`` exists it alone decides
which file holds each tensor, for the experts and for the dense part mlx-lm
loads (a stale file beside the shards is never mixed in); without an index a
tensor in two files is refused; every fault of a folder is one line naming
the file, exit code 2 from ``run`` and ``plan``, before any document.
"""

from __future__ import annotations

import json
import shutil
import struct

import mlx.core as mx
import numpy as np
import pytest
from support.checkpoints import make_mixtral
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.engine.checkpoint import (
    INDEX_FILE,
    context_length,
    index_checkpoint,
    open_checkpoint,
)
from mlx_tier.errors import CheckpointError

runner = CliRunner()
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def shard(src, dst):
    """``src`` (one model.safetensors) rewritten as two shards and an index, in ``dst``."""
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {SHARDS[0]: names[: len(names) // 2], SHARDS[1]: names[len(names) // 2 :]}
    for file, part in halves.items():
        mx.save_safetensors(str(dst / file), {n: weights[n] for n in part}, metadata={"format": "mlx"})
    weight_map = {n: f for f, part in halves.items() for n in part}
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.fixture(scope="module")
def sharded(tiny_moe, tmp_path_factory):
    return shard(tiny_moe, tmp_path_factory.mktemp("sharded") / "moe")


def cli(*args):
    result = runner.invoke(app, [*map(str, args)])
    return result.exit_code, [line for line in result.output.splitlines() if line.strip()]


def run_and_plan_fail(model, tmp_path, needle):
    """``run`` and ``plan`` both exit 2 with one error line holding ``needle``; no output written."""
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    (docs / "a.txt").write_text("A short document about rivers.")
    out = tmp_path / "out"
    for args in (("run", docs, "--out", out, "--model", model), ("plan", model, "--disk-gbps", 1, "--compute-gbps", 1)):
        code, lines = cli(*args)
        errors = [line for line in lines if line.startswith("error:")]
        assert code == 2 and len(errors) == 1, (args[0], lines)
        assert needle in errors[0], (args[0], errors[0])
        # the error (and the "loading" line, wrapped or not); the kernel's one-time compilation may
        # come first, whichever test of a process meets it
        rest = " ".join(line.strip() for line in lines if not line.startswith(("error:", "compiling the CPU kernel")))
        assert rest in ("", f"loading {model}"), lines
    assert not list(out.glob("*.md"))
    return errors[0]


def logits(model, tokens=(5, 17, 300, 41, 9)):
    return np.array(model(mx.array(tokens)[None]).astype(mx.float32))


def test_index_decides_over_a_stale_file_for_experts_and_dense_part(sharded, tiny_moe, tmp_path, tokenizer_dir):
    import mlx_lm

    import mlx_tier

    folder = shutil.copytree(sharded, tmp_path / "mixed")
    stale = make_mixtral(tmp_path / "stale", tokenizer_dir, quantized=True, seed=7)
    shutil.copy(stale / "model.safetensors", folder / "model.safetensors")  # an older download left behind
    index = index_checkpoint(folder)
    assert {i.file.name for i in index.values()} == set(SHARDS)
    dense, expert = "model.embed_tokens.weight", "model.layers.0.block_sparse_moe.switch_mlp.up_proj.weight"
    assert index[expert].file.name == json.loads((folder / INDEX_FILE).read_text())["weight_map"][expert]

    model, _ = mlx_tier.load(folder, config=mlx_tier.TierConfig(slots_per_layer=2, dtype=mx.float32))
    reference, _ = mlx_lm.load(str(tiny_moe))  # the same weights, one file, no stale neighbour
    reference.set_dtype(mx.float32)
    assert mx.array_equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    stale_embed = mx.load(str(stale / "model.safetensors"))[dense]
    assert not mx.array_equal(model.model.embed_tokens.weight, stale_embed)
    np.testing.assert_allclose(logits(model), logits(reference), rtol=1e-5, atol=1e-5)


def test_a_single_file_not_named_model_is_used(tiny_moe, tmp_path):
    """mlx-lm globs model*.safetensors only: the resolved file is handed to it under that name."""
    import mlx_lm

    import mlx_tier

    folder = shutil.copytree(tiny_moe, tmp_path / "renamed")
    (folder / INDEX_FILE).unlink()
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    model, _ = mlx_tier.load(folder, config=mlx_tier.TierConfig(slots_per_layer=8, dtype=mx.float32))
    reference, _ = mlx_lm.load(str(tiny_moe))
    reference.set_dtype(mx.float32)
    np.testing.assert_allclose(logits(model), logits(reference), rtol=1e-5, atol=1e-5)


def test_a_tensor_in_two_files_without_index_is_refused_naming_both(sharded, tmp_path):
    folder = shutil.copytree(sharded, tmp_path / "twice")
    (folder / INDEX_FILE).unlink()
    first = mx.load(str(folder / SHARDS[0]))
    name = sorted(first)[0]
    mx.save_safetensors(str(folder / "extra.safetensors"), {name: first[name]})
    with pytest.raises(CheckpointError, match=f"'{name}' is in both extra.safetensors and {SHARDS[0]}"):
        index_checkpoint(folder)
    run_and_plan_fail(folder, tmp_path, f"is in both extra.safetensors and {SHARDS[0]}")


def test_a_tensor_in_two_indexed_shards_is_refused(sharded, tmp_path):
    folder = shutil.copytree(sharded, tmp_path / "dup")
    second = mx.load(str(folder / SHARDS[1]))
    first = dict(mx.load(str(folder / SHARDS[0])))
    name = sorted(second)[0]
    mx.save_safetensors(str(folder / SHARDS[0]), {**first, name: second[name]})
    with pytest.raises(CheckpointError, match=f"'{name}' is in both {SHARDS[0]} and {SHARDS[1]}"):
        index_checkpoint(folder)


def test_a_shard_named_by_the_index_but_missing(sharded, tmp_path):
    folder = shutil.copytree(sharded, tmp_path / "missing")
    (folder / SHARDS[1]).unlink()
    with pytest.raises(CheckpointError, match=f"{SHARDS[1]}: missing, but {INDEX_FILE} names it"):
        open_checkpoint(folder)
    line = run_and_plan_fail(folder, tmp_path, f"{SHARDS[1]}: missing")
    assert "parameters not in model" not in line


def test_an_index_that_is_not_json(sharded, tmp_path):
    folder = shutil.copytree(sharded, tmp_path / "badindex")
    (folder / INDEX_FILE).write_text("{ not json")
    run_and_plan_fail(folder, tmp_path, f"{INDEX_FILE}: not a readable safetensors index")


def test_an_index_naming_a_file_outside_the_folder(sharded, tmp_path):
    folder = shutil.copytree(sharded, tmp_path / "outside")
    data = json.loads((folder / INDEX_FILE).read_text())
    data["weight_map"][next(iter(data["weight_map"]))] = "../" + SHARDS[0]
    (folder / INDEX_FILE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"names '../{SHARDS[0]}', which is not a file in the checkpoint"):
        index_checkpoint(folder)


def test_an_index_placing_a_tensor_in_a_file_that_lacks_it(sharded, tmp_path):
    folder = shutil.copytree(sharded, tmp_path / "wrongplace")
    data = json.loads((folder / INDEX_FILE).read_text())
    name = next(n for n, f in data["weight_map"].items() if f == SHARDS[1])
    data["weight_map"][name] = SHARDS[0]
    (folder / INDEX_FILE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"{SHARDS[0]}: holds no tensor '{name}'"):
        index_checkpoint(folder)


def _header_len(path):
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.mark.parametrize("fault, needle", [
    ("truncated", "lies outside the file (truncated download?)"),
    ("header_cut", "header runs past the end of the file"),
    ("corrupt_header", "bad safetensors header"),
    ("offsets_past_end", "lies outside the file"),
    ("empty", "not a safetensors file (too short)"),
])
def test_a_damaged_shard_fails_before_any_document(sharded, tmp_path, fault, needle):
    folder = shutil.copytree(sharded, tmp_path / fault)
    f = folder / SHARDS[1]
    data = f.read_bytes()
    n = _header_len(f)
    if fault == "truncated":
        f.write_bytes(data[: len(data) - 100])
    elif fault == "header_cut":
        f.write_bytes(data[: 8 + n // 2])
    elif fault == "corrupt_header":
        f.write_bytes(data[:8] + b"#" * n + data[8 + n :])
    elif fault == "offsets_past_end":
        header = json.loads(data[8 : 8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 10**9
        raw = json.dumps(header).encode()
        f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    else:
        f.write_bytes(b"")
    with pytest.raises(CheckpointError, match=SHARDS[1]):
        index_checkpoint(folder)
    line = run_and_plan_fail(folder, tmp_path, needle)
    assert SHARDS[1] in line


def test_a_dense_checkpoint_is_one_line(tiny_dense, tmp_path):
    run_and_plan_fail(tiny_dense, tmp_path, "not a Mixture-of-Experts checkpoint (model type 'llama'")


def test_a_folder_with_only_config(tiny_moe, tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    shutil.copy(tiny_moe / "config.json", folder / "config.json")
    run_and_plan_fail(folder, tmp_path, "no .safetensors files")


def test_a_folder_without_config(tiny_moe, tmp_path):
    folder = shutil.copytree(tiny_moe, tmp_path / "noconfig")
    (folder / "config.json").unlink()
    run_and_plan_fail(folder, tmp_path, "no config.json")


def test_a_file_given_as_the_model_is_said_to_be_a_file(tmp_path):
    """A user trial: `plan afile` said "no config.json" for a plain file."""
    (tmp_path / "afile").write_text("x")
    run_and_plan_fail(tmp_path / "afile", tmp_path, "afile: is a file, not a folder")


def _with_config(src, dst, **changes):
    folder = shutil.copytree(src, dst)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def test_an_unknown_model_type_is_one_line(tiny_moe, tmp_path):
    folder = _with_config(tiny_moe, tmp_path / "unknown", model_type="frobnicator")
    run_and_plan_fail(folder, tmp_path, "model type 'frobnicator' is not supported by mlx-lm")


def test_moe_weights_under_a_dense_model_type_are_one_line(tiny_moe, tmp_path):
    folder = _with_config(tiny_moe, tmp_path / "asllama", model_type="llama")
    line = run_and_plan_fail(folder, tmp_path, "the weights do not fit a 'llama' model")
    assert len(line) < 400


def test_a_config_that_is_not_json(tiny_moe, tmp_path):
    folder = shutil.copytree(tiny_moe, tmp_path / "badconfig")
    (folder / "config.json").write_text("{ nope")
    run_and_plan_fail(folder, tmp_path, "config.json: not readable JSON")


def test_context_length_from_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "seq_length": 10}))
    assert context_length(tmp_path) == 8192
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 1024}))
    assert context_length(tmp_path, 4096) == 1024
    (tmp_path / "config.json").write_text("{}")
    assert context_length(tmp_path, 4096) == 4096


def test_open_checkpoint_finds_blocks_and_experts(sharded):
    ckpt = open_checkpoint(sharded)
    experts = ckpt.experts()
    assert [p for p, _, _ in experts] == ["model.layers.0.block_sparse_moe.switch_mlp",
                                         "model.layers.1.block_sparse_moe.switch_mlp"]
    assert {n for _, n, _ in experts} == {8}
    assert all(t.info.shape[0] == 8 for _, _, ts in experts for t in ts.values())


def test_a_half_download_beside_an_old_shard_is_refused_naming_both(sharded, tmp_path):
    """A new download's first shard (of 2) beside an old checkpoint's last shard (of 3) that
    happens to hold exactly the missing tensors: two checkpoints, never one model."""
    folder = shutil.copytree(sharded, tmp_path / "mixed")
    (folder / INDEX_FILE).unlink()
    (folder / SHARDS[1]).rename(folder / "model-00003-of-00003.safetensors")
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors and model-00003-of-00003"
                                              ".safetensors belong to two different checkpoints"):
        index_checkpoint(folder)
    run_and_plan_fail(folder, tmp_path, "belong to two different checkpoints")


def test_a_single_file_checkpoint_beside_shards_is_two_checkpoints(sharded, tmp_path):
    folder = shutil.copytree(sharded, tmp_path / "both")
    (folder / INDEX_FILE).unlink()
    (folder / SHARDS[1]).rename(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="belong to two different checkpoints"):
        index_checkpoint(folder)


def test_a_missing_shard_is_named(sharded, tmp_path):
    folder = shutil.copytree(sharded, tmp_path / "half")
    (folder / INDEX_FILE).unlink()
    (folder / SHARDS[1]).unlink()
    with pytest.raises(CheckpointError, match=f"{SHARDS[1]}: missing; the checkpoint is incomplete"):
        index_checkpoint(folder)
    run_and_plan_fail(folder, tmp_path, f"{SHARDS[1]}: missing")
