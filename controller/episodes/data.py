"""Datasets: the rows episodes receive as `ctx.item`, in a reproducible order.

`load_rows(path)` reads a .jsonl / .json / .parquet / .csv file or a directory saved by
`datasets.Dataset.save_to_disk` into a list of plain dicts (the controller keeps them in
memory: prompts are small next to models). Each row keeps its own keys: a JSON row is
read as written (the `datasets` reader would give every row every column, None where a
row has none), and a table's empty cell (None) is left out of its row. Messages name a
row as the file counts it: a JSON-lines row by its line (from 1, blank lines counted),
any other row by its number from 1 (`Dataset.place`).

Episodes get a row as a `Row`: reading a key the row lacks raises `MissingField`, naming
the row and its keys, which fails that episode alone; a key no row of the data has raises
`MissingColumn`, which stops the run in one line (every episode would fail the same way;
dry_read.py finds such a read before any worker starts, where the workflow makes it
before its first agent call).

`DataOrder` says which row episode number g (counted over the whole run) gets: epoch
g // n, position g % n of that epoch's order (shuffled per epoch from the run's seed when
asked). `position(g)` is what the event log records, so a run can say where it is in the
data and a resumed run can continue from there.

It does not know episodes, batches or workers.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..state.failures import RunFailed, calling_user_frame

# file suffix -> the `datasets` builder that reads it
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """A dataset that cannot serve the run; the message says what to change."""


class MissingField(KeyError):
    """An episode read a key its row does not have (other rows may): the episode fails."""

    def __str__(self) -> str:
        return str(self.args[0])


class MissingColumn(MissingField, RunFailed):
    """An episode read a key no row of the data has: every episode would fail alike, so
    the run stops."""


class Row(dict):
    """A dataset row as an episode sees it (a dict); `row[key]` for a key it lacks raises
    MissingField or MissingColumn instead of a bare KeyError."""

    def __init__(self, fields: dict[str, Any], index: int, dataset: "Dataset") -> None:
        super().__init__(fields)
        self.index = index  # in the file
        self.dataset = dataset

    def __missing__(self, key: Any) -> Any:
        name, keys = self.dataset.name, ", ".join(map(repr, self)) or "none"
        if key not in self.dataset.columns():
            where = calling_user_frame()
            raise MissingColumn(f"{name}: no row has a field {key!r}, which the workflow reads"
                                + (f" (at {where})" if where else "") + f"; the rows' fields: "
                                f"{', '.join(map(repr, self.dataset.columns())) or 'none'}. Add it to the data, "
                                "or read a field the rows have")
        raise MissingField(f"{name} {self.dataset.place(self.index)} has no field {key!r} (its fields: {keys})")


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    return read_rows(path)[0]


def read_rows(path: str | Path) -> tuple[list[dict[str, Any]], list[int] | None]:
    """The rows of `path` and, for JSON lines, each row's line number (from 1); None for
    files whose rows are counted, not lined."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset {str(path)!r} does not exist")
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(f"dataset {path} has no rows (the file is empty)")
    found = _json_rows(path) if path.is_file() else None
    if found is None:
        found = [{k: v for k, v in row.items() if v is not None} for row in _table_rows(path)], None
    if not found[0]:
        raise DataError(f"dataset {path} has no rows")
    return found


