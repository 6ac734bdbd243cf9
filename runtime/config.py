"""Typed configuration: one small dataclass per component, loaded from TOML.

`load_config(path, overrides)` reads a TOML file (or the defaults), applies command-line
overrides written as ``section.key=value`` and checks every key and type. An error names
the offending key and what would have been accepted, so a typo never silently falls back
to a default.

This module knows the shape of the configuration, not what any component does with it.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from .protocol import (
    EngineSettings,
    LossAggregation,
    LossOptions,
    ModelDtype,
    OffPolicyCorrection,
    TrainerSettings,
    TrainPrecision,
)


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


@dataclass
class TransportConfig:
    # tcp://HOST:PORT; port 0 picks a free port (the chosen address is logged and written
    # to the run directory). Any host but loopback requires CURVE keys in `curve_dir`.
    address: str = "tcp://127.0.0.1:0"
    heartbeat_interval_s: float = 1.0
    # A peer silent for this long is declared dead. Generous because workers run heavy
    # compute on 2-core machines; the liveness check only needs to beat a real crash.
    heartbeat_timeout_s: float = 10.0
    handshake_timeout_s: float = 30.0
    # A worker whose controller went away (silent, or not reading) tries to register again,
    # with backoff, for this long before it exits; 0: it exits at once (exit code 3).
    # Workers that `flexmarl run` starts itself never reconnect: a new controller starts
    # its own.
    reconnect_timeout_s: float = 60.0
    max_message_bytes: int = 64 * 1024 * 1024
    curve_dir: str = ""  # holds server.key(_secret) and client.key(_secret); see `flexmarl keys`


# Who starts the workers of `flexmarl run`: "local" makes them child processes of the
# controller on this host; "ray" makes each one a Ray actor on a Ray cluster (see RayConfig).
Launcher = Literal["local", "ray"]
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]  # Ray's names


@dataclass
class ClusterConfig:
    launcher: Launcher = "local"
    rollout_workers: int = 3
    trainer_workers: int = 1
    # Agents resident at once per trainer; 0 = no limit. Below the number of agents per
    # trainer, idle agents' training states are parked in host memory and swapped back in.
    trainer_capacity: int = 0
    worker_start_timeout_s: float = 300.0
    shutdown_timeout_s: float = 15.0
    threads_per_worker: int = 1
    # A worker process that exits while the run goes on (or whose Ray actor or node is
    # lost) is started again (same id, same role, same log) up to this many times; past that the run stops with its exit
    # code and log. The first restart waits `restart_backoff_s`, each further one twice as
    # long (at most 30 s).
    max_restarts: int = 3
    restart_backoff_s: float = 1.0
    # GPUs per worker, by worker index, as CUDA device numbers of this host: the launcher
    # pins each started worker to its list (CUDA_VISIBLE_DEVICES). Empty: not pinned, each
    # worker sees what its environment shows it. Rollout worker i gets rollout_gpus[i]
    # (at least the largest tensor_parallel_size of the agents); trainer worker i gets
    # trainer_gpus[i], one GPU per rank of its group.
    rollout_gpus: list[list[int]] = field(default_factory=list)
    trainer_gpus: list[list[int]] = field(default_factory=list)
    # Processes per trainer worker: >1 makes each trainer a group of ranks that shard every
    # agent's training state with FSDP2 and split each micro-batch's samples between them;
    # the controller still sees one trainer. 1: one process holds whole models.
    trainer_group_size: int = 1

    def validate_gpus(self, tensor_parallel_size: int) -> None:
        """Each GPU list fits its worker: one per worker, no GPU twice within a worker, as
        many GPUs as the worker's ranks (trainer) or its widest engine (rollout)."""
        if self.trainer_group_size < 1:
            raise ConfigError(f"cluster.trainer_group_size must be >= 1, got {self.trainer_group_size}")
        for key, lists, workers, needed, what in (
                ("rollout_gpus", self.rollout_gpus, self.rollout_workers, tensor_parallel_size,
                 "the largest agents.*.tensor_parallel_size"),
                ("trainer_gpus", self.trainer_gpus, self.trainer_workers, self.trainer_group_size,
                 "cluster.trainer_group_size, one GPU per rank")):
            if not lists:
                continue
            if len(lists) != workers:
                raise ConfigError(f"cluster.{key} has {len(lists)} GPU lists for {workers} workers; give one "
                                  f"list per worker (e.g. [[0], [1]]) or none to leave workers unpinned")
            for i, gpus in enumerate(lists):
                if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
                    raise ConfigError(f"cluster.{key}[{i}] = {gpus}: GPU numbers must be >= 0 and distinct")
                if key == "rollout_gpus" and len(gpus) < needed or key == "trainer_gpus" and len(gpus) != needed:
                    raise ConfigError(f"cluster.{key}[{i}] = {gpus} has {len(gpus)} GPUs; it needs "
                                      f"{'at least ' if key == 'rollout_gpus' else ''}{needed} ({what})")


