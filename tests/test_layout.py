"""The module structure of controller/, runtime/ and workers/: no import cycle among the
modules of each (lazy imports inside functions count too; an import under
`if TYPE_CHECKING:` does not, since it never runs), runtime/ imports neither controller/
nor workers/, and controller/ imports nothing from workers/ except in the command line
that starts a worker process."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the flexmarl package
PACKAGES = ("controller", "runtime", "workers")
# `flexmarl worker ...` runs a worker process from the command line.
MAY_IMPORT_WORKERS = {"controller.cli"}


def modules_of(package: str) -> dict[str, Path]:
    """Every module of a package, at any depth, as dotted names under flexmarl
    ("controller.store"; a sub-package's __init__.py as the sub-package's name)."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _import_nodes(node: ast.AST):
    """Every import statement under `node` at any depth, except under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif _is_type_checking_block(child):  # its else branch runs
            yield from _import_nodes(ast.Module(body=child.orelse, type_ignores=[]))
        else:
            yield from _import_nodes(child)


def imports_of(module: str, path: Path) -> set[str]:
    """Every name of flexmarl a module imports, as dotted names without the prefix
    ("runtime.protocol", "runtime.protocol.OptimStep"); relative imports resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif node.level:  # relative: made absolute under flexmarl
            base = ".".join(["flexmarl"] + package[:len(package) - node.level + 1] + [node.module or ""]).rstrip(".")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n.removeprefix("flexmarl.") for n in names if n.startswith("flexmarl.")}
    return found


def module_named(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported name is, or is a member of (the longest match)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = modules_of(package)
    graph = {}
    for module, path in modules.items():
        deps = {module_named(n, modules) for n in imports_of(module, path)}
        # A package's own name stands for its __init__; importing a member of it is no edge to it.
        graph[module] = {d for d in deps if d and d != module and d != package} - {None}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def imported_from(package: str, others: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules of `package` that import anything of `others`, and what."""
    found = {}
    for module, path in modules_of(package).items():
        names = sorted(n for n in imports_of(module, path) if n.split(".")[0] in others)
        if names:
            found[module] = names
    return found


def test_no_import_cycle_among_controller_modules_lazy_or_not():
    cycle = find_cycle(import_graph("controller"))
    assert cycle is None, " -> ".join(cycle)


def test_no_import_cycle_among_runtime_modules_lazy_or_not():
    cycle = find_cycle(import_graph("runtime"))
    assert cycle is None, " -> ".join(cycle)


def test_no_import_cycle_among_workers_modules_lazy_or_not():
    cycle = find_cycle(import_graph("workers"))
    assert cycle is None, " -> ".join(cycle)


def test_runtime_imports_neither_controller_nor_workers():
    assert imported_from("runtime", ("controller", "workers")) == {}


def test_controller_imports_nothing_from_workers_except_to_start_a_worker():
    offenders = imported_from("controller", ("workers",))
    assert {m: names for m, names in offenders.items() if m not in MAY_IMPORT_WORKERS} == {}


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_lazy_import_counts_and_a_type_checking_one_does_not(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from .config import Types\n"
                      "def check():\n    from .bases import rule\n    from flexmarl.workers import trainer\n")
    assert imports_of("runtime.x", source) == {"runtime.bases", "runtime.bases.rule", "workers",
                                               "workers.trainer"}
    assert module_named("runtime.bases.rule", {"runtime.bases": source}) == "runtime.bases"
