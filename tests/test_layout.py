"""The package layout: no import circle among the project's modules, no import of a command's
`__main__` module or of a higher stage (TIERS), and a top level of packages only.
Every import statement counts, function-local and TYPE_CHECKING ones too."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# source folder -> the package name it installs as (pyproject's package-dir)
ROOTS = {"rltlab": REPO / "rltlab", "rltlab.kernels": REPO / "kernels",
         "rltlab.engine_patches": REPO / "engine_patches"}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def import_edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports: `from a.b import c` is a.b.c when that is a module,
    else a.b; a relative import is resolved against the module's package."""
    is_package = path.name == "__init__.py"
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        edges.update(t for t in targets if t in modules and t != name)
    return edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}      # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_circle_and_passes_a_chain():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_edges_resolve_modules_and_relative_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from rltlab.model import gates\nfrom . import sibling\nimport rltlab.engine\n"
                   "def f():\n    from rltlab.model.config import OuroConfig\n")
    modules = {"rltlab.model": src, "rltlab.model.gates": src, "rltlab.pkg.sibling": src,
               "rltlab.engine": src, "rltlab.model.config": src}
    assert import_edges("rltlab.pkg.m", src, modules) == {
        "rltlab.model.gates", "rltlab.pkg.sibling", "rltlab.engine", "rltlab.model.config"}


def test_no_import_circle_among_project_modules():
    modules = project_modules()
    graph = {name: import_edges(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 50
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_top_level_holds_only_packages():
    loose = sorted(p.name for p in (REPO / "rltlab").glob("*.py")
                   if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules at rltlab/'s top level: {loose}"


# The stages from the bottom up: a module may import its own tier and the tiers below it.
# Trained components and the engine patches that load them share a tier; the loop drives the
# workbench's helpers; the bench commands measure everything.
TIERS = [
    ("rltlab.common",),
    ("rltlab.kernels",),
    ("rltlab.model",),
    ("rltlab.pretrain",),
    ("rltlab.engine",),
    ("rltlab.traces",),
    ("rltlab.eval",),
    ("rltlab.exit_predictor", "rltlab.draft_heads", "rltlab.engine_patches"),
    ("rltlab.workbench",),
    ("rltlab.loop",),
    ("rltlab.bench",),
]


def tier_of(module: str) -> int | None:
    for rank, packages in enumerate(TIERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return rank
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Edges from a module to a module of a higher tier, as 'a -> b'."""
    bad = []
    for name, targets in graph.items():
        mine = tier_of(name)
        for target in sorted(targets):
            theirs = tier_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{name} -> {target}")
    return bad


def main_module_imports(graph: dict[str, set[str]]) -> list[str]:
    """Edges into a `__main__` module (a command's entry point is never a library)."""
    return [f"{name} -> {target}" for name, targets in graph.items() for target in targets
            if target.rsplit(".", 1)[-1] == "__main__"]


def test_the_layout_checks_see_what_they_forbid():
    graph = {"rltlab.workbench.scale": {"rltlab.bench.__main__", "rltlab.engine"},
             "rltlab.common.distributed": {"rltlab.eval.tasks"},
             "rltlab.pretrain.rounds": {"rltlab.model.config"}}
    assert main_module_imports(graph) == ["rltlab.workbench.scale -> rltlab.bench.__main__"]
    assert sorted(upward_imports(graph)) == ["rltlab.common.distributed -> rltlab.eval.tasks",
                                             "rltlab.workbench.scale -> rltlab.bench.__main__"]


def test_every_package_has_a_tier():
    packages = {".".join(name.split(".")[:2]) for name in project_modules()} - {"rltlab"}
    assert {p for p in packages if tier_of(p) is None} == set()


def test_no_module_imports_a_main_module_or_a_higher_tier():
    modules = project_modules()
    graph = {name: import_edges(name, path, modules) for name, path in modules.items()}
    assert main_module_imports(graph) == []
    assert upward_imports(graph) == []