@dataclass
class RayConfig:
    """Where `cluster.launcher = "ray"` starts the workers: each is a Ray actor that runs the
    same `flexmarl worker` process, with the CPUs and GPUs it needs, in one placement group
    for the run."""

    # The Ray cluster to join: "auto" is the one `ray start` made on this host (or
    # RAY_ADDRESS); otherwise its GCS address, HOST:PORT. `flexmarl run` must run on a node
    # of the cluster (the workers connect back to it).
    address: str = "auto"
    # How Ray lays the workers' bundles out over its nodes. Workers that share a GPU
    # (cluster.*_gpus) are one bundle, so they always land on one node.
    placement_strategy: PlacementStrategy = "PACK"
    # How long to wait for the cluster to find room for every worker at the start (an
    # autoscaling cluster adds nodes meanwhile); past it, the run stops before any worker starts.
    placement_timeout_s: float = 60.0
    # With empty cluster.*_gpus lists: true gives each worker GPUs of its own from its agents'
    # settings (a rollout worker the largest tensor_parallel_size, a trainer
    # cluster.trainer_group_size); false runs the workers on CPUs.
    use_gpus: bool = False


@dataclass
class BaseConfig:
    """A model several agents share as LoRA adapters of it (`agents.*.base`): loaded once
    per rollout instance and once per trainer. The engine and trainer settings of its
    adapter agents are these; runtime/bases.py derives the engine's LoRA slots."""

    model: str = ""  # a built-in tiny model name, or a path to a Hugging Face model dir
    max_model_len: int = 0  # as agents.*.max_model_len
    dtype: ModelDtype = "auto"
    train_precision: TrainPrecision = "mixed"
    activation_checkpointing: bool = False
    compile_layers: bool = False  # as agents.*.compile_layers
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    block_size: int = 0  # as agents.*.block_size
    # Adapters one engine batch may mix. 0: what the job needs, each adapter agent of this
    # base times (pipeline.max_staleness + 1) versions resident at once; a number below
    # that (what a GPU's memory allows, say) refuses the job at start.
    max_loras: int = 0
    max_cpu_loras: int = 0  # adapters an engine holds; 0: max_loras
    max_lora_rank: int = 0  # 0: the smallest rank vLLM accepts that covers every agent's


