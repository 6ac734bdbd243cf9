"""An adapter agent's `lora_target_modules` checked against its base before anything builds
or loads it: every name must be a module of the base (PEFT's rule for a list of names: a
module whose dotted name is the name, or ends with "." and the name).

The base's module names come from its weights' names: a directory's are read from its
weights files' headers (safetensors: an 8-byte length and a JSON table of tensor names), so
the controller needs neither torch nor the weights in memory; a tiny model's recipe says
its own (model_resolution.tensor_names), so a wrong target fails before its base is built.
A base whose weights are in another format is not checked here; the trainer's PEFT then
says what is wrong.

It knows nothing of how an adapter is built or trained.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from flexmarl.runtime.config import ConfigError

_INDEX = "model.safetensors.index.json"


def model_tensor_names(model_dir: str | Path) -> list[str] | None:
    """The names of the tensors in a model directory's safetensors files; None when it
    has none (other formats) or they cannot be read."""
    model_dir = Path(model_dir)
    try:
        if (model_dir / _INDEX).is_file():
            return list(json.loads((model_dir / _INDEX).read_text())["weight_map"])
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            return None
        return [name for f in files for name in _header(f) if name != "__metadata__"]
    except (OSError, ValueError, KeyError, struct.error):
        return None


def _header(path: Path) -> dict:
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(length))


def unknown_targets(targets: list[str], tensors: list[str]) -> list[str]:
    """The names in `targets` that no module (a tensor's name without its last part) is
    called or ends with."""
    modules = {name.rsplit(".", 1)[0] for name in tensors if "." in name}
    return [t for t in targets if not any(m == t or m.endswith("." + t) for m in modules)]


def check_lora_targets(agent: str, targets: list[str], base: str, tensors: list[str] | None) -> None:
    """Raises ConfigError, in one line, when a target names no module of the base (named
    `base` in the message) whose weights are `tensors`; None: not known, not checked."""
    if tensors is None:
        return
    unknown = unknown_targets(targets, tensors)
    if unknown:
        leaves = sorted({name.rsplit(".", 2)[-2] for name in tensors if name.count(".") >= 1})
        raise ConfigError(f"agents.{agent}.lora_target_modules: {', '.join(map(repr, unknown))} "
                          f"{'names' if len(unknown) == 1 else 'name'} no module of its base {base} (the base's "
                          f"modules end in: {', '.join(leaves)}); name modules it has")
