"""The controller's tests, in folders that mirror controller/'s packages, share the fakes
kept here (fake_rollout.py, openai_fakes.py): this folder is on the import path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