@dataclass
class AgentConfig:
    model: str = ""  # a built-in tiny model name, or a path to a Hugging Face model dir
    # An agent that is a LoRA adapter of `bases.<base>` (then `model` stays empty and the
    # base's model, dtype and engine settings are the agent's). PEFT's names: rank r,
    # scale alpha / r, dropout on the adapter's input, the modules it adapts.
    base: str = ""
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    group_size: int = 4  # samples per prompt (n); advantages are normalised in a group
    max_tokens: int = 8
    temperature: float = 1.0
    lr: float = 2e-3
    max_grad_norm: float = 1.0
    # Sampling (every ctx.generate / ctx.chat call may override these).
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    stop: list[str] = field(default_factory=list)  # generation ends at these strings (cut from sample.text)
    stop_token_ids: list[int] = field(default_factory=list)  # ... or at these tokens
    ignore_eos: bool = False  # true: always write max_tokens tokens (fixed-length outputs)
    max_model_len: int = 0  # the engine's context length (prompt + output); 0: 64 on CPU, the model's own on CUDA
    # The loss (protocol.LossOptions says what each name means). Defaults: plain GRPO.
    loss_agg: LossAggregation = "seq_mean"  # "seq_mean" | "token_mean" | "constant"
    loss_constant: float = 0.0  # divisor of "constant" aggregation; 0 means max_tokens
    normalize_adv_std: bool = True  # advantages divided by their group's std (off: Dr. GRPO)
    # Correction when max_staleness > 0: "tis" | "ppo_clip" | "token_mis" | "seq_mis" |
    # "gspo" | "cispo" (protocol.OffPolicyCorrection says what each does). TIS's cap is
    # pipeline.clip_ratio; the others' constants are these:
    off_policy: OffPolicyCorrection = "tis"
    clip_eps: float = 0.2  # ppo_clip: the ratio clipped to [1 - clip_eps, 1 + clip_eps]
    dual_clip: float = 0.0  # ppo_clip: > 1 turns on dual-clip with this constant; 0 off
    is_low: float = 0.5  # token_mis / seq_mis: ratios outside [is_low, is_high] are masked
    is_high: float = 2.0
    gspo_eps_low: float = 3e-4  # gspo: sequence ratio clipped to [1 - low, 1 + high]
    gspo_eps_high: float = 4e-4
    cispo_eps_high: float = 2.0  # cispo: detached weight clipped to [0, 1 + cispo_eps_high]
    kl_coef: float = 0.0  # KL penalty towards the initial weights; 0: none
    # Devices and precision. "auto" dtype: bfloat16 where the worker has CUDA, float32 on CPU;
    # the rollout engine runs in it and the trainer computes in it.
    dtype: ModelDtype = "auto"
    train_precision: TrainPrecision = "mixed"  # "mixed": float32 weights + optimizer state; "pure": all in dtype
    activation_checkpointing: bool = False  # trainer recomputes activations in backward (less memory)
    compile_layers: bool = False  # trainer torch.compiles the decoder's norms and MLPs (fused elementwise work)
    gpu_memory_utilization: float = 0.9  # CUDA rollout engines: share of the GPU vLLM may claim
    tensor_parallel_size: int = 1  # ranks one rollout engine spans (vLLM's tensor parallelism): GPUs, or CPU cores
    # Tokens per KV-cache block of the rollout engine; its prefix cache (a later turn reusing
    # its conversation, a group's samples their prompt) reuses whole blocks only. 0: the
    # device's default (128 on CPU, where 32 is the least; 16 on CUDA).
    block_size: int = 0
    # The vLLM tool parser ("hermes", "llama3_json", ...) that turns this agent's replies on
    # the OpenAI endpoint into `tool_calls` when a call passes `tools`; "": replies stay text.
    tool_parser: str = ""

    def engine_settings(self) -> EngineSettings:
        """How a rollout engine runs this agent's model (sent in LoadModel)."""
        return EngineSettings(self.dtype, self.gpu_memory_utilization, self.tensor_parallel_size,
                              block_size=self.block_size)

    def trainer_settings(self) -> TrainerSettings:
        """How a trainer holds this agent (sent in InitAgent and LoadAgent)."""
        return TrainerSettings(self.dtype, self.train_precision, self.activation_checkpointing,
                               compile_layers=self.compile_layers)

    def loss_options(self) -> LossOptions:
        """The loss settings the trainer is sent with each of this agent's micro-batches."""
        return LossOptions(self.loss_agg, self.loss_constant or float(self.max_tokens), self.off_policy,
                           self.kl_coef, self.clip_eps, self.dual_clip, self.is_low, self.is_high,
                           self.gspo_eps_low, self.gspo_eps_high, self.cispo_eps_high)

    def loss_problem(self) -> str:
        """What is wrong with the correction constants, or ""."""
        if not 0 < self.clip_eps < 1:
            return f"clip_eps must be in (0, 1), got {self.clip_eps} (PPO clips the ratio to [1 - eps, 1 + eps])"
        if self.dual_clip != 0 and self.dual_clip <= 1:
            return f"dual_clip must be 0 (off) or > 1, got {self.dual_clip}"
        if not 0 <= self.is_low < 1 < self.is_high:
            return f"is_low and is_high must satisfy 0 <= is_low < 1 < is_high, got {self.is_low}, {self.is_high}"
        if not (0 < self.gspo_eps_low < 1 and self.gspo_eps_high > 0 and self.cispo_eps_high > 0):
            return "gspo_eps_low must be in (0, 1), gspo_eps_high and cispo_eps_high > 0"
        return ""


