"""The floor plan of controller/, runtime/ and workers/, held by tests.

Inside each package, folders (and a few named modules) are layers, lowest first
(`LAYERS`). A layer holds one or more rooms: a room is a sub-package or a group of
modules. A module imports only from its own room or from a room of a lower layer; rooms
side by side in one layer (the rollout side and the training side) do not import each
other. Every import counts: lazy ones inside functions and type-only ones under
`if TYPE_CHECKING:` alike (a type names what the module depends on). Across the three
packages: runtime/ imports neither controller/ nor workers/, and controller/ imports
nothing from workers/ except in the command line that starts a worker process and in the
test support (controller/testing/: the fake cluster, the hostile peers and the fault
harness the tests and benches share) whose fake workers run in real worker sessions. No
import cycle among the modules of each package.

    controller/                         workers/               runtime/
      cli (and __init__) | testing        main, models           bases, transport, eventlog, model_specs
      run                                 rollout | trainer |    config
      view                                  env                  protocol, events, keys
      replay                              session, precision,    params
      launch                              adapters,              aio, atomic, checksums,
      tasks                               channel_config           sandbox, tracebacks, ...
      serving
      episodes
      rollout | train | environments
      weights
      records
      state
      control
"""

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the flexmarl package
PACKAGES = ("controller", "runtime", "workers")
# `flexmarl worker ...` runs a worker process from the command line; the fake cluster
# (test support for the tests and benches) runs fake workers in real worker sessions.
MAY_IMPORT_WORKERS = {"controller.cli", "controller.testing.fake_cluster"}

# package -> layers, lowest first; a layer is a list of rooms, a room a tuple of module prefixes.
LAYERS: dict[str, list[list[tuple[str, ...]]]] = {
    "controller": [
        [("controller.control",)],
        [("controller.state",)],
        [("controller.records",)],
        [("controller.weights",)],
        [("controller.rollout",), ("controller.train",), ("controller.environments",)],
        [("controller.episodes",)],
        [("controller.serving",)],
        [("controller.tasks",)],
        [("controller.launch",)],
        [("controller.replay",)],
        [("controller.view",)],
        [("controller.run",)],
        [("controller.cli", "controller"), ("controller.testing",)],
    ],
    "runtime": [
        [("runtime.aio", "runtime.atomic", "runtime.checksums", "runtime.collector", "runtime.parent_watch",
          "runtime.progress_file", "runtime.sandbox", "runtime.staleness", "runtime.tracebacks",
          "runtime.user_modules")],
        [("runtime.params",)],
        [("runtime.protocol", "runtime.events", "runtime.keys", "runtime.legacy_events")],
        [("runtime.config",)],
        [("runtime.bases", "runtime.transport", "runtime.eventlog", "runtime.model_specs")],
        [("controller.testing",)],
        [("runtime",)],
    ],
    "workers": [
        [("workers.session", "workers.precision", "workers.adapters", "workers.channel_config")],
        [("workers.rollout",), ("workers.trainer",), ("workers.env",)],
        [("workers.main", "workers.models", "workers"), ("controller.testing",)],
    ],
}


def modules_of(package: str, root: Path = ROOT) -> dict[str, Path]:
    """Every module of a package, at any depth, as dotted names under flexmarl
    ("controller.state.store"; a sub-package's __init__.py as the sub-package's name)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_nodes(node: ast.AST):
    """Every import statement under `node` at any depth: lazy and type-only ones too."""
    for child in ast.walk(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child


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


def import_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = modules_of(package, root)
    graph = {}
    for module, path in modules.items():
        deps = {module_named(n, modules) for n in imports_of(module, path)} - {None, module, package}
        # `from .pkg import mod` names the package and its module: the module is the edge
        # (the package's __init__ only where nothing inside it is named).
        graph[module] = {d for d in deps if not any(o.startswith(d + ".") for o in deps)}
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


def room_of(module: str, layers: list[list[tuple[str, ...]]]) -> tuple[int, int] | None:
    """(layer, room) of a module: the room whose prefix names it most closely. A package's
    own name (its __init__.py) names that module alone, not the package's contents."""
    best, where = -1, None
    for i, layer in enumerate(layers):
        for j, room in enumerate(layer):
            for prefix in room:
                inside = module.startswith(prefix + ".") and prefix not in PACKAGES
                if (module == prefix or inside) and len(prefix) > best:
                    best, where = len(prefix), (i, j)
    return where


