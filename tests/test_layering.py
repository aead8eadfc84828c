"""The package's boundaries hold: every import points down the layer order, the
deciders (cache policy, routing replay, triage, work stealing, the output
folder and the monitor) never load MLX, and the read-only side (``monitor``)
never imports a writer.

Layer order (docs/architecture.md), lowest first; a module may import its own
package and the ones before it::

    base (errors, defaults, fsio, messages, units) -> policy -> routing
      -> kernels -> engine -> tools -> outdir -> monitor -> job -> ranks -> cli

Imports are read from the source with :mod:`ast` (inside functions too; those
under ``if TYPE_CHECKING:`` are type hints only and are skipped), so a lazy
import cannot hide an upward arrow.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_tier"
ORDER = ["", "policy", "routing", "kernels", "engine", "tools", "outdir", "monitor", "job", "ranks", "cli"]
# Deciders and readers: plain Python/numpy, so that they run (and are tested) without MLX;
# and the document converter process (convert_sandbox and what it runs), which must stay light.
NO_MLX = ("mlx_tier.policy", "mlx_tier.routing", "mlx_tier.outdir", "mlx_tier.monitor",
          "mlx_tier.job.triage", "mlx_tier.job.eta", "mlx_tier.job.naming", "mlx_tier.job.sensors",
          "mlx_tier.job.throttle", "mlx_tier.ranks.stealing", "mlx_tier.job.convert_sandbox",
          "mlx_tier.job.convert_limits", "mlx_tier.job.doc_text", "mlx_tier.engine.limits",
          "mlx_tier.engine.footprint")
# What the read-only side may use of the output folder: names, probes, the journal's reader.
MONITOR_MAY_READ = {"mlx_tier.outdir.layout", "mlx_tier.outdir.journal"}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, modules: set[str]):
    """``(line, imported module)`` of every import under ``tree`` outside ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:  # `from mlx_tier.kernels import cpu` imports the module kernels.cpu
                sub = f"{node.module}.{a.name}"
                yield node.lineno, sub if sub in modules else node.module
        stack.extend(ast.iter_child_nodes(node))


def import_graph(package: Path) -> dict[str, list[tuple[int, str]]]:
    """Module -> ``(line, module)`` it imports, for every module of ``package`` (a folder)."""
    files = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts).removesuffix(".__init__")] = path
    return {mod: list(_imports(ast.parse(path.read_text()), set(files))) for mod, path in files.items()}


def layer(module: str) -> int:
    """Index in :data:`ORDER` of an ``mlx_tier`` module (``""``: the top-level base modules)."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ORDER) else ""
    return ORDER.index(name)


def violations(package: Path) -> list[str]:
    """Every broken boundary of the package at ``package``, one line each."""
    graph = import_graph(package)
    out = []
    for mod, imports in graph.items():
        if mod == "mlx_tier":
            continue  # the top-level facade re-exports the public API lazily (by name, not by import)
        for line, dep in imports:
            if dep.startswith("mlx_tier.") and dep in graph and layer(dep) > layer(mod):
                out.append(f"{mod}:{line} imports upward: {dep}")
            if mod.startswith("mlx_tier.monitor") and dep.startswith("mlx_tier.outdir.") \
                    and dep not in MONITOR_MAY_READ:
                out.append(f"{mod}:{line} (read-only side) imports a writer: {dep}")
    for mod in graph:
        if mod.startswith(NO_MLX):
            reach = _reachable(graph, mod)
            heavy = sorted({d for m in reach for _, d in graph[m] if d.split(".")[0] in ("mlx", "mlx_lm")})
            if heavy:
                out.append(f"{mod} (a decider) loads MLX: {', '.join(heavy)}")
    return out


def _reachable(graph, start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for _, dep in graph[todo.pop()]:
            if dep in graph and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_every_boundary_holds():
    assert violations(PACKAGE) == []


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} - {"data"}
    assert packages <= set(ORDER), packages - set(ORDER)


def test_a_planted_upward_import_is_caught(tmp_path):
    copy = tmp_path / "mlx_tier"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    eviction = copy / "policy" / "eviction.py"
    eviction.write_text(eviction.read_text() + "\n\ndef _late():\n    from mlx_tier.job.run import run_job\n")
    (copy / "monitor" / "status.py").write_text(
        (copy / "monitor" / "status.py").read_text() + "\nfrom mlx_tier.outdir.jobdir import JobDir\n")
    found = violations(copy)
    assert any(v.startswith("mlx_tier.policy.eviction:") and "upward: mlx_tier.job.run" in v for v in found), found
    assert any("(read-only side) imports a writer: mlx_tier.outdir.jobdir" in v for v in found), found
    assert any(v.startswith("mlx_tier.policy.eviction (a decider) loads MLX") for v in found), found


def test_type_hints_alone_are_not_imports(tmp_path):
    copy = tmp_path / "mlx_tier"
    (copy / "policy").mkdir(parents=True)
    (copy / "__init__.py").write_text("")
    (copy / "policy" / "__init__.py").write_text("")
    (copy / "policy" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mlx_tier.job.run import JobConfig\n")
    assert violations(copy) == []
