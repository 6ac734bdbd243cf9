"""Process start-up shared by the controller and workers: uvloop, one thread, logging."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


def limit_threads(n: int = 1) -> None:
    """One compute thread per process: on small machines processes otherwise fight
    over cores and everything slows down many-fold."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(n)


def setup_logging(level: str = "INFO", name: str = "") -> None:
    fmt = f"%(asctime)s %(levelname).1s {name or '%(name)s'} %(message)s"
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr, force=True)


def run_async(main: Callable[[], Awaitable[T]]) -> T:
    """Runs `main()` on uvloop (plain asyncio where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
