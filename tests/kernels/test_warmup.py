"""The CPU kernel compiled ahead in a child process: the formats read from a checkpoint's
config, the marker that spares later runs the child, a failed child that loses nothing,
and (slow) a run after the child compiles nothing of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mlx_tier.kernels import warmup

Q4 = {"bits": 4, "group_size": 64, "mode": "affine"}


def test_formats_of_a_uniform_checkpoint():
    assert warmup.formats({"quantization": {"group_size": 64, "bits": 4}}) == [Q4]
    assert warmup.formats({"quantization_config": {"group_size": 64, "bits": 4, "mode": "affine"}}) == [Q4]


def test_formats_of_a_mixed_checkpoint_list_each_once():
    config = {"quantization": {"group_size": 64, "bits": 4,
                               "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
                               "model.layers.1.mlp.gate": {"group_size": 64, "bits": 8},
                               "lm_head": {"bits": 6},  # the group size inherited from the top level
                               "model.embed_tokens": False}}
    assert warmup.formats(config) == sorted(
        [Q4, {**Q4, "bits": 8}, {**Q4, "bits": 6}], key=lambda f: json.dumps(f, sort_keys=True))


def test_formats_skip_what_the_cpu_kernel_does_not_compute():
    assert warmup.formats({}) == []  # float weights: BLAS, nothing to compile
    assert warmup.formats({"quantization": {"group_size": 16, "bits": 4, "mode": "nvfp4"}}) == []
    mx = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert warmup.formats({"quantization": mx}) == [mx]


class Child:
    """Stands in for subprocess.run: records the calls, answers ``returncode``."""

    def __init__(self, returncode: int = 0, stderr: str = ""):
        self.calls, self.returncode, self.stderr = [], returncode, stderr

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        return subprocess.CompletedProcess(cmd, self.returncode, "", self.stderr)


def test_the_child_runs_once_per_key(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_TIER_CACHE", str(tmp_path))
    child, lines = Child(), []
    monkeypatch.setattr(warmup.subprocess, "run", child)
    assert warmup.ensure_compiled([Q4], lines.append)
    assert warmup.ensure_compiled([Q4], lines.append)
    assert len(child.calls) == 1 and child.calls[0][1:3] == ["-m", "mlx_tier.kernels.warmup"]
    assert json.loads(child.calls[0][3]) == [Q4]
    assert len(lines) == 1 and "compiling the CPU kernel" in lines[0]
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "elsewhere"))  # another Numba cache: compiled again
    assert warmup.ensure_compiled([Q4], lines.append)
    assert warmup.ensure_compiled([{**Q4, "bits": 8}], lines.append)  # another format: compiled again
    assert len(child.calls) == 3
    assert warmup.ensure_compiled([], lines.append) and len(child.calls) == 3  # nothing to compile


def test_a_cache_removed_after_the_child_runs_it_again(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_TIER_CACHE", str(tmp_path))
    child = Child()
    monkeypatch.setattr(warmup.subprocess, "run", child)
    monkeypatch.setattr(warmup, "_cache_stamps", lambda: [["cpu._qmv4-183.py311.nbi", 4096, 1]])
    assert warmup.ensure_compiled([Q4]) and warmup.ensure_compiled([Q4])
    assert len(child.calls) == 1
    monkeypatch.setattr(warmup, "_cache_stamps", lambda: [])  # the cache folder emptied
    assert warmup.ensure_compiled([Q4])
    assert len(child.calls) == 2



def test_a_failed_child_is_said_and_retried_next_run(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_TIER_CACHE", str(tmp_path))
    child, lines = Child(1, "Traceback ...\nMemoryError"), []
    monkeypatch.setattr(warmup.subprocess, "run", child)
    assert not warmup.ensure_compiled([Q4], lines.append)
    assert lines[-1].endswith("(MemoryError); it compiles during the run")
    assert not warmup.ensure_compiled([Q4], lines.append)
    assert len(child.calls) == 2  # no marker left by a failure


def test_compile_for_asks_only_where_the_cpu_kernel_runs(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(warmup, "ensure_compiled", lambda fmts, say: asked.append(fmts))
    (tmp_path / "config.json").write_text(json.dumps({"quantization": {"group_size": 32, "bits": 4}}))
    warmup.compile_for(tmp_path, "cpu")
    warmup.compile_for(tmp_path, "mlx")  # MLX's own ops: nothing of ours to compile
    assert asked == [[{"bits": 4, "group_size": 32, "mode": "affine"}]]
    (tmp_path / "config.json").write_text("{not json")
    warmup.compile_for(tmp_path, "cpu")  # left for the load to report
    warmup.compile_for(tmp_path / "missing", "cpu")
    assert len(asked) == 1


def test_plan_and_run_compile_before_they_probe_or_load(monkeypatch, tiny_moe, tmp_path):
    from typer.testing import CliRunner

    from mlx_tier.cli.main import app
    from mlx_tier.engine import load as engine_load

    events = []
    monkeypatch.setattr(warmup, "ensure_compiled", lambda fmts, say: events.append(("compile", fmts)))
    real_load = engine_load.load
    monkeypatch.setattr(engine_load, "load", lambda *a, **k: (events.append(("load",)), real_load(*a, **k))[1])
    runner = CliRunner()
    r = runner.invoke(app, ["plan", str(tiny_moe), "--json", "--disk-gbps", "1"])
    assert r.exit_code == 0, r.output
    assert events == [("compile", warmup.formats(json.loads((tiny_moe / "config.json").read_text())))]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The river floods every spring and the farmers plant after it recedes.")
    r = runner.invoke(app, ["run", str(docs), "--out", str(tmp_path / "out"), "--model", str(tiny_moe),
                            "--max-tokens", "2", "--kernel", "cpu"])
    assert r.exit_code == 0, r.output
    assert [e[0] for e in events[1:]] == ["compile", "load"]


@pytest.mark.slow
def test_a_run_after_the_child_compiles_nothing(tiny_moe, tmp_path):
    """Numba's cache in a fresh folder (a fresh install): the child compiles for the
    checkpoint's formats, then a job in a new process (its own child skipped by the
    marker) loads every kernel function it calls from the cache."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "MLX_TIER_CACHE": str(tmp_path / "cache")}
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"d{i}.txt").write_text(f"Document {i}: the river floods every spring. " * (4 + 6 * i))
    script = textwrap.dedent(f"""
        import json, sys
        from mlx_tier.kernels import warmup
        fmts = warmup.formats(json.load(open({str(tiny_moe / "config.json")!r})))
        assert fmts and warmup.ensure_compiled(fmts, print), fmts
        from numba.core.registry import CPUDispatcher
        from mlx_tier.cli.main import app
        try:
            app(["run", {str(docs)!r}, "--out", {str(tmp_path / "out")!r}, "--model", {str(tiny_moe)!r},
                 "--max-tokens", "6", "--kernel", "cpu"])
        except SystemExit as e:
            assert e.code in (0, None), e.code
        from mlx_tier.kernels import cpu, cpu_vnni
        misses = {{f"{{m.__name__}}.{{n}}": len(d.stats.cache_misses) for m in (cpu, cpu_vnni)
                  for n, d in vars(m).items() if isinstance(d, CPUDispatcher) and d.stats.cache_misses}}
        hits = sum(len(d.stats.cache_hits) for m in (cpu, cpu_vnni) for d in vars(m).values()
                   if isinstance(d, CPUDispatcher))
        print("RESULT", json.dumps({{"misses": misses, "hits": hits}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiling the CPU kernel" in done.stdout
    assert "loading" in done.stderr and "compiling the CPU kernel" not in done.stderr  # the marker found
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["hits"] > 0  # the run called the kernel, from the cache
    assert result["misses"] == {}, result
    assert json.loads((tmp_path / "out" / "report.json").read_text())["totals"]["done"] == 3
