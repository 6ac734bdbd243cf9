"""Agents as LoRA adapters of one frozen base model, as a trainer holds them (PEFT).

`SharedBase` loads a base model once and holds every adapter agent of it as a named PEFT
adapter of one `PeftModel`; the base's own weights are frozen and never copied. Each agent
is seen through an `AdapterModel`: an object with the surface the trainer uses of a whole
model (call it, `parameters()`, `named_parameters()`, `config`, `save_pretrained`), whose
parameters are the agent's adapter only. So a training state, a publish, a park and a
checkpoint of an adapter agent move its adapter (and its optimizer state) and nothing of
the base, and a micro-batch of agent A after one of agent B switches the active adapter,
never the base.

Parameter names are PEFT's file names (`...q_proj.lora_A.weight`, without the adapter's
name), so the published tensors are what `adapter_model.safetensors` holds and a receiver
writes them as they come (`write_adapter`): the directory then loads in
`peft.PeftModel.from_pretrained(base, dir)` and in vLLM's `LoRARequest`. A written adapter
names its base so that `AutoPeftModelForCausalLM.from_pretrained(dir)` finds it wherever
it is loaded from (`base_reference`).

It knows torch, transformers and peft; nothing of commands, agents' versions or the wire
beyond `LoraSettings`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from flexmarl.runtime.protocol import LoraSettings

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT warns about (and may mis-load) adapter names contained in its "lora_" prefix; the
# agent's name is kept inside one that never is.
_PREFIX = "agent_"


def lora_config(settings: LoraSettings, base_name: str, revision: str | None = None) -> Any:
    """The PEFT configuration of an adapter of this shape on the base named `base_name`
    (at `revision`, for a hub id)."""
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base_name, revision=revision)


def base_reference(base_path: str) -> tuple[str, str | None]:
    """How a written adapter names its base, and at what revision: a snapshot of a Hugging
    Face hub cache (`.../models--ORG--NAME/snapshots/REV`) by its hub id and revision,
    which any machine with the hub, or the model in its cache, resolves; any other local
    directory by its absolute path (for a base built from a recipe, the run's own copy,
    controller/run/run_bases.py), so PEFT finds it from any working directory; anything
    else (a hub id) as it is."""
    path = Path(base_path)
    if not path.is_dir():
        return str(base_path), None
    path = path.absolute()
    snapshots, repo = path.parent, path.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith("models--"):
        return repo.name[len("models--"):].replace("--", "/"), path.name
    return str(path), None


def write_adapter(directory: str | Path, tensors: dict[str, torch.Tensor], settings: LoraSettings,
                  base_path: str) -> int:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) from
    tensors under PEFT's file names; returns the bytes written."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lora_config(settings, *base_reference(base_path)).save_pretrained(str(directory))
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(directory / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    return sum(f.stat().st_size for f in (directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS))


def read_adapter(directory: str | Path) -> tuple[dict[str, torch.Tensor], LoraSettings]:
    """A PEFT adapter directory's tensors (under PEFT's file names) and its shape, as
    `write_adapter` (or PEFT itself) wrote them."""
    import json

    from safetensors.torch import load_file

    directory = Path(directory)
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(directory / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory} is no PEFT adapter directory ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}): "
                         f"{exc}") from None
    targets = config.get("target_modules") or []
    return tensors, LoraSettings(int(config["r"]), float(config.get("lora_alpha", config["r"])),
                                 float(config.get("lora_dropout", 0.0)),
                                 tuple(sorted(targets) if isinstance(targets, (list, set)) else [targets]))


class SharedBase:
    """One frozen base model and the adapters of the agents that share it."""

    def __init__(self, base_path: str, placement: Any) -> None:
        from transformers import AutoModelForCausalLM

        self.base_path = base_path
        self.placement = placement  # precision.TrainPlacement, shared by every adapter
        # Loaded from where it is here; a written adapter names it as base_reference says.
        self._base = AutoModelForCausalLM.from_pretrained(base_path, dtype=placement.param_dtype)
        self._base.requires_grad_(False)
        self.peft: Any = None  # the PeftModel, once the first adapter is added
        self.settings: dict[str, LoraSettings] = {}
        self.base_params = sum(p.numel() for p in self._base.parameters())

    @property
    def agents(self) -> list[str]:
        return list(self.settings)

    def add(self, agent: str, settings: LoraSettings, seed: int) -> AdapterModel:
        """A new adapter for `agent` (PEFT's initialisation: B = 0, so the agent starts as
        the base), seeded so the same seed gives the same A."""
        from peft import get_peft_model

        if agent in self.settings:
            raise ValueError(f"agent {agent!r} already has an adapter on the base {self.base_path}")
        torch.manual_seed(seed)
        config = lora_config(settings, self._base.name_or_path)  # as loaded: PEFT warns when the two differ
        if self.peft is None:
            self.peft = get_peft_model(self._base, config, adapter_name=_PREFIX + agent)
            self.placement.prepare(self.peft)
        else:
            self.peft.add_adapter(_PREFIX + agent, config)
            self.peft.to(self.placement.device)
            # PEFT makes only the adapter in use trainable: in use now, the new one's training
            # state (optimizer and gradients) is laid out with it, as the first one's is.
            self.activate(agent)
        self.settings[agent] = settings
        return AdapterModel(self, agent)

    def remove(self, agent: str) -> None:
        """Drop an agent's adapter; the base stays for the others."""
        self.settings.pop(agent)
        if self.settings:
            self.activate(next(iter(self.settings)))  # never delete the adapter in use
            self.peft.delete_adapter(_PREFIX + agent)

    def activate(self, agent: str) -> Any:
        """The PeftModel with `agent`'s adapter the one in use."""
        name = _PREFIX + agent
        if self.peft.active_adapter != name:
            self.peft.set_adapter(name)
        return self.peft

    def adapter_parameters(self, agent: str) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """`agent`'s adapter parameters under PEFT's file names (the adapter's name cut)."""
        name = _PREFIX + agent
        for full, param in self.peft.named_parameters():
            parts = full.split(".")
            cut = [i for i in range(1, len(parts)) if parts[i] == name and parts[i - 1].startswith("lora_")]
            if cut:
                yield ".".join(parts[:cut[0]] + parts[cut[0] + 1:]), param