@dataclass
class PipelineConfig:
    mode: str = "sync"  # "sync" | "async"
    max_staleness: int = 0
    queries_per_step: int = 8  # episodes per global batch (every agent steps once per batch)
    micro_batch: int = 16  # samples per micro-batch, per agent
    # Above 0: micro-batches are cut by this many tokens instead (a group's prompt once plus
    # every output, as the trainer computes them), so each takes about the same memory and
    # time whatever lengths the policy writes; micro_batch is then unused. Whole groups
    # either way: a group larger than the budget is a micro-batch of its own.
    micro_batch_tokens: int = 0
    max_concurrent_episodes: int = 16
    episode_timeout_s: float = 120.0
    # ctx.call: blocking tool, environment and reward functions run in a pool this big,
    # each limited to tool_timeout_s unless the call says otherwise.
    tool_threads: int = 4
    tool_timeout_s: float = 60.0
    # A step whose gradient is not finite is skipped (weights unchanged, an event, a count
    # in metrics); this many skipped steps of one agent in a row stop the run.
    max_skipped_steps: int = 3
    # TIS's truncation cap (agents' off_policy = "tis"): the importance weight is min(ratio,
    # clip_ratio). Only TIS reads it; PPO's clip range is agents.*.clip_eps.
    clip_ratio: float = 2.0
    # A run that cannot learn stops (exit status 1, the first failure's traceback shown):
    # when more than this share of a step's episodes fail (1.0: never), or when an agent
    # gets no trainable sample in a step (unless allow_empty_steps: a workflow that calls
    # some agent only now and then).
    max_failed_share: float = 0.5
    allow_empty_steps: bool = False


@dataclass
class RouterConfig:
    # Level 2 (within an agent): "least_loaded" sends each group (the n samples of one
    # prompt) whole to the less loaded of two instances drawn at random; "round_robin" is
    # the static baseline.
    within_agent: str = "least_loaded"
    # A group larger than an instance's fair share of its agent's work is split over
    # instances in contiguous parts of at least this many samples (each part prefills the
    # prompt again).
    min_part: int = 16
    # A later turn of a conversation goes back to the instance of the turn before (its
    # prefix cache holds the conversation) while that instance's outstanding work is at
    # most this many times the alternative's; 0: by load alone.
    affinity_bound: float = 2.0
    # Level 1 (across agents): move rollout instances between agents from measured demand.
    across_agents: bool = False
    disparity_threshold: float = 5.0  # per-instance demand ratio that triggers a move
    patience: int = 3  # consecutive observations above the threshold before moving
    cooldown_s: float = 5.0  # after a move, no other move for this long (no thrashing)
    interval_s: float = 0.5  # how often demand is observed


def block_size_problem(block_size: int) -> str:
    """What is wrong with an engine's KV-cache block size, or ""."""
    if block_size < 0 or block_size % 16:
        return (f"block_size must be 0 (the device's default) or a multiple of 16 (vLLM's CPU backend takes "
                f"multiples of 32), got {block_size}")
    return ""


# Why pure float16 training is refused (here and by the trainer itself).
PURE_FLOAT16_WHY = ("Adam's eps (1e-8) is 0 in float16, so the first step divides by zero and writes NaN "
                    "into every weight that had no gradient; use dtype = \"bfloat16\", or "
                    "train_precision = \"mixed\" (float32 weights and optimizer state)")

TRACKERS = ("tensorboard", "wandb")  # metrics destinations besides metrics.jsonl


@dataclass
class RunConfig:
    workflow: str = "digit_chain"
    steps: int = 20
    seed: int = 0
    out: str = ""  # run directory; empty -> runs/<timestamp>
    # A checkpoint (weights, optimizer state, controller state; what --resume continues
    # from) after every this many steps, and always after the last; 0 -> only at the end.
    checkpoint_every: int = 10
    keep_checkpoints: int = 3  # the newest this many are kept (and checkpoints/final)
    env_latency_ms: float = 0.0  # mean latency of the simulated environment/tool call
    progress: bool = True
    event_log: bool = True  # RUN_DIR/events.log; off only to measure its overhead
    # Where metrics rows go besides metrics.jsonl: any of TRACKERS. W&B runs offline unless
    # WANDB_MODE says otherwise (its files land in RUN_DIR/wandb; `wandb sync` uploads them).
    trackers: list[str] = field(default_factory=list)
    wandb_project: str = "flexmarl"
    # Every optimizer step writes this many of each agent's trained samples, as text (each
    # turn, its policy version, the reward; best and worst first), to RUN_DIR/samples.jsonl
    # and the trackers; `flexmarl samples RUN_DIR` prints them. 0: none.
    samples_per_step: int = 0


