"""The bench tests share what is kept here (bench_runs.py): this folder is on the import path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
