"""The documents tell the truth: every configuration key has a docstring and a row in
docs/reference.md (and nothing else has a row), the reference is what
scripts/config_reference.py writes from runtime/config.py, the Python snippet runs as
written, and the README stays the newcomer's short page. In the README, docs/ and the
examples' READMEs alike: every relative link points to a file (and heading) that exists,
every file of the repository a command or a path names exists, and a block that quotes a
file (its first line `# examples/...`) says what the file says."""

import dataclasses
import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest

from flexmarl.runtime.config import AgentConfig, BaseConfig, ExperimentConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "reference.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]
README_MAX_LINES = 220


def load_generator() -> types.ModuleType:
    """scripts/config_reference.py, imported from its file (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


generator = load_generator()


def config_keys() -> set[str]:
    keys = set()
    for section in dataclasses.fields(ExperimentConfig):
        if section.name in ("agents", "bases"):  # one table per agent, per base
            table = AgentConfig if section.name == "agents" else BaseConfig
            keys |= {f"{section.name}.*.{f.name}" for f in dataclasses.fields(table)}
        else:
            keys |= {f"{section.name}.{f.name}" for f in dataclasses.fields(section.default_factory)}
    return keys


def config_sections():
    return generator.parse((ROOT / "runtime" / "config.py").read_text())


# ---- the configuration reference --------------------------------------------------------


def test_every_config_key_has_a_docstring_and_a_row_in_the_reference_and_nothing_else_has_a_row():
    sections = config_sections()
    assert generator.undocumented(sections) == [], "config fields without a docstring in runtime/config.py"
    assert {k.key for s in sections for k in s.keys} == config_keys(), "the generator reads other keys than the config has"
    documented = set(re.findall(r"^\| `([a-z_.*]+)` \|", REFERENCE.read_text(), flags=re.M))
    assert config_keys() - documented == set(), "keys missing from docs/reference.md"
    assert documented - config_keys() == set(), "docs/reference.md documents keys the config does not have"


def test_the_committed_reference_is_what_the_generator_writes():
    assert REFERENCE.read_text() == generator.reference(), (
        "docs/reference.md is out of date: run `python scripts/config_reference.py`")
    assert generator.main(["--check"]) == 0


def test_the_generators_check_fails_on_a_stale_reference_and_says_how_to_fix_it(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "reference.md"
    stale.write_text(generator.reference().replace("Adam learning rate. The default", "The learning rate. The default"))
    monkeypatch.setattr(generator, "REFERENCE", stale)
    monkeypatch.setattr(generator, "ROOT", tmp_path)
    assert generator.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "out of date" in err and "python scripts/config_reference.py" in err
    assert "-| `agents.*.lr` | `float` | `0.002` | The learning rate. The default suits" in err
    assert generator.main([]) == 0 and stale.read_text() == generator.reference()


SYNTHETIC = '''
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["fast", "slow"]


@dataclass
class PartConfig:
    size: int = 64 * 1024
    """How big, in bytes."""
    mode: Mode = "fast"
    # a comment above a field is not its docstring
    names: list[str] = field(default_factory=lambda: ["a", "b"])
    """The names."""
    late: float = 1e-3

    """A string that does not follow its field at once documents nothing."""


@dataclass
class ExperimentConfig:
    part: PartConfig = field(default_factory=PartConfig)
    """[part]: the part."""
    parts: dict[str, PartConfig] = field(default_factory=dict)
'''


def test_a_config_field_without_a_docstring_is_caught_and_the_reference_is_refused():
    sections = generator.parse(SYNTHETIC)
    assert [s.name for s in sections] == ["part", "parts"]
    part = {k.key: k for k in sections[0].keys}
    assert part["part.size"] == generator.Key("part.size", "int", "65536", "How big, in bytes.")
    assert (part["part.mode"].type, part["part.mode"].default) == ('"fast" | "slow"', '"fast"')
    assert (part["part.names"].default, part["part.late"].default) == ('["a", "b"]', "0.001")
    assert generator.undocumented(sections) == ["parts", "part.mode", "part.late", "parts.*.mode", "parts.*.late"]
    with pytest.raises(generator.UndocumentedFields, match="part.mode, part.late"):
        generator.render(sections)


def test_the_reference_names_every_default_that_flexmarl_run_changes(tmp_path):
    """`flexmarl run CONFIG` starts from the embedded default job, so a few keys a config
    file leaves unset differ from the configuration's own defaults; the reference says
    which, and with what value."""
    from flexmarl.controller import cli

    job = tmp_path / "job.toml"
    job.write_text('[agents.writer]\nmodel = "tiny:planner"\n')
    from_cli = cli._config_from_args(cli._parser(worker_options=False).parse_args(["run", str(job)]))
    plain = load_config(job)
    changed = {f"{section.name}.{key}": value
               for section in dataclasses.fields(ExperimentConfig) if section.name not in ("agents", "bases")
               for key, value in dataclasses.asdict(getattr(from_cli, section.name)).items()
               if value != getattr(getattr(plain, section.name), key)}
    note = next(p for p in REFERENCE.read_text().split("\n\n") if "`flexmarl run` and `flexmarl controller`" in p)
    stated = {key: int(value) for key, value in re.findall(r"`([a-z_]+\.[a-z_]+)` = (\d+)", note)}
    assert stated == changed


# ---- the README and the guide -------------------------------------------------------------


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.M | re.S)


def test_the_python_snippet_runs_as_written(monkeypatch):
    import flexmarl.controller

    found = [(path, block) for path in (README, ROOT / "docs" / "guide.md") for block in python_blocks(path)
             if "from flexmarl.controller import Experiment" in block]
    assert len(found) == 1, "one Python snippet of the Experiment API, in the README or docs/guide.md"
    path, snippet = found[0]
    ran = []

    class Experiment:  # stands in for the real one: the snippet's shape is what is tested
        def __init__(self, cfg):
            ran.append(cfg.run.steps)

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return None

        async def train(self):
            return types.SimpleNamespace(report=lambda: "5 steps")

    monkeypatch.setattr(flexmarl.controller, "Experiment", Experiment)
    monkeypatch.chdir(ROOT)
    exec(compile(snippet, str(path.relative_to(ROOT)), "exec"), {"__name__": "__main__"})
    assert ran == [5]


def test_the_readme_stays_the_newcomers_short_page():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the rest belongs in docs/"
    text = README.read_text()
    assert "make run" in text and "make test" in text


# ---- links ------------------------------------------------------------------------------------


def prose(markdown: str) -> str:
    """The text outside fenced code blocks and code spans, where a link can be."""
    without_blocks = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    return re.sub(r"(`+).*?\1", "", without_blocks, flags=re.S)


def anchors(markdown: str) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces as dashes,
    a repeated one numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S),
                              flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def broken_links(document: Path) -> list[str]:
    """The relative links of a document that point to no file of the repository, or to a
    heading its markdown file does not have."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(document.read_text())):
        if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (document.parent / path).resolve() if path else document
        if not file.exists() or ROOT not in [file, *file.parents]:
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target} (no such heading in {file.relative_to(ROOT)})")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_that_exists(document):
    assert broken_links(document) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[fine](other.md#a-section) [self](#page) [web](https://example.org)\n"
                    "[gone](missing.md) [nowhere](other.md#no-section) `[code](missing.md)`\n"
                    "```\n[block](missing.md)\n```\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#no-section (no such heading in other.md)"]