@dataclass
class DataConfig:
    # Rows a user's episodes receive as `ctx.item`: a .jsonl / .json / .parquet / .csv file
    # or a directory written by `datasets.Dataset.save_to_disk`. Empty: no dataset (the
    # workflow makes its own queries, like the built-in digit chain).
    train: str = ""
    eval: str = ""  # held-out rows for [eval]; never trained
    shuffle: bool = True  # a new order every epoch, from run.seed
    epochs: int = 0  # 0: as many passes as the run needs


@dataclass
class EvalConfig:
    every: int = 0  # evaluate after every N optimizer steps (0: never)
    episodes: int = 16  # held-out episodes per evaluation (eval rows, cycled)
    temperature: float = 0.0  # greedy by default
    at_start: bool = False  # also evaluate the initial weights


@dataclass
class OpenAIConfig:
    # The run's OpenAI-compatible endpoint (controller/serving/openai_api.py): `model` names an
    # agent, the API key names an episode. Off unless enabled.
    enabled: bool = False
    host: str = "127.0.0.1"  # any host but loopback requires a key (key_env)
    port: int = 0  # 0 picks a free port (logged, and written to RUN_DIR/openai.url)
    # The environment variable holding the endpoint's key. Off loopback it is required:
    # episode keys are it plus the episode's id, and `flexmarl serve` accepts it alone.
    key_env: str = "FLEXMARL_OPENAI_KEY"
    max_request_bytes: int = 8 * 1024 * 1024  # a larger request body is refused (413)


