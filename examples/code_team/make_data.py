"""Writes data/train.jsonl and data/eval.jsonl (committed): every spec, a fixed sixth of
them held out for evaluation (never trained).

    python examples/code_team/make_data.py
"""

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from code_tasks import all_specs  # noqa: E402


def main() -> None:
    specs = all_specs()
    random.Random("code-team-split").shuffle(specs)
    held = len(specs) // 6
    for name, rows in (("eval", specs[:held]), ("train", specs[held:])):
        with open(HERE / "data" / f"{name}.jsonl", "w") as fh:
            for op, d in sorted(rows):
                fh.write(json.dumps({"op": op, "d": d}) + "\n")


if __name__ == "__main__":
    main()
