"""The workers' tests share what is kept here (train_batches.py): this folder is on the import path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