@dataclass
class ExperimentConfig:
    run: RunConfig = field(default_factory=RunConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    openai: OpenAIConfig = field(default_factory=OpenAIConfig)
    bases: dict[str, BaseConfig] = field(default_factory=dict)
    agents: dict[str, AgentConfig] = field(default_factory=dict)

    def widest_engine(self) -> int:
        """The ranks of the widest rollout engine: its agents' largest tensor_parallel_size."""
        return max([a.tensor_parallel_size for a in self.agents.values()]
                   + [b.tensor_parallel_size for b in self.bases.values()], default=1)

    def validate(self) -> "ExperimentConfig":
        if self.run.steps < 1:
            raise ConfigError(f"run.steps must be >= 1, got {self.run.steps}: a run of no optimizer step "
                              "trains nothing")
        if self.pipeline.mode not in ("sync", "async"):
            raise ConfigError(f"pipeline.mode must be 'sync' or 'async', got {self.pipeline.mode!r}")
        if self.pipeline.max_staleness < 0:
            raise ConfigError("pipeline.max_staleness must be >= 0")
        if self.pipeline.max_skipped_steps < 1:
            raise ConfigError(f"pipeline.max_skipped_steps must be >= 1, got {self.pipeline.max_skipped_steps}")
        if self.pipeline.clip_ratio <= 1:
            raise ConfigError(f"pipeline.clip_ratio (TIS's cap on the importance weight) must be > 1, "
                              f"got {self.pipeline.clip_ratio}")
        if self.pipeline.micro_batch < 1 or self.pipeline.queries_per_step < 1:
            raise ConfigError("pipeline.micro_batch and pipeline.queries_per_step must be >= 1")
        if self.pipeline.micro_batch_tokens < 0:
            raise ConfigError(f"pipeline.micro_batch_tokens must be >= 0 (0: micro-batches counted in samples, "
                              f"pipeline.micro_batch), got {self.pipeline.micro_batch_tokens}")
        if not 0.0 <= self.pipeline.max_failed_share <= 1.0:
            raise ConfigError(f"pipeline.max_failed_share must be in [0, 1] (1: never stop for failed "
                              f"episodes), got {self.pipeline.max_failed_share}")
        if self.cluster.rollout_workers < 1 or self.cluster.trainer_workers < 1:
            raise ConfigError("cluster needs at least one rollout and one trainer worker")
        for name, agent in self.agents.items():
            if agent.group_size < 2:
                raise ConfigError(f"agents.{name}.group_size must be >= 2, got {agent.group_size}: advantages "
                                  f"are rewards relative to the other samples of the same prompt, so a "
                                  f"group of 1 has all-zero advantages and nothing would be learned")
            if agent.max_tokens < 1:
                raise ConfigError(f"agents.{name}.max_tokens must be >= 1")
            if agent.kl_coef < 0 or agent.loss_constant < 0:
                raise ConfigError(f"agents.{name}: kl_coef and loss_constant must be >= 0")
            if agent.loss_problem():
                raise ConfigError(f"agents.{name}.{agent.loss_problem()}")
            if not 0 < agent.gpu_memory_utilization <= 1:
                raise ConfigError(f"agents.{name}.gpu_memory_utilization must be in (0, 1], got "
                                  f"{agent.gpu_memory_utilization}: it is the share of a GPU's memory "
                                  "the rollout engine may claim")
            if agent.dtype == "float16" and agent.train_precision == "pure":
                raise ConfigError(f"agents.{name}: dtype float16 with train_precision 'pure' cannot train: "
                                  f"{PURE_FLOAT16_WHY}")
            if agent.tensor_parallel_size < 1 or agent.max_model_len < 0:
                raise ConfigError(f"agents.{name}: tensor_parallel_size must be >= 1 and max_model_len >= 0 "
                                  "(0: the engine's default)")
            if block_size_problem(agent.block_size):
                raise ConfigError(f"agents.{name}.{block_size_problem(agent.block_size)}")
        check_bases(self)
        self.cluster.validate_gpus(self.widest_engine())
        if self.run.samples_per_step < 0:
            raise ConfigError("run.samples_per_step must be >= 0 (0: no samples written)")
        if self.run.checkpoint_every < 0 or self.run.keep_checkpoints < 1:
            raise ConfigError("run.checkpoint_every must be >= 0 and run.keep_checkpoints >= 1")
        if self.data.epochs < 0 or self.eval.every < 0 or self.eval.episodes < 1:
            raise ConfigError("data.epochs and eval.every must be >= 0 and eval.episodes >= 1")
        for name in self.run.trackers:
            if name not in TRACKERS:
                raise ConfigError(f"run.trackers: unknown tracker {name!r} (known: {', '.join(TRACKERS)})")
        if self.router.min_part < 1 or self.router.affinity_bound < 0:
            raise ConfigError(f"router.min_part must be >= 1 and router.affinity_bound >= 0 (0: no affinity), got "
                              f"{self.router.min_part} and {self.router.affinity_bound}")
        if self.router.within_agent not in ("least_loaded", "round_robin"):
            raise ConfigError("router.within_agent must be 'least_loaded' or 'round_robin', "
                              f"got {self.router.within_agent!r}")
        if self.cluster.max_restarts < 0 or self.cluster.restart_backoff_s < 0:
            raise ConfigError("cluster.max_restarts and cluster.restart_backoff_s must be >= 0 "
                              "(max_restarts = 0: a worker that dies is not started again)")
        if self.ray.placement_timeout_s <= 0:
            raise ConfigError(f"ray.placement_timeout_s must be > 0, got {self.ray.placement_timeout_s}")
        if self.transport.reconnect_timeout_s < 0:
            raise ConfigError("transport.reconnect_timeout_s must be >= 0 (0: a worker exits when its "
                              "controller goes away)")
        if not 0 <= self.openai.port < 65536 or self.openai.max_request_bytes < 1:
            raise ConfigError("openai.port must be in [0, 65535] (0: a free port) and openai.max_request_bytes >= 1")
        if self.transport.heartbeat_timeout_s <= self.transport.heartbeat_interval_s:
            raise ConfigError("transport.heartbeat_timeout_s must exceed heartbeat_interval_s")
        return self


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a config table's class
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__}")
        return _build(hint, value, key)
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_hint, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, val_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__}")
        return {k: _coerce(v, val_hint, f"{key}.{k}") for k, v in value.items()}
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{key}: expected one of {', '.join(map(repr, typing.get_args(hint)))}, got {value!r}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {hint}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else key
        if key not in known:
            raise ConfigError(f"unknown key '{full}' (known keys here: {', '.join(sorted(known))})")
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def _parse_literal(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word is a string: mode=async


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Set ``section.key=value`` in the raw TOML dict (validated later by `_build`)."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.key=value")
    path, text = assignment.split("=", 1)
    parts = [p for p in path.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {assignment!r} has no key")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {assignment!r}: '{part}' is not a table")
    node[parts[-1]] = _parse_literal(text.strip())


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                defaults: dict[str, Any] | None = None) -> ExperimentConfig:
    """Defaults, then the TOML file, then overrides; every key checked. The file's paths
    (see `resolve_paths`) are relative to its folder, the overrides' to the working
    directory; the config holds them absolute, so a run directory's copy works from anywhere."""
    data: dict[str, Any] = _deep_copy(defaults or {})
    if path is not None:
        try:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        resolve_paths(raw, Path(path).expanduser().resolve().parent)
        _merge(data, raw)
    for assignment in overrides:
        apply_override(data, assignment)
    resolve_paths(data, Path.cwd())
    return _build(ExperimentConfig, data, "").validate()


def resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Makes the file paths among the raw config's values absolute against `base`:
    `run.workflow` given as FILE.py:FUNCTION (or with a folder), `data.train`,
    `data.eval`, and every `agents.*.model` and `bases.*.model` that is a directory or a
    `tiny:FILE.py:AGENT` recipe. Built-in names (`digit_chain`, `tiny:planner`) and dotted modules stay as they
    are; values of the wrong type are left for the type check to name."""
    def absolute(text: str) -> str:
        return str((base / Path(text).expanduser()).resolve()) if text else text

    def is_file_spec(where: str) -> bool:
        return where.endswith(".py") or "/" in where

    run, data_table = data.get("run"), data.get("data")
    if isinstance(run, dict) and isinstance(run.get("workflow"), str) and ":" in run["workflow"]:
        where, name = run["workflow"].rsplit(":", 1)
        if is_file_spec(where):
            run["workflow"] = f"{absolute(where)}:{name}"
    if isinstance(data_table, dict):
        for key in ("train", "eval"):
            if isinstance(data_table.get(key), str):
                data_table[key] = absolute(data_table[key])
    tables = [t for key in ("agents", "bases") if isinstance(data.get(key), dict) for t in data[key].values()]
    for agent in tables:
        model = agent.get("model") if isinstance(agent, dict) else None
        if not isinstance(model, str) or not model:
            continue
        if model.startswith("tiny:"):
            rest = model[len("tiny:"):]
            if ":" in rest and is_file_spec(rest.rsplit(":", 1)[0]):
                job, name = rest.rsplit(":", 1)
                agent["model"] = f"tiny:{absolute(job)}:{name}"
        else:
            agent["model"] = absolute(model)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_toml(cfg: ExperimentConfig) -> str:
    """The resolved config as TOML (written into every run directory)."""
    lines: list[str] = []

    def emit_table(name: str, table: dict[str, Any]) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        lines.append(f"[{name}]")
        for k, v in scalars.items():
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
        for k, v in table.items():
            if isinstance(v, dict):
                emit_table(f"{name}.{k}", v)

    for section, table in to_dict(cfg).items():
        emit_table(section, table)
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def _deep_copy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


# ---------------------------------------------------------------- what a job needs of its bases

# The ranks vLLM's engines accept for max_lora_rank (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# What an adapter agent takes from its base, never sets itself (one engine and one frozen
# copy of the base serve all the base's agents, so these cannot differ between them).
BASE_KEYS = ("model", "max_model_len", "dtype", "train_precision", "activation_checkpointing", "compile_layers",
             "gpu_memory_utilization", "tensor_parallel_size", "block_size")
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules")


@dataclass(frozen=True)
class LoraSlots:
    """An engine's LoRA sizing for one base: what vLLM's enable_lora arguments become."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


def adapter_agents(cfg: ExperimentConfig, base: str) -> list[str]:
    """The agents that are adapters of `base`, in config order."""
    return [name for name, agent in cfg.agents.items() if agent.base == base]


def versions_resident(cfg: ExperimentConfig) -> int:
    """How many versions of one agent an engine may hold at once: the newest and the K
    older ones requests in flight may still use (K = 0 in sync mode: no request outlives
    a sync)."""
    return 1 + (cfg.pipeline.max_staleness if cfg.pipeline.mode == "async" else 0)


def required_slots(cfg: ExperimentConfig, base: str) -> LoraSlots:
    """The slots the job needs on an engine of `base`: every version of every adapter
    agent that may be resident at once, and a rank covering every agent's."""
    agents = [cfg.agents[name] for name in adapter_agents(cfg, base)]
    loras = len(agents) * versions_resident(cfg)
    top = max((a.lora_rank for a in agents), default=1)
    rank = next((r for r in VLLM_LORA_RANKS if r >= top), 0)
    return LoraSlots(loras, rank, loras)


