"""`cluster.launcher` -> what makes the launcher `flexmarl run` starts its workers with.

A table apart from launcher.py (the interface, the local launcher and the restart policy)
because the Ray launcher builds on launcher.py: kept here, the table names both without
launcher.py depending on the Ray launcher. Ray is imported only where it is asked for.
"""

from __future__ import annotations

from typing import Callable

from flexmarl.runtime.config import ExperimentConfig

from .launcher import Launcher, LocalLauncher


def _ray_launcher(config: ExperimentConfig) -> Launcher:
    from .ray_launcher import RayLauncher  # Ray is imported only where it is asked for

    return RayLauncher(config)


# Ray's launcher connects to its cluster when made, before anything starts.
LAUNCHERS: dict[str, Callable[[ExperimentConfig], Launcher]] = {"local": LocalLauncher, "ray": _ray_launcher}
