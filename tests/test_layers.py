"""Static import-layering checks: every .py file is parsed with `ast`, nothing is imported.

The layering, top to bottom (an arrow points at what a layer may import):

    benchmarks, raypd (the embedded LLM)
    cluster -> prefill, decode, encoder -> replica -> postproc, protocol -> engine -> llmapi

Cycles are checked between top-level packages (engine/* and cluster/* subpackages belong to their top-level package),
except two modules that stand apart: `cluster.cli` (the `raypd` command, on top: it runs the benchmarks) and
`benchmarks.workload` (the workload generator the planner shares; plain Python, it imports nothing of the project).
Every import statement counts, module level or inside a function, relative ones resolved; only imports of the
project's own packages matter. A package named here that does not exist (yet) is simply absent.
"""

from __future__ import annotations

import ast
import os
from functools import cache
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"llmapi", "protocol", "engine", "postproc", "replica", "prefill", "decode", "encoder", "cluster",
            "benchmarks", "raypd"}
ROLES = {"prefill", "decode", "encoder"}
MAX_MODULES = 15
APART = ("cluster.cli", "benchmarks.workload")  # their own nodes in the package graph


def _node(module: str) -> str:
    """The node of the package graph a module belongs to."""
    return next((a for a in APART if module == a or module.startswith(a + ".")), module.split(".")[0])


class Import(NamedTuple):
    file: str  # relative to the repo root, e.g. "engine/core/loop.py"
    line: int
    target: str  # the dotted module imported, e.g. "engine.kv.kv_handle"
    src: str  # the importing top-level package ("engine")
    dst: str  # the imported top-level package ("engine")


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _targets(node: ast.Import | ast.ImportFrom, package: list[str]) -> list[str]:
    """The modules one statement imports: `from a import b` gives a.b when that is a module, else a."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
    base = ".".join(p for p in (base, node.module) if p)
    subs = [f"{base}.{a.name}" for a in node.names if a.name != "*" and _is_module(f"{base}.{a.name}")]
    return subs if len(subs) == len(node.names) else [base, *subs]


@cache
def imports() -> list[Import]:
    """Every import of the project's own packages (and of ray), in every file of those packages."""
    found = []
    for path in sorted(p for top in PACKAGES for p in (ROOT / top).rglob("*.py")):
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(rel))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = ".".join(rel.with_suffix("").parts)
                found += [Import(rel.as_posix(), node.lineno, t, _node(module), _node(t))
                          for t in _targets(node, list(rel.parent.parts))]
    return [i for i in found if i.dst.split(".")[0] in PACKAGES or i.dst == "ray"]


def _check(bad: list[Import], why: str) -> None:
    assert not bad, why + ":\n" + "\n".join(f"  {i.file}:{i.line}: imports {i.target}" for i in bad)


def test_no_package_cycle():
    edges: dict[str, dict[str, str]] = {}  # src -> dst -> one example "file:line"
    for i in imports():
        if i.dst.split(".")[0] in PACKAGES and i.src != i.dst:
            edges.setdefault(i.src, {}).setdefault(i.dst, f"{i.file}:{i.line}")
    cycles, done, stack = [], set(), []

    def visit(node: str) -> None:  # depth-first; every back edge closes a cycle
        stack.append(node)
        for nxt in sorted(edges.get(node, {})):
            if nxt in stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt)
        done.add(stack.pop())

    for start in sorted(edges):
        if start not in done:
            visit(start)
    assert not cycles, "package import cycles:\n" + "\n".join(
        "  " + ", ".join(f"{a} -> {b} ({edges[a][b]})" for a, b in zip(c, c[1:])) for c in cycles)


def test_roles_do_not_import_each_other():
    _check([i for i in imports() if i.src in ROLES and i.dst in ROLES - {i.src}], "a role imports another role")


def test_library_does_not_import_benchmarks():
    # dst "benchmarks" is any benchmark; benchmarks.workload, the planner's workload generator, is a node of its own
    _check([i for i in imports() if i.dst == "benchmarks" and i.src not in ("benchmarks", "cluster.cli")],
           "library code imports benchmarks (only benchmarks.workload is allowed)")


def test_engine_does_not_import_ray():
    _check([i for i in imports() if i.src == "engine" and i.dst == "ray"], "engine/ is plain Python + torch, no ray")


def test_package_shape():
    bad = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and d not in ("tests", "build", "dist")]
        if "__init__.py" not in files:
            continue
        rel = Path(folder).relative_to(ROOT).as_posix()
        modules = sorted(f for f in files if f.endswith(".py") and f != "__init__.py")
        if len(modules) > MAX_MODULES:
            bad.append(f"  {rel}/: {len(modules)} modules (at most {MAX_MODULES})")
        if rel.split("/")[0] != "benchmarks":
            bad += [f"  {rel}/{m}: a benchmark inside a library package" for m in modules if m.startswith("bench")]
    assert not bad, "package shape:\n" + "\n".join(bad)


def test_llmapi_imports_only_itself():
    _check([i for i in imports() if i.src == "llmapi" and i.dst in PACKAGES - {"llmapi"}],
           "llmapi/ (plain types) imports the project outside llmapi")
