"""Type-check controller/, runtime/ and workers/ with mypy, configured in pyproject.toml.

The three folders are installed as `flexmarl.controller`, `flexmarl.runtime` and
`flexmarl.workers` (pyproject's package-dir mapping), and the code imports them by those
names. mypy cannot read setuptools' editable-install finder, so this script lays the same
mapping out as links under .mypy_cache/src/flexmarl/ (git-ignored, beside mypy's cache)
and points mypy there; the messages name the files by their paths in this checkout.

    .venv/bin/python scripts/typecheck.py      # exit 0: no type errors
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("controller", "runtime", "workers")
LINKS = ROOT / ".mypy_cache" / "src" / "flexmarl"


def lay_out_links() -> None:
    LINKS.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = LINKS / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)


def main() -> int:
    lay_out_links()
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "MYPY_FORCE_COLOR": "0"})
    prefix = os.path.relpath(LINKS, ROOT) + os.sep
    sys.stdout.write((done.stdout + done.stderr).replace(prefix, ""))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
