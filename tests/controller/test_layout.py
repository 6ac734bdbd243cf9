"""The controller's module structure: no import cycle among its modules (lazy imports
inside functions count too), and nothing imported from workers/ except by the command
line that starts a worker process."""

import ast
from pathlib import Path

CONTROLLER = Path(__file__).resolve().parents[2] / "controller"
# `flexmarl worker ...` runs a worker process from the command line.
MAY_IMPORT_WORKERS = {"cli"}


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at any depth, as dotted names under flexmarl."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside flexmarl.controller
                base = "flexmarl.controller" + (f".{node.module}" if node.module else "")
                found |= {base} if node.module else {f"{base}.{a.name}" for a in node.names}
            elif node.module:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def controller_graph() -> dict[str, set[str]]:
    modules = {p.stem for p in CONTROLLER.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for m in modules:
        deps = set()
        for name in imports_of(CONTROLLER / f"{m}.py"):
            parts = name.split(".")
            if parts[:2] == ["flexmarl", "controller"] and len(parts) > 2 and parts[2] in modules:
                deps.add(parts[2])
        graph[m] = deps - {m}
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


def test_no_import_cycle_among_controller_modules_lazy_or_not():
    assert find_cycle(controller_graph()) is None, " -> ".join(find_cycle(controller_graph()))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_controller_imports_nothing_from_workers_except_to_start_a_worker():
    offenders = {p.stem: sorted(n for n in imports_of(p) if n.startswith("flexmarl.workers"))
                 for p in CONTROLLER.glob("*.py") if p.stem not in MAY_IMPORT_WORKERS}
    assert {m: names for m, names in offenders.items() if names} == {}
