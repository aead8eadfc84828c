"""Under a real memory limit: a model twice the size of the limit runs with default
settings to the end, its peak resident set stays under the limit, nobody is OOM-killed,
and `plan` run inside the limit reports the limit (not the host's memory). The run is a
fresh install's first (Numba's cache empty): the CPU kernel's compile stays out of it.

A child memory cgroup of this process's own is made for it (root, a writable cgroup
file system; else the test is skipped with the reason). The model is the synthetic
qwen3_moe of benches/make_synthetic_moe.py at 2 GiB (12 layers x 128 experts of
1.3 MiB, top-8), under a 1 GiB limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.cgroups import MemoryCgroup, why_not

GIB = 2**30
LIMIT = 1 * GIB
BENCHES = Path(__file__).resolve().parents[2] / "benches"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_not() is not None, reason=str(why_not()))]
WORDS = ("The river floods every spring and the farmers plant after it recedes; the town keeps records of "
         "each flood, and the oldest stone on the bridge carries the marks of the highest waters.").split()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """The 2 GiB synthetic checkpoint: the user's own build when there is one, else built here."""
    sys.path.insert(0, str(BENCHES))
    try:
        from make_synthetic_moe import SyntheticSpec, ensure_synthetic
    finally:
        sys.path.remove(str(BENCHES))
    spec = SyntheticSpec(num_layers=12, hidden_size=1024, moe_intermediate_size=768)
    own = os.environ.get("MLX_TIER_TEST_SYNTHETIC")  # a folder built with the spec above, reused read-only
    if own and (Path(own) / "tokenizer.json").is_file():
        return Path(own)
    return ensure_synthetic(tmp_path_factory.mktemp("synthetic") / "model", spec, progress=lambda line: None)


def mlx_tier(group: MemoryCgroup, *args: str, env: dict | None = None, timeout: int = 1200
             ) -> subprocess.CompletedProcess:
    cmd = group.wrap([sys.executable, "-m", "mlx_tier.cli.main", *args])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_a_model_twice_the_limit_runs_inside_it_with_default_settings(synthetic, tmp_path):
    size = sum(f.stat().st_size for f in synthetic.glob("*.safetensors"))
    assert size > 1.8 * LIMIT
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(2):
        (docs / f"doc{i}.txt").write_text(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(160)) + ".")
    with MemoryCgroup(LIMIT, f"mlx-tier-test-{os.getpid()}") as group:
        plan = mlx_tier(group, "plan", str(synthetic), "--json", "--disk-gbps", "1", "--compute-gbps", "1")
        assert plan.returncode == 0, plan.stderr
        p = json.loads(plan.stdout[plan.stdout.index("{"):])
        assert p["memory_source"] == group.limit_file and p["memory_total"] == LIMIT
        assert p["memory_split"] is not None and p["memory_split"]["total"] <= LIMIT
        out = tmp_path / "out"
        fresh = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}  # a fresh install's first run
        run = mlx_tier(group, "run", str(docs), "--out", str(out), "--model", str(synthetic), "--max-tokens", "4",
                       env=fresh)
        assert group.oom_kills() == 0, run.stderr
    assert run.returncode == 0, run.stderr
    assert "compiling the CPU kernel" in run.stderr  # in a child process, before the model is loaded
    assert f"({group.limit_file})" in run.stderr  # the run header names the limit it lives under
    report = json.loads((out / "report.json").read_text())
    assert report["totals"]["done"] == 2
    from mlx_tier.engine.store import direct_reads_work

    direct = direct_reads_work(sorted(synthetic.glob("*.safetensors")))  # the experts exceed the limit
    assert report["page_cache"] == ("direct" if direct else "keep")
    assert ("reads: around the page cache (O_DIRECT)" in run.stderr) == direct
    budget = report["memory_budget"]
    assert budget["source"] == group.limit_file and budget["total"] <= LIMIT
    assert budget["peak_rss"] <= LIMIT - budget["margin"] // 2, budget  # inside the limit, with most of the margin
