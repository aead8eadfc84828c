"""Models by name: a Hugging Face repo id resolves to the local hub cache first, never
downloads while ``HF_HUB_OFFLINE`` is set (one clear error line instead), and
``plan`` answers from the repo's config and safetensors headers before anything
large is downloaded — the same worksheet as from the files themselves.

No network: the hub cache is built in ``tmp_path`` (its real layout,
``models--org--name/snapshots/<rev>/`` + ``refs/main``), and the remote
metadata path runs against a fake of ``huggingface_hub``'s two calls.
"""

from __future__ import annotations

import json
import shutil

import pytest
from huggingface_hub.utils import (
    SafetensorsFileMetadata,
    SafetensorsRepoMetadata,
    TensorInfo,
)
from typer.testing import CliRunner

import mlx_tier
from mlx_tier.cli.main import app
from mlx_tier.engine.checkpoint import read_header
from mlx_tier.engine.hub import is_repo_id, resolve_model
from mlx_tier.errors import CheckpointError
from mlx_tier.tools.plan import make_plan

runner = CliRunner()
REPO = "tiny-org/tiny-moe-4bit"
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_moe):
    """A hub cache holding REPO (the tiny MoE) and nothing else, offline."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    shutil.copytree(tiny_moe, repo / "snapshots" / REV)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def error_lines(output):
    return [line for line in output.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("name, expected", [
    ("mlx-community/Qwen3-30B-A3B-4bit", True),
    ("allenai/OLMoE-1B-7B-0924", True),
    ("org/name/extra", False),
    ("/abs/path", False),
    ("./org/name", False),
    ("plain-folder", False),
])
def test_repo_id_shape(name, expected):
    assert is_repo_id(name) is expected


def test_repo_id_resolves_from_the_local_cache_offline(hub_cache):
    path = resolve_model(REPO)
    assert path == hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / REV
    model, tokenizer = mlx_tier.load(REPO, cache_gb=0.001)  # mlx_tier.load takes the id too
    assert model.expert_cache.num_experts == 8 and tokenizer.encode("hello")


def test_offline_and_absent_is_one_clear_line(hub_cache, tmp_path):
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        resolve_model("mlx-community/Qwen3-30B-A3B-4bit")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Some text.")
    out = tmp_path / "out"
    for args in (["run", str(docs), "--out", str(out), "--model", "mlx-community/Qwen3-30B-A3B-4bit"],
                 ["plan", "mlx-community/Qwen3-30B-A3B-4bit"],
                 ["convert", "mlx-community/Qwen3-30B-A3B-4bit", str(tmp_path / "converted")]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, r.output
        lines = error_lines(r.output)
        assert len(lines) == 1 and "HF_HUB_OFFLINE is set" in lines[0], r.output
    assert not out.exists()  # a run that never started leaves no folder
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", "no/such/folder"])
    assert r.exit_code == 2 and "model folder not found (nor a Hugging Face repo id" in error_lines(r.output)[0]


def test_plan_takes_a_cached_repo_id(hub_cache):
    r = runner.invoke(app, ["plan", REPO, "--json", "--disk-gbps", "1", "--compute-gbps", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["source"] == "local" and json.loads(r.stdout)["experts_per_layer"] == 8


class FakeHub:
    """``huggingface_hub``'s two calls that ``plan`` makes for a repo not downloaded:
    answered from a local checkpoint's files, recording what was asked."""

    def __init__(self, checkpoint, tmp_path):
        self.checkpoint, self.tmp_path, self.calls = checkpoint, tmp_path, []

    def hf_hub_download(self, repo_id, filename, cache_dir=None):
        self.calls.append(("download", repo_id, filename))
        assert filename == "config.json"  # nothing else is downloaded
        dest = self.tmp_path / "fetched-config.json"
        shutil.copy(self.checkpoint / filename, dest)
        return str(dest)

    def get_safetensors_metadata(self, repo_id):
        self.calls.append(("headers", repo_id))
        files = {}
        for shard in sorted(self.checkpoint.glob("*.safetensors")):
            tensors = {}
            for name, info in read_header(shard).items():
                tensors[name] = TensorInfo(dtype=info.dtype, shape=list(info.shape),
                                           data_offsets=(info.start, info.start + info.nbytes))
            files[shard.name] = SafetensorsFileMetadata(metadata={}, tensors=tensors)
        weight_map = {t: f for f, m in files.items() for t in m.tensors}
        return SafetensorsRepoMetadata(metadata=None, sharded=len(files) > 1, weight_map=weight_map,
                                       files_metadata=files)