def layer_violations(package: str, root: Path = ROOT) -> list[str]:
    """Every import of `package` that goes up the layers or across to a room beside it,
    and every module no room holds, as lines that name both ends."""
    layers = LAYERS[package]
    found = []
    for module, deps in sorted(import_graph(package, root).items()):
        here = room_of(module, layers)
        if here is None:
            found.append(f"{module} is in no layer of tests/test_layout.py LAYERS[{package!r}]")
            continue
        for dep in sorted(deps):
            there = room_of(dep, layers)
            if there is None or there == here:
                continue
            if there[0] > here[0]:
                found.append(f"{module} (layer {here[0]}) imports {dep}, a higher layer ({there[0]})")
            elif there[0] == here[0]:
                found.append(f"{module} imports {dep}, a room beside its own in layer {here[0]}")
    return found


def imported_from(package: str, others: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules of `package` that import anything of `others`, and what."""
    found = {}
    for module, path in modules_of(package).items():
        names = sorted(n for n in imports_of(module, path) if n.split(".")[0] in others)
        if names:
            found[module] = names
    return found


def test_controller_imports_only_down_its_layers():
    assert layer_violations("controller") == []


def test_runtime_imports_only_down_its_layers():
    assert layer_violations("runtime") == []


def test_workers_import_only_down_their_layers_and_the_two_sides_stay_apart():
    assert layer_violations("workers") == []


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


def test_every_package_folder_is_installed():
    """pyproject.toml lists every package folder (setuptools installs only those)."""
    listed = ast.literal_eval((ROOT / "pyproject.toml").read_text().split("\npackages = ", 1)[1].split("\n]", 1)[0]
                              + "\n]")
    folders = {"flexmarl." + ".".join(p.parent.relative_to(ROOT).parts)
               for package in PACKAGES for p in (ROOT / package).rglob("__init__.py")}
    assert set(listed) == folders


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_lazy_import_counts_and_so_does_a_type_checking_one(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from .config import Types\n"
                      "def check():\n    from .bases import rule\n    from flexmarl.workers import trainer\n")
    assert imports_of("runtime.x", source) == {"runtime.config", "runtime.config.Types", "runtime.bases",
                                               "runtime.bases.rule", "workers", "workers.trainer"}
    assert module_named("runtime.bases.rule", {"runtime.bases": source}) == "runtime.bases"


def _tree_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "tree"
    for package in PACKAGES:
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_layer_test_fails_on_an_upward_import_in_a_copy_of_the_tree(tmp_path):
    """The test of the test: the copied tree passes; one type-only import from the store up
    to the wiring root, one from the rollout side across to the training side, and one
    from the worker's rollout side to its trainer side are each named."""
    tree = _tree_copy(tmp_path)
    assert layer_violations("controller", tree) == [] and layer_violations("workers", tree) == []
    store = tree / "controller" / "state" / "store.py"
    store.write_text(store.read_text() + "\nfrom typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from ..run.components import Components\n")
    router = tree / "controller" / "rollout" / "router.py"
    router.write_text(router.read_text() + "\n\ndef _later():\n    from ..train import allocator\n")
    engine = tree / "workers" / "rollout" / "engine.py"
    engine.write_text(engine.read_text() + "\nfrom ..trainer.loss import policy_loss\n")
    assert layer_violations("controller", tree) == [
        "controller.rollout.router imports controller.train.allocator, a room beside its own in layer 4",
        "controller.state.store (layer 1) imports controller.run.components, a higher layer (11)"]
    assert layer_violations("workers", tree) == [
        "workers.rollout.engine imports workers.trainer.loss, a room beside its own in layer 1"]


def test_a_module_in_no_layer_is_named(tmp_path):
    tree = _tree_copy(tmp_path)
    (tree / "controller" / "helpers.py").write_text("x = 1\n")
    assert layer_violations("controller", tree) == ["controller.helpers is in no layer of tests/test_layout.py "
                                                    "LAYERS['controller']"]
