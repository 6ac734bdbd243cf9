"""Importing a user's Python file as a module: a workflow file, a job's model recipes.

`import_file(path, prefix)` imports the file once per process under a stable name derived
from its absolute path, with its folder on sys.path so it can import its neighbours. A file
that fails while importing leaves nothing behind in sys.modules; the exception propagates.

It does not know what the file is for: callers turn errors into their own messages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(path: str | Path, prefix: str) -> ModuleType:
    path = Path(path).expanduser().resolve()
    name = f"{prefix}_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