def check_bases(cfg: ExperimentConfig) -> None:
    """Every base used and complete, every adapter agent well formed, every base's slots
    enough for the job. Raises ConfigError naming the key and the fix."""
    default = AgentConfig()
    for name, agent in cfg.agents.items():
        if not agent.base:
            stray = [k for k in LORA_KEYS if getattr(agent, k) != getattr(default, k)]
            if stray:
                raise ConfigError(f"agents.{name}.{stray[0]} is set but agents.{name} is a whole model (no "
                                  f"agents.{name}.base); name the base it adapts, or drop the LoRA keys")
            continue
        if agent.base not in cfg.bases:
            raise ConfigError(f"agents.{name}.base = {agent.base!r}: no [bases.{agent.base}] is declared "
                              f"(declared: {', '.join(cfg.bases) or 'none'})")
        own = [k for k in BASE_KEYS if getattr(agent, k) != getattr(default, k)]
        if own:
            raise ConfigError(f"agents.{name}.{own[0]} is set, but agents.{name} is an adapter of "
                              f"bases.{agent.base}, whose engine and trainer settings it shares; set "
                              f"bases.{agent.base}.{own[0]} instead")
        if not 1 <= agent.lora_rank <= VLLM_LORA_RANKS[-1]:
            raise ConfigError(f"agents.{name}.lora_rank must be in [1, {VLLM_LORA_RANKS[-1]}], got {agent.lora_rank}")
        if agent.lora_alpha <= 0 or not 0 <= agent.lora_dropout < 1:
            raise ConfigError(f"agents.{name}: lora_alpha must be > 0 and lora_dropout in [0, 1), got "
                              f"{agent.lora_alpha} and {agent.lora_dropout}")
        if not agent.lora_target_modules:
            raise ConfigError(f"agents.{name}.lora_target_modules is empty; name the modules the adapter "
                              f"changes (the default is the attention projections q_proj, k_proj, v_proj, o_proj)")
    for base, b in cfg.bases.items():
        _check_base(cfg, base, b, ConfigError)


def _check_base(cfg: ExperimentConfig, base: str, b, error: type[Exception]) -> None:
    agents = adapter_agents(cfg, base)
    if not b.model:
        raise error(f"bases.{base}.model is empty; name a built-in model (tiny:...) or a Hugging Face model dir")
    if not agents:
        raise error(f"bases.{base} has no agents (no agents.*.base = {base!r}); remove it or add one")
    if cfg.cluster.trainer_group_size > 1:
        raise error(f"bases.{base}: adapter agents train on single-process trainers; set "
                    f"cluster.trainer_group_size = 1 (it is {cfg.cluster.trainer_group_size})")
    if b.tensor_parallel_size < 1 or b.max_model_len < 0 or not 0 < b.gpu_memory_utilization <= 1:
        raise error(f"bases.{base}: tensor_parallel_size must be >= 1, max_model_len >= 0 and "
                    f"gpu_memory_utilization in (0, 1]")
    if block_size_problem(b.block_size):
        raise error(f"bases.{base}.{block_size_problem(b.block_size)}")
    need = required_slots(cfg, base)
    if b.max_loras and b.max_loras < need.max_loras:
        raise error(
            f"bases.{base}.max_loras = {b.max_loras} cannot run this job: its {len(agents)} adapter agents "
            f"({', '.join(agents)}) may each have {versions_resident(cfg)} versions in use at once "
            f"(pipeline.max_staleness + 1), so an engine must hold {need.max_loras} adapters. Raise "
            f"max_loras to {need.max_loras} (or leave it 0 to have it computed), lower "
            f"pipeline.max_staleness, or move some agents to another base")
    if b.max_lora_rank and (b.max_lora_rank not in VLLM_LORA_RANKS or b.max_lora_rank < need.max_lora_rank):
        raise error(f"bases.{base}.max_lora_rank = {b.max_lora_rank} must be one of {VLLM_LORA_RANKS} and at "
                    f"least the largest lora_rank of its agents; {need.max_lora_rank} would do (or 0: computed)")
    if b.max_cpu_loras and b.max_cpu_loras < (b.max_loras or need.max_loras):
        raise error(f"bases.{base}.max_cpu_loras = {b.max_cpu_loras} is below max_loras "
                    f"({b.max_loras or need.max_loras}); vLLM holds at least as many adapters as a batch mixes")