# ---- files named and quoted ---------------------------------------------------------------

# A path of the repository as documents write it: from its root, to a file of these kinds.
REPOSITORY_PATH = re.compile(r"(?<![\w/.])((?:examples|bench|scripts|docs|tests)/[\w./-]*\w\.(?:py|toml|jsonl|md|sh))\b")


def code(markdown: str) -> str:
    """The text inside fenced code blocks and code spans, where commands and paths are."""
    blocks = re.findall(r"^```.*?^```", markdown, flags=re.M | re.S)
    spans = re.findall(r"(`+)(.*?)\1", re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S), flags=re.S)
    return "\n".join(blocks + [span for _, span in spans])


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_command_or_path_names_exists(document):
    named = set(REPOSITORY_PATH.findall(code(document.read_text())))
    placeholder = re.compile(r"(^|/)[A-Z_]+[./]")  # bench/KIND/NAME.py: a pattern, not a file
    assert sorted(path for path in named if not (ROOT / path).exists() and not placeholder.search(path)) == []


def quoting_blocks(markdown: str) -> list[tuple[str, str, bool, str]]:
    """(language, quoted file, abridged, body) of every fenced block whose first line is a
    comment naming a file of the repository (`# examples/x/workflow.py`, `(abridged)` after
    it for a shortened quote)."""
    found = []
    for language, first, body in re.findall(r"^```(\w+)\n# ((?:examples|bench|scripts)/\S+)([^\n]*\n.*?)^```",
                                             markdown, flags=re.M | re.S):
        found.append((language, first, "(abridged)" in body.split("\n", 1)[0], body.split("\n", 1)[1]))
    return found


def code_lines(text: str) -> list[str]:
    """Lines of Python without comments, indentation or blank lines, for comparing a quote."""
    lines = (re.sub(r"\s+#.*$|^\s*#.*$", "", line).strip() for line in text.splitlines())
    return [line for line in lines if line and line != "..."]


def quote_mismatches(language: str, path: str, abridged: bool, body: str) -> list[str]:
    import tomllib

    text = (ROOT / path).read_text()
    if language == "toml":
        def flat(table: dict, prefix: str = "") -> dict:
            return {k: v for key, value in table.items()
                    for k, v in (flat(value, f"{prefix}{key}.").items() if isinstance(value, dict)
                                 else [(f"{prefix}{key}", value)])}
        quoted, actual = flat(tomllib.loads(body)), flat(tomllib.loads(text))
        return [f"{key} = {value!r} (the file: {actual.get(key)!r})" for key, value in quoted.items()
                if actual.get(key, object()) != value]
    if language == "python" and not abridged:
        lines = set(code_lines(text))
        return [line for line in code_lines(body) if line not in lines]
    return []


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_block_that_quotes_a_file_says_what_the_file_says(document):
    mismatches = {path: wrong for language, path, abridged, body in quoting_blocks(document.read_text())
                  if (wrong := quote_mismatches(language, path, abridged, body))}
    assert mismatches == {}


def test_the_quote_and_path_checks_find_a_wrong_value_a_changed_line_and_a_missing_file():
    page = ("Run `python examples/nowhere.py`, then `flexmarl run examples/review_chain.toml`.\n\n"
            "```toml\n# examples/review_chain.toml (abridged)\n[run]\nsteps = 61\n[agents.solver]\nlr = 0.001\n```\n\n"
            "```python\n# examples/review_chain/workflow.py\nasync def episode(ctx) -> None:\n    return 1  # changed\n```\n")
    assert sorted(set(REPOSITORY_PATH.findall(code(page)))) == ["examples/nowhere.py", "examples/review_chain.toml",
                                                                "examples/review_chain/workflow.py"]
    found = {path: quote_mismatches(*block) for block in quoting_blocks(page) for path in [block[1]]}
    assert found == {"examples/review_chain.toml": ["run.steps = 61 (the file: 60)"],
                     "examples/review_chain/workflow.py": ["return 1"]}