@pytest.mark.parametrize("which", ["tiny_moe", "tiny_moe_fp"])
def test_plan_before_download_equals_plan_from_files(which, request, tmp_path, monkeypatch):
    import huggingface_hub

    checkpoint = request.getfixturevalue(which)
    fake = FakeHub(checkpoint, tmp_path)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", fake.get_safetensors_metadata)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    bandwidths = dict(memory_gb=4, disk_gbps=2.0, compute_gbps=1.0)
    remote = make_plan("some-org/not-downloaded", **bandwidths).as_dict()
    local = make_plan(checkpoint, **bandwidths).as_dict()
    assert ("headers", "some-org/not-downloaded") in fake.calls
    assert remote.pop("source") == "hub" and local.pop("source") == "local"
    for key in ("model", "memory_available", "memory_total"):
        remote.pop(key), local.pop(key)
    assert remote == local


def test_plan_offline_for_an_uncached_repo_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="its headers cannot be read"):
        make_plan("some-org/not-downloaded", disk_gbps=1, compute_gbps=1)


def test_scratch_disk_probe_measures_something(tmp_path):
    from mlx_tier.tools.plan import measure_scratch_disk_gbps

    assert measure_scratch_disk_gbps(tmp_path, total_mb=8) > 0
    assert not list(tmp_path.iterdir())  # the scratch file is gone


@pytest.mark.parametrize("files, complete", [
    (["config.json"], False),  # a remote plan fetched only the config
    (["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"], False),  # interrupted
    (["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
      "model-00002-of-00002.safetensors"], True),
    (["config.json", "model.safetensors"], True),  # unsharded
])
def test_cached_snapshot_counts_only_complete_weights(files, complete, tmp_path, monkeypatch):
    from mlx_tier.engine.hub import cached_snapshot

    snap = tmp_path / "hub" / "models--org--sharded" / "snapshots" / REV
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(REV)
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                            "b.weight": "model-00002-of-00002.safetensors"}}
    for name in files:
        (snap / name).write_text(json.dumps(index) if name.endswith("index.json") else "{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cached_snapshot("org/sharded") == (snap if complete else None)


def test_an_unreachable_hub_is_one_line_not_a_page_of_retries(tmp_path, monkeypatch, caplog):
    """A user trial: `plan some/repo` with no network printed eleven lines of the hub's
    retries ("Retrying in 8s [Retry 4/5]") before its error. The retries' warnings are
    off while the hub is asked, and a network failure is said in words, on one line."""
    import logging

    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(repo_id, filename, cache_dir=None):
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub and we cannot "
                                      "find the requested files in the local cache.\nPlease check your connection")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    caplog.set_level(logging.WARNING)
    with pytest.raises(CheckpointError) as e:
        make_plan("some-org/not-downloaded", disk_gbps=1, compute_gbps=1)
    assert str(e.value) == ("some-org/not-downloaded: cannot read its config and safetensors headers from the hub: "
                            "the hub cannot be reached (offline? set HF_HUB_OFFLINE=1 to use the local cache only)")
    assert "Retrying" not in caplog.text
    r = runner.invoke(app, ["plan", "some-org/not-downloaded"])
    assert r.exit_code == 2 and len(error_lines(r.output)) == 1, r.output
    assert "reading its config and safetensors headers from the Hugging Face hub" in " ".join(r.output.split())