def _json_rows(path: Path) -> tuple[list[dict[str, Any]], list[int] | None] | None:
    """The rows of a .jsonl file (with their lines), or of a .json file holding one list of
    objects, as written; None for other files (read as tables)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _lined(path)
    if suffix != ".json":
        return None
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return _lined(path)  # JSON lines in a .json file
    if isinstance(rows, list) and all(isinstance(r, dict) for r in rows):
        return rows, None
    return None  # another layout: the `datasets` reader's business


def _lined(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    lines: list[int] = []
    return check_jsonl(path, lines), lines


def _table_rows(path: Path) -> list[dict[str, Any]]:
    import datasets

    datasets.disable_progress_bars()  # a few rows in memory: its bars would only clutter the run's output
    if path.is_dir():
        try:
            table = datasets.load_from_disk(str(path))
        except Exception as exc:  # the library's errors vary by what it found there
            raise DataError(f"{path} is a directory but not one saved by datasets' save_to_disk: {exc}") from None
        if isinstance(table, datasets.DatasetDict):
            raise DataError(f"{path} holds several splits ({', '.join(table)}); point at one split's directory")
    else:
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(f"{path}: unknown dataset format {path.suffix!r} (known: {', '.join(BUILDERS)}, "
                            f"or a save_to_disk directory)")
        try:
            table = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as exc:
            raise DataError(f"{path} could not be read as {builder}: {exc}") from None
    return table.to_list()


def check_jsonl(path: Path, lines: list[int] | None = None) -> list[dict[str, Any]]:
    """The rows of `path`, one JSON object per non-blank line (each row's line number,
    from 1, appended to `lines` when given); a DataError naming the first line that is not
    one and why."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {number} is not valid JSON: {exc.msg} at column {exc.colno}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {number} is a JSON {type(row).__name__}, not an object "
                                f"({{\"question\": ..., ...}}): each line is one row") from None
            rows.append(row)
            if lines is not None:
                lines.append(number)
    return rows


@dataclass(frozen=True)
class DataPosition:
    epoch: int
    index: int  # the row's index in the file


class DataOrder:
    def __init__(self, n_rows: int, seed: int, shuffle: bool = True, epochs: int = 0) -> None:
        if n_rows < 1:
            raise DataError("a dataset needs at least one row")
        self.n, self.seed, self.shuffle, self.epochs = n_rows, seed, shuffle, epochs
        self._orders: dict[int, list[int]] = {}

    def capacity(self) -> int | None:
        """How many episodes the data can serve (None: unbounded)."""
        return self.n * self.epochs if self.epochs else None

    def position(self, g: int) -> DataPosition:
        epoch, offset = divmod(g, self.n)
        if self.epochs and epoch >= self.epochs:
            raise DataError(f"the data is used up: {self.n} rows x {self.epochs} epochs")
        return DataPosition(epoch, self._order(epoch)[offset])

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.n))
            if self.shuffle:
                random.Random(f"data-{self.seed}-{epoch}").shuffle(order)
            # Episodes go forward: keep this epoch and the one before (episodes straddling
            # the boundary), not every epoch's order.
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = order
        return self._orders[epoch]


class Dataset:
    """Rows plus their order: `item(g)` is episode g's row, `position(g)` where it is.
    `name` is what errors call it (the config key, "data.train")."""

    def __init__(self, rows: list[dict[str, Any]], order: DataOrder, name: str = "the data",
                 lines: list[int] | None = None) -> None:
        self.rows, self.order, self.name = rows, order, name
        self.lines = lines  # each row's line in a JSON-lines file; None: rows counted from 1
        self._fingerprint: str | None = None
        self._columns: set[str] | None = None

    @classmethod
    def from_path(cls, path: str | Path, seed: int, shuffle: bool = True, epochs: int = 0,
                  name: str = "the data") -> "Dataset":
        rows, lines = read_rows(path)
        return cls(rows, DataOrder(len(rows), seed, shuffle, epochs), name, lines)

    def place(self, index: int) -> str:
        """Where the row of index `index` is, as the file counts: "line 8" of a JSON-lines
        file (blank lines counted), "row 3" (from 1) of anything else."""
        return f"line {self.lines[index]}" if self.lines is not None else f"row {index + 1}"

    def position(self, g: int) -> DataPosition:
        return self.order.position(g)

    def item(self, g: int) -> Row:
        index = self.order.position(g).index
        return Row(self.rows[index], index, self)

    def columns(self) -> set[str]:
        """Every key any row has."""
        if self._columns is None:
            self._columns = {key for row in self.rows for key in row}
        return self._columns

    def fingerprint(self) -> str:
        """A digest of the rows, in file order: a resume checks it is the same data."""
        if self._fingerprint is None:
            text = json.dumps(self.rows, sort_keys=True, default=str)
            self._fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._fingerprint

    def check_serves(self, episodes: int, what: str) -> None:
        capacity = self.order.capacity()
        if capacity is not None and episodes > capacity:
            raise DataError(f"{what} needs {episodes} episodes but the data serves {capacity} "
                            f"({self.order.n} rows x {self.order.epochs} epochs): raise data.epochs "
                            f"(0 = as many as needed) or shorten the run")
