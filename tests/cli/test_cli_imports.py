"""The CLI's modules import one way: ``main`` registers the command modules, which take
shared helpers from ``render`` and ``exits`` and never import ``main`` back (no cycle,
imports inside functions included). Loading the CLI, its help and the read-only
commands (``status``, ``thermal``) do not load MLX, so they answer at once beside a
running job; the help lists come from the library's registries.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

CLI = Path(__file__).resolve().parents[2] / "mlx_tier" / "cli"


def cli_import_graph(folder: Path) -> dict[str, set[str]]:
    """``mlx_tier.cli.X`` -> the ``mlx_tier.cli`` modules it imports anywhere in its source."""
    modules = {f"mlx_tier.cli.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for mod, path in modules.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[mod] = {n for n in names if n in modules and n != mod}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path (first module repeated at the end), or ``None``."""
    done: set[str] = set()

    def visit(mod: str, path: list[str]) -> list[str] | None:
        if mod in path:
            return path[path.index(mod):] + [mod]
        if mod in done:
            return None
        for dep in sorted(graph[mod]):
            found = visit(dep, path + [mod])
            if found:
                return found
        done.add(mod)
        return None

    return next((c for c in (visit(m, []) for m in sorted(graph)) if c), None)


def test_cli_modules_import_without_a_cycle_and_none_imports_main():
    graph = cli_import_graph(CLI)
    assert cycle(graph) is None, cycle(graph)
    assert [m for m, deps in graph.items() if "mlx_tier.cli.main" in deps] == []
    assert graph["mlx_tier.cli.render"] == set()  # the bottom: everything may print


def test_a_planted_cycle_is_found(tmp_path):
    for name, text in {"main": "from mlx_tier.cli import run_cmd\n",
                       "run_cmd": "def f():\n    from mlx_tier.cli.main import app\n"}.items():
        (tmp_path / f"{name}.py").write_text(text)
    assert cycle(cli_import_graph(tmp_path)) == ["mlx_tier.cli.main", "mlx_tier.cli.run_cmd", "mlx_tier.cli.main"]


def test_help_status_and_thermal_do_not_load_mlx(tmp_path):
    from mlx_tier.outdir.journal import JobInfo, Journal

    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input="docs", ids=["a"], todo=["a"], started=1.0, pid=1, command="mlx-tier run docs --out out").write(
        Journal(out))
    script = f"""
import json, sys
from typer.testing import CliRunner
from mlx_tier.cli.main import app
codes = [CliRunner().invoke(app, args).exit_code for args in
         (["--help"], ["run", "--help"], ["status", {str(out)!r}], ["status", "--json", {str(out)!r}],
          ["thermal", "--json"])]
print(json.dumps({{"codes": codes, "mlx": sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm"))}}))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.splitlines()[-1])
    assert seen == {"codes": [0, 0, 0, 0, 0], "mlx": []}


def test_choices_in_help_come_from_the_library():
    from typer.testing import CliRunner

    from mlx_tier.cli.main import app
    from mlx_tier.job.doc_text import CONVERTED_SUFFIXES, TEXT_SUFFIXES
    from mlx_tier.kernels import KERNELS
    from mlx_tier.outdir.layout import OUTPUT_FORMATS
    from mlx_tier.policy.eviction import OFFLINE_POLICIES, POLICIES
    from mlx_tier.tools import QUANT_BITS, QUANT_MODES

    def help_of(command: str) -> str:
        r = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
        assert r.exit_code == 0, r.output
        return " ".join(r.output.split())

    run = help_of("run")
    assert f"--policy [{'|'.join(POLICIES)}]" in run and f"--kernel [{'|'.join(KERNELS)}]" in run
    assert f"--format [{'|'.join(OUTPUT_FORMATS)}]" in run
    assert all(s in run for s in (*TEXT_SUFFIXES, *CONVERTED_SUFFIXES))
    assert ", ".join([*POLICIES, *OFFLINE_POLICIES]) in help_of("trace-sim")
    convert = help_of("convert")
    assert f"--bits [{'|'.join(map(str, QUANT_BITS))}]" in convert and f"--mode [{'|'.join(QUANT_MODES)}]" in convert
