"""Writes docs/reference.md, the configuration reference, from the field docstrings of
runtime/config.py, so the reference and the code cannot drift apart.

    python scripts/config_reference.py           # rewrite docs/reference.md
    python scripts/config_reference.py --check   # exit 1 if docs/reference.md is not what it would write

Every field of every config dataclass reachable from `ExperimentConfig` carries its meaning
as an attribute docstring: a string literal on the line right after the field (PEP 257).
Python drops those strings at run time, so they are read here from the source with `ast`,
with each field's type and default as written. A field without one is an error: the
script names it and writes nothing.

Hand-written because it is small and no library turns attribute docstrings into markdown
(documentation generators read them into HTML API pages, not into a table of TOML keys).
It imports nothing of FlexMARL, so it runs without the project's dependencies.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import operator
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "runtime" / "config.py"
REFERENCE = ROOT / "docs" / "reference.md"
ROOT_CLASS = "ExperimentConfig"
GENERATOR = "scripts/config_reference.py"

HEADER = f"""# Configuration reference

<!-- Written by {GENERATOR} from the field docstrings of runtime/config.py. Do not edit
here: change the docstring, then run `python {GENERATOR}`. -->

Every key of a job's configuration, with its type, its default and what it means. Set them
in a TOML file (a `[section]` table each, one `[agents.NAME]` table per agent, one
`[bases.NAME]` per shared base model) or on the command line with
`--set section.key=value` (see [the command line](operations.md#the-command-line)). An
unknown key, or a value of the wrong type, is an error that names the key.
`examples/default.toml` is the embedded default job written out.

The defaults are the configuration's own, as `load_config` in Python gives them.
`flexmarl run` and `flexmarl controller` start from the embedded default job instead, so
where a config file leaves these unset they are: `run.steps` = 40,
`pipeline.queries_per_step` = 16, `pipeline.micro_batch` = 32.
"""


class UndocumentedFields(ValueError):
    """Config fields without a docstring; the message names each and says what to write."""


@dataclass(frozen=True)
class Key:
    key: str  # "run.steps", "agents.*.lr"
    type: str  # as written, a Literal alias spelled out
    default: str  # as TOML writes it
    doc: str | None  # the field's docstring, or None where it has none


@dataclass(frozen=True)
class Section:
    name: str  # "run", "agents"
    doc: str | None  # the docstring of the root class's field that holds the section
    about: str  # the section class's own docstring, if it has one
    keys: tuple[Key, ...]


# ---- reading the source ------------------------------------------------------------------


def literal_aliases(source: str) -> dict[str, str]:
    """`Name = Literal["a", "b"]` at module level -> {"Name": '"a" | "b"'}."""
    found = {}
    for node in ast.parse(source).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and _is_literal(node.value):
            found[target.id] = _literal_text(node.value)
    return found


def sibling_modules(source: str) -> list[str]:
    """The modules a source imports relatively from its own package (`from .protocol import`)."""
    return [n.module for n in ast.parse(source).body
            if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module]


def parse(source: str, aliases: dict[str, str] | None = None, root: str = ROOT_CLASS) -> list[Section]:
    """The sections of the config class `root` in `source`, each with its keys in the order of
    the fields. A field whose type is another class of the source is a section of its own;
    `dict[str, Class]` is a section of one table per name (keys `name.*.field`)."""
    aliases = {**literal_aliases(source), **(aliases or {})}
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    if root not in classes:
        raise ValueError(f"no class {root} in the source")
    sections = []
    for name, annotation, _, doc in _fields(classes[root]):
        table, per_name = _table_class(annotation, classes)
        if table is None:
            raise ValueError(f"{root}.{name} is not a config section (a config class, or dict[str, one])")
        prefix = f"{name}.*." if per_name else f"{name}."
        keys = tuple(Key(prefix + field, _type_text(ann, aliases), _default_text(value), field_doc)
                     for field, ann, value, field_doc in _fields(classes[table]))
        sections.append(Section(name, doc, ast.get_docstring(classes[table]) or "", keys))
    return sections


def undocumented(sections: list[Section]) -> list[str]:
    """The sections and keys that have no docstring, by name."""
    return ([s.name for s in sections if not s.doc]
            + [k.key for s in sections for k in s.keys if not k.doc])


def _fields(cls: ast.ClassDef):
    """(name, annotation, default, docstring) of each annotated field of a class body; the
    docstring is the string statement on the line right after the field, else None."""
    body = cls.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        doc = None
        if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str) and after.lineno == node.end_lineno + 1):
            doc = inspect.cleandoc(after.value.value)
        yield node.target.id, node.annotation, node.value, doc


def _table_class(annotation: ast.expr, classes: dict[str, ast.ClassDef]) -> tuple[str | None, bool]:
    if isinstance(annotation, ast.Name) and annotation.id in classes:
        return annotation.id, False
    if (isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "dict"
            and isinstance(annotation.slice, ast.Tuple) and len(annotation.slice.elts) == 2):
        value = annotation.slice.elts[1]
        if isinstance(value, ast.Name) and value.id in classes:
            return value.id, True
    return None, False


def _is_literal(node: ast.expr) -> bool:
    return isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Literal", "typing.Literal")


def _literal_text(node: ast.Subscript) -> str:
    values = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    return " | ".join(_toml(ast.literal_eval(v)) for v in values)


def _type_text(annotation: ast.expr, aliases: dict[str, str]) -> str:
    if isinstance(annotation, ast.Name) and annotation.id in aliases:
        return aliases[annotation.id]
    if _is_literal(annotation):
        return _literal_text(annotation)
    return ast.unparse(annotation)


# Arithmetic a default may be written with (64 * 1024 * 1024); nothing else is evaluated.
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg}


def _value(node: ast.expr):
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    return ast.literal_eval(node)


def _default_text(node: ast.expr | None) -> str:
    """A field's default as TOML writes it; `field(default_factory=...)` made."""
    if node is None:
        return "(required)"
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("field", "dataclasses.field"):
        options = {k.arg: k.value for k in node.keywords}
        if "default" in options:
            return _toml(_value(options["default"]))
        factory = options.get("default_factory")
        if isinstance(factory, ast.Lambda):
            return _toml(_value(factory.body))
        if isinstance(factory, ast.Name) and factory.id in ("list", "dict"):
            return "[]" if factory.id == "list" else "{}"
        raise ValueError(f"cannot show the default {ast.unparse(node)}")
    return _toml(_value(node))


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


# ---- writing the reference ---------------------------------------------------------------


def render(sections: list[Section]) -> str:
    """docs/reference.md for these sections; raises UndocumentedFields if any lacks a docstring."""
    missing = undocumented(sections)
    if missing:
        raise UndocumentedFields(
            f"{len(missing)} config field(s) of runtime/config.py have no docstring: {', '.join(missing)}. "
            "Write what each means as a string literal on the line right after the field.")
    lines = [HEADER, "Sections: " + " · ".join(f"[{s.name}](#{s.name})" for s in sections), ""]
    for section in sections:
        lines += [f"## {section.name}", "", _cell(section.doc or "", table=False), ""]
        if section.about:
            lines += [_cell(section.about, table=False), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        lines += [f"| `{k.key}` | {_code(k.type)} | {_code(k.default)} | {_cell(k.doc or '')} |"
                  for k in section.keys]
        lines.append("")
    return "\n".join(lines)


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def _cell(text: str, table: bool = True) -> str:
    """A docstring as one markdown line: lines joined; outside code spans a `<` is escaped
    (it would start an HTML tag), and in a table a `|` (it would end the cell)."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):  # the parts outside code spans
        parts[i] = parts[i].replace("<", "&lt;")
    joined = "`".join(parts)
    return joined.replace("|", "\\|") if table else joined


def reference(config: Path = CONFIG) -> str:
    """What docs/reference.md should hold for the config source at `config`."""
    source = config.read_text()
    aliases = {}
    for module in sibling_modules(source):
        path = config.parent / f"{module}.py"
        if path.exists():
            aliases.update(literal_aliases(path.read_text()))
    return render(parse(source, aliases))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 if {REFERENCE.relative_to(ROOT)} differs from what would be written")
    args = parser.parse_args(argv)
    try:
        text = reference()
    except UndocumentedFields as exc:
        print(f"config_reference: {exc}", file=sys.stderr)
        return 2
    where = REFERENCE.relative_to(ROOT)
    if args.check:
        current = REFERENCE.read_text() if REFERENCE.exists() else ""
        if current == text:
            return 0
        diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(), f"{where} (committed)",
                                         f"{where} (from runtime/config.py)", lineterm="", n=1))
        print(f"config_reference: {where} is out of date with the field docstrings of runtime/config.py; "
              f"run `python {GENERATOR}` and commit the result. The difference:", file=sys.stderr)
        print("\n".join(diff[:60]) + ("\n..." if len(diff) > 60 else ""), file=sys.stderr)
        return 1
    REFERENCE.parent.mkdir(exist_ok=True)
    REFERENCE.write_text(text)
    print(f"wrote {where}: {text.count(chr(10) + '| `')} keys")
    return 0


if __name__ == "__main__":
    sys.exit(main())
