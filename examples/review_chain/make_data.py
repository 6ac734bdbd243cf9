"""Writes the review chain's dataset: every sum of two numbers in 0..9, shuffled once,
80 rows to data/train.jsonl and 20 held-out rows to data/eval.jsonl.

    python examples/review_chain/make_data.py

The files are committed; running this again writes the same bytes.
"""

import json

from review_task import DATA, EVAL_FILE, TRAIN_FILE, split_rows


def main() -> None:
    DATA.mkdir(exist_ok=True)
    train, held_out = split_rows()
    for path, rows in ((TRAIN_FILE, train), (EVAL_FILE, held_out)):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main()