class AdapterModel:
    """One adapter agent's view of its SharedBase: what the trainer treats as its model."""

    def __init__(self, base: SharedBase, agent: str) -> None:
        self.base = base
        self.agent = agent
        self.lora = base.settings[agent]

    @property
    def config(self) -> Any:
        return self.base._base.config

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.base._base, "is_gradient_checkpointing", False))

    # The causal LM's own signature (scoring looks for `past_key_values` to share prompts).
    def forward(self, input_ids: Any = None, attention_mask: Any = None, past_key_values: Any = None,
                **kwargs: Any) -> Any:
        return self.base.activate(self.agent)(input_ids=input_ids, attention_mask=attention_mask,
                                              past_key_values=past_key_values, **kwargs)

    __call__ = forward

    # The decoder and head apart, for scoring's packed pass (they carry the adapter's layers).
    def get_decoder(self) -> Any:
        return self.base.activate(self.agent).get_decoder()

    def get_output_embeddings(self) -> Any:
        return self.base.activate(self.agent).get_output_embeddings()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.base.adapter_parameters(self.agent)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def save_pretrained(self, directory: str | Path, **_: Any) -> None:
        """The adapter as a PEFT directory (what `PeftModel.from_pretrained` and vLLM load)."""
        write_adapter(directory, dict(self.named_parameters()), self.lora, self.base.base_path)

    def reference(self) -> AdapterReference:
        """The base without any adapter: the agent's initial policy (B = 0), for a KL term."""
        return AdapterReference(self.base)


class AdapterReference:
    """The frozen base alone, computed with every adapter switched off."""

    def __init__(self, base: SharedBase) -> None:
        self.base = base
        self.config = base._base.config

    def forward(self, input_ids: Any = None, attention_mask: Any = None, past_key_values: Any = None,
                **kwargs: Any) -> Any:
        with self.base.peft.disable_adapter():
            return self.base.peft(input_ids=input_ids, attention_mask=attention_mask,
                                  past_key_values=past_key_values, **kwargs)

    __call__ = forward

    def get_decoder(self) -> Any:
        return self.base.peft.get_decoder()

    def get_output_embeddings(self) -> Any:
        head = self.base.peft.get_output_embeddings()

        def base_head(states: torch.Tensor) -> torch.Tensor:  # an adapter on the head is off too
            with self.base.peft.disable_adapter():
                return head(states)

        return base_head

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.base._base.parameters()
