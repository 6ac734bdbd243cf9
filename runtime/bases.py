"""Agents as LoRA adapters of a shared base model: what a job's bases need.

A job may declare bases (`[bases.NAME]`, a model and its engine and trainer settings) and
agents that are adapters of one (`agents.X.base = "NAME"` with their LoRA shape). One
rollout engine loads a base once and serves every adapter agent of it; each request names
its agent's adapter at the version it was issued under, and a version stays loaded while a
request uses it, so an engine holds up to K + 1 versions of each agent (K the staleness
bound; 0 in sync mode), or one of a trained agent whose requests move to each new version
(`pipeline.in_flight` "keep" or "recompute"). That sum is the engine's `max_loras`,
computed here; a base whose `max_loras` is set lower cannot run the job and is refused at
start.

Plain arithmetic over the configuration (no torch, no vLLM), above config.py: what a job
needs of a base (`required_slots`, the LoRA ranks vLLM accepts, which keys an adapter
takes from its base) lives there, beside the checks of `ExperimentConfig.validate` that
use it; this module derives what the controller and the bench use from a valid config.
It knows nothing of how an engine or a trainer holds adapters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .config import AgentConfig, ExperimentConfig, LoraSlots, required_slots
from .protocol import EngineSettings, LoadModel, LoraSettings, TrainerSettings


def lora_settings(agent: AgentConfig) -> LoraSettings:
    """An adapter agent's LoRA shape as the wire carries it."""
    return LoraSettings(agent.lora_rank, float(agent.lora_alpha), float(agent.lora_dropout),
                        tuple(agent.lora_target_modules))


def lora_slots(cfg: ExperimentConfig, base: str) -> LoraSlots:
    """The slots an engine of `base` is started with: the base's own settings where given,
    else what the job needs. `check_bases` has refused a setting below the need."""
    need, given = required_slots(cfg, base), cfg.bases[base]
    loras = given.max_loras or need.max_loras
    return LoraSlots(loras, given.max_lora_rank or need.max_lora_rank, max(given.max_cpu_loras, loras))


def engine_settings(cfg: ExperimentConfig, base: str) -> EngineSettings:
    """How a rollout engine runs `base` with its adapters (sent in LoadModel)."""
    b, slots = cfg.bases[base], lora_slots(cfg, base)
    return EngineSettings(b.dtype, b.gpu_memory_utilization, b.tensor_parallel_size,
                          max_loras=slots.max_loras, max_lora_rank=slots.max_lora_rank,
                          max_cpu_loras=slots.max_cpu_loras, block_size=b.block_size)


def trainer_settings(cfg: ExperimentConfig, agent: str) -> TrainerSettings:
    """How a trainer holds `agent`: its base's settings for an adapter agent."""
    a = cfg.agents[agent]
    if not a.base:
        return a.trainer_settings()
    b = cfg.bases[a.base]
    return TrainerSettings(b.dtype, b.train_precision, b.activation_checkpointing, compile_layers=b.compile_layers)


@dataclass(frozen=True)
class EngineUnit:
    """What one rollout engine serves, one value made once from the config (`engine_units`):
    a whole-model agent alone (named as the agent), or every adapter agent of a base (named
    `bases.NAME`). Loading a whole model replaces what an instance holds; loading an
    adapter adds to it."""

    name: str
    agents: tuple[str, ...]
    lora: bool = False  # adapters of a base (an engine with LoRA slots) or a whole model
    ranks: int = 1  # workers of each engine (tensor parallelism): a weight sync's receivers
    max_model_len: int = 0
    settings: EngineSettings = EngineSettings()

    def load_message(self, request_id: int, model_path: str, seed: int, version: int = 0,
                     checksums: dict[str, str] | None = None) -> LoadModel:
        """What starts an engine of this unit on `model_path` at `version` (`checksums`:
        the files' SHA-256s where they are a checkpoint's, which the worker checks)."""
        return LoadModel(request_id, self.name, model_path, version, seed=seed, max_model_len=self.max_model_len,
                         engine=self.settings, checksums=checksums or {})


class Units(Mapping[str, EngineUnit]):
    """A job's engine units by name, in config order, with each agent's unit and LoRA
    shape: one value for what placement, admission, weight syncs and balancing ask."""

    def __init__(self, units: dict[str, EngineUnit], lora: dict[str, LoraSettings | None] | None = None) -> None:
        self._units = dict(units)
        self._of = {a: u for u in self._units.values() for a in u.agents}
        self._lora = lora or {}

    def __getitem__(self, name: str) -> EngineUnit:
        return self._units[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._units)

    def __len__(self) -> int:
        return len(self._units)

    def of(self, agent: str) -> EngineUnit:
        """The unit whose engines serve `agent`."""
        return self._of[agent]

    def lora(self, agent: str) -> LoraSettings | None:
        """An adapter agent's LoRA shape; None for a whole-model agent."""
        return self._lora.get(agent)


def whole_models(agents: list[str]) -> Units:
    """A unit per agent, each a whole model with default settings (tests, simple wiring)."""
    return Units({a: EngineUnit(a, (a,)) for a in agents})


def engine_units(cfg: ExperimentConfig) -> Units:
    """Every engine unit of the job, in config order. Placement, rejoin and balancing give
    instances to these units; an instance of a base serves all of its agents at once, so
    instances never move between agents of one base."""
    units: dict[str, list[str]] = {}
    for name, agent in cfg.agents.items():
        units.setdefault(f"bases.{agent.base}" if agent.base else name, []).append(name)
    made = {}
    for name, agents in units.items():
        a = cfg.agents[agents[0]]
        if a.base:
            made[name] = EngineUnit(name, tuple(agents), True, cfg.bases[a.base].tensor_parallel_size,
                                    cfg.bases[a.base].max_model_len, engine_settings(cfg, a.base))
        else:
            made[name] = EngineUnit(name, (name,), False, a.tensor_parallel_size, a.max_model_len, a.engine_settings())
    return Units(made, {a: agent_lora(cfg, a) for a in cfg.agents})


def model_of(cfg: ExperimentConfig, agent: str) -> str:
    """The model an agent's engine and trainer load: its own, or its base's."""
    a = cfg.agents[agent]
    return cfg.bases[a.base].model if a.base else a.model


def engine_ranks(cfg: ExperimentConfig, agent: str) -> int:
    """The ranks (workers) of each engine that serves `agent`: its tensor parallelism, or
    its base's."""
    a = cfg.agents[agent]
    return cfg.bases[a.base].tensor_parallel_size if a.base else a.tensor_parallel_size


def agent_lora(cfg: ExperimentConfig, agent: str) -> LoraSettings | None:
    """An adapter agent's LoRA shape; None for a whole-model agent."""
    a = cfg.agents[agent]
    return lora_settings(a) if a.base else None
