"""Only the experience store reads its records: every container it holds is private, and
no module of the controller outside the store (store.py and its records, records.py)
names a private part of the store, its records or its views, nor imports the records
module. Others ask the store (`views`, `waiting`, `samples_past`, ...); user code gets a
narrow episode context. A scan of the source, as tests/test_layout.py scans imports: of
the controller and of the benches and examples, which use it as other code would."""

import ast
import random
from pathlib import Path

from flexmarl.controller.episodes.workflow import AgentDefaults, EpisodeContext
from flexmarl.controller.state import records, store

CONTROLLER = Path(store.__file__).resolve().parents[1]
ROOT = Path(__file__).resolve().parents[3]
STORE_MODULES = {Path(store.__file__).resolve(), Path(records.__file__).resolve()}
ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}


def private_names() -> set[str]:
    """The store's, its records' and its views' own private names."""
    kept = vars(store.ExperienceStore(["a"]))
    names = {n for n in kept if n.startswith("_")}
    for cls in (store.ExperienceStore, store.MicroBatch, records.GroupRecord, records.SampleView):
        names |= {n for n in dir(cls) if n.startswith("_") and not n.startswith("__")}
        names |= {n for n in getattr(cls, "__struct_fields__", ()) if n.startswith("_")}
    return names


def test_every_container_the_store_holds_is_its_own():
    kept = vars(store.ExperienceStore(["a"]))
    public = {n for n, v in kept.items() if isinstance(v, (dict, list, set)) and not n.startswith("_")}
    assert public == {"on_ready"}  # the listeners it is given; its records, queues and counts are private


def sources() -> list[Path]:
    return sorted([*CONTROLLER.rglob("*.py"), *(ROOT / "bench").rglob("*.py"), *(ROOT / "examples").rglob("*.py")])


def reaches(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """Where a module names one of `names` other than as its own (`self._x` of an
    attribute or method it defines), through an attribute or getattr & co. by a constant
    name, or imports the records module: (line, what)."""
    own = own_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not (on_self and node.attr in own):
                found.append((node.lineno, f".{node.attr}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ACCESSORS \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names:
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("state.records"):
            found.append((node.lineno, "imports the records module"))
        if isinstance(node, ast.ImportFrom) and any(a.name == "records" for a in node.names) \
                and (node.module or "").endswith("state"):
            found.append((node.lineno, "imports the records module"))
        if isinstance(node, ast.Import) and any(a.name.endswith("state.records") for a in node.names):
            found.append((node.lineno, "imports the records module"))
    return found


def test_no_module_outside_the_store_reads_its_internals():
    names = private_names()
    assert {"_groups", "_ready", "_record"} <= names
    found = []
    for path in sources():
        if path.resolve() in STORE_MODULES:
            continue
        for line, what in reaches(ast.parse(path.read_text()), names):
            found.append(f"{path}:{line} {what}")
    assert found == []


def own_names(tree: ast.AST) -> set[str]:
    """Private names a module defines itself (its own functions and classes' attributes:
    `def _x`, `self._x = ...`, `_x: int`), which may coincide with the store's and are the
    module's own business."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            own.add(node.attr)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
    return own


def test_the_scan_finds_a_module_that_reaches_into_the_store():
    names = private_names()
    reaching = ast.parse(
        "from flexmarl.controller.state.records import GroupRecord\n"
        "import flexmarl.controller.state.records\n"
        "from flexmarl.controller.state import records, store\n"
        "class Pipeline:\n"
        "    def __init__(self, store):\n"
        "        self._groups = {}\n"  # a name of its own, the same as the store's ...
        "        self._store = store\n"
        "    def waiting(self):\n"
        "        return len(self._store._groups) + len(self._groups)\n"  # ... does not hide the store's
        "def first(view):\n"
        "    return view._record.tokens[0] + len(getattr(view, '_record').tokens)\n")
    assert sorted(what for _, what in reaches(reaching, names)) == [
        "._groups", "._record", "getattr(..., '_record')", "imports the records module",
        "imports the records module", "imports the records module"]


def test_user_code_gets_a_narrow_context():
    ctx = EpisodeContext("e0", 1, random.Random(0), store.ExperienceStore(["a"]), object(),
                         {"a": AgentDefaults(4, 1.0, 2)}, run_seed=0, gate=lambda agent, batch: None)
    public = {n for n in dir(ctx) if not n.startswith("_")}
    assert not public & {"store", "gate", "generator", "endpoint", "groups"}
    assert {"generate", "chat", "continue_chat", "continue_ids", "reward", "reward_all", "samples", "call", "env",
            "openai_client", "openai_base_url", "openai_api_key", "item", "rng", "episode_id", "agents",
            "tokenizer"} <= public
