"""Typed configuration: one small dataclass per component, loaded from TOML.

`load_config(path, overrides)` reads a TOML file (or the defaults), applies command-line
overrides written as ``section.key=value`` and checks every key and type. An error names
the offending key and what would have been accepted, so a typo never silently falls back
to a default.

This module knows the shape of the configuration, not what any component does with it.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from .protocol import (
    IN_FLIGHT,
    MAX_SCORE_TOP_K,
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
    address: str = "tcp://127.0.0.1:0"
    """The controller's address, tcp://HOST:PORT; port 0 picks a free port (the chosen address is
    logged and written to the run directory). Any host but loopback requires CURVE keys in
    `curve_dir`."""
    heartbeat_interval_s: float = 1.0
    """Heartbeats go both ways this often; none to a peer that was sent anything meanwhile, none
    from a worker whose replies carried its load meanwhile (a busy rollout worker's do)."""
    heartbeat_timeout_s: float = 10.0
    """A peer silent for this long is declared dead. Generous because workers run heavy compute on
    2-core machines; the liveness check only needs to beat a real crash."""
    handshake_timeout_s: float = 30.0
    """A worker waits this long for the controller's WELCOME."""
    reconnect_timeout_s: float = 60.0
    """A `flexmarl worker` whose controller went away (silent, not reading, or restarted on the same
    address) tries to register again on a fresh connection for this long, waiting 0.5 s, then
    twice as long each attempt (at most 10 s); it comes back as a fresh worker. 0: it exits at
    once (exit code 3). `--reconnect-timeout` sets it. Workers that `flexmarl run` starts itself
    never reconnect: a new controller starts its own."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Larger messages are refused (logged and dropped)."""
    curve_dir: str = ""
    """The folder of CURVE keys `flexmarl keys DIR` writes: `server.key(_secret)` and
    `client.key(_secret)`; copy it to every host."""
    io_threads: Literal["batch", "normal"] = "batch"
    """How the operating system schedules ZeroMQ's I/O thread in each process (Linux). "batch"
    (SCHED_BATCH): it does not preempt the process's event loop each time a message wakes it,
    so it takes what arrived meanwhile together at the loop's next pause; the controller's loop,
    on a core of its own, then spends less of that core switching between the two. "normal":
    the system's default. Elsewhere than Linux it is left as it is."""


# Who starts the workers of `flexmarl run`: "local" makes them child processes of the
# controller on this host; "ray" makes each one a Ray actor on a Ray cluster (see RayConfig).
Launcher = Literal["local", "ray"]
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]  # Ray's names


@dataclass
class ClusterConfig:
    launcher: Launcher = "local"
    """Who starts the workers of `flexmarl run`: "local" makes them child processes on this host;
    "ray" makes each one a Ray actor on a Ray cluster (see `[ray]`). `--launcher` sets it;
    `flexmarl controller` ignores it and waits for the workers you start."""
    rollout_workers: int = 3
    """Rollout worker processes, one inference engine each."""
    trainer_workers: int = 1
    """Trainer worker processes."""
    env_workers: int = 0
    """Environment worker processes: each runs the workflow's tool, environment and reward
    functions (`ctx.call`, `ctx.env_session`) in a pool of processes of its own (`[env]`), off
    the controller's interpreter. 0: they run in the controller's thread pool
    (`pipeline.tool_threads`)."""
    trainer_capacity: int = 0
    """Agents resident at once per trainer; 0: no limit. Below the number of agents per trainer,
    idle agents' training states are parked in host memory and swapped back in when they have
    work."""
    worker_start_timeout_s: float = 300.0
    """How long the controller waits for its workers to register."""
    shutdown_timeout_s: float = 15.0
    """How long workers get to shut down before they are stopped."""
    threads_per_worker: int = 1
    """Compute threads per worker process (under Ray: the CPUs each worker asks for, per rank)."""
    max_restarts: int = 3
    """A worker process that `flexmarl run` started and that exits while the run goes on (or whose
    Ray actor or node is lost, or that is declared dead while its process is still there) is
    started again (same id, same role, its log in `logs/` appended) up to this many times; past
    that the run stops with an error naming the worker, its exit code and the end of its log.
    0: a worker that dies is not started again."""
    restart_backoff_s: float = 1.0
    """The wait before a worker's first restart; each further restart of it waits twice as long
    (at most 30 s)."""
    rollout_gpus: list[list[int]] = field(default_factory=list)
    """GPUs per rollout worker, by worker index, as CUDA device numbers of this host: the launcher
    pins rollout worker i to `rollout_gpus[i]` (CUDA_VISIBLE_DEVICES), which must hold at least
    the largest `tensor_parallel_size` of the agents. Empty: workers are not pinned, each sees
    what its environment shows it. Under Ray the numbers name GPUs within the run, not devices."""
    trainer_gpus: list[list[int]] = field(default_factory=list)
    """GPUs per trainer worker, by worker index: trainer worker i is pinned to `trainer_gpus[i]`,
    exactly `trainer_group_size` GPUs, one per rank of its group. Empty: not pinned."""
    trainer_group_size: int = 1
    """Processes per trainer worker: above 1 each trainer is a group of ranks that shard every
    agent's training state with FSDP2 and split each micro-batch's samples between them; the
    controller still sees one trainer. 1: one process holds whole models."""

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

    address: str = "auto"
    """The Ray cluster to join: "auto" is the one `ray start` made on this host (or RAY_ADDRESS);
    otherwise its GCS address, HOST:PORT. `flexmarl run` must run on a node of the cluster (the
    workers connect back to it); a Ray Client address (ray://) is refused."""
    placement_strategy: PlacementStrategy = "PACK"
    """How Ray lays the workers' bundles out over its nodes: PACK (as few nodes as fit), SPREAD,
    STRICT_PACK or STRICT_SPREAD. Workers that share a GPU (`cluster.*_gpus`) are one bundle, so
    they always land on one node."""
    placement_timeout_s: float = 60.0
    """How long to wait for the cluster to find room for every worker at the start (an autoscaling
    cluster adds nodes meanwhile); past it, the run stops before any worker starts."""
    use_gpus: bool = False
    """With empty `cluster.*_gpus` lists: true gives each worker GPUs of its own from its agents'
    settings, one per rank (a rollout worker the largest `tensor_parallel_size`, a trainer
    `cluster.trainer_group_size`); false runs the workers on CPUs only."""


@dataclass
class BaseConfig:
    """A model several agents share as LoRA adapters of it (`agents.*.base`): loaded once
    per rollout instance and once per trainer. The engine and trainer settings of its
    adapter agents are these; runtime/bases.py derives the engine's LoRA slots."""

    model: str = ""
    """The model its adapter agents share: a Hugging Face model directory or a `tiny:` recipe
    (as `agents.*.model`)."""
    max_model_len: int = 0
    """As `agents.*.max_model_len`, for the engines of this base."""
    dtype: ModelDtype = "auto"
    """As `agents.*.dtype`; every adapter agent of the base has it."""
    train_precision: TrainPrecision = "mixed"
    """As `agents.*.train_precision`."""
    activation_checkpointing: bool = False
    """As `agents.*.activation_checkpointing`."""
    compile_layers: bool = False
    """As `agents.*.compile_layers`."""
    gpu_memory_utilization: float = 0.9
    """As `agents.*.gpu_memory_utilization`."""
    tensor_parallel_size: int = 1
    """As `agents.*.tensor_parallel_size`."""
    block_size: int = 0
    """As `agents.*.block_size`."""
    max_loras: int = 0
    """Adapters one engine batch may mix. 0: what the job needs, each adapter agent of this base
    times (`pipeline.max_staleness` + 1) versions resident at once, or one version of a trained
    agent under `pipeline.in_flight` "keep" or "recompute" (each new version takes the old one's
    slot), and one of a frozen agent (`train = false`: one version ever); a number below that (what a GPU's memory allows, say) refuses the job at start."""
    max_cpu_loras: int = 0
    """Adapters an engine holds; 0: `max_loras`."""
    max_lora_rank: int = 0
    """The largest adapter rank an engine accepts; 0: the smallest rank vLLM accepts that covers
    every agent's."""


@dataclass
class AgentConfig:
    model: str = ""
    """A Hugging Face model directory (one both transformers and vLLM load), or a `tiny:` recipe:
    `tiny:NAME` for the built-in digit chain's models (tiny:planner, tiny:solver, tiny:checker),
    `tiny:FILE.py:NAME` or `tiny:package.module:NAME` for one of a job's own. A directory or file
    in a TOML file is relative to its folder. Empty for an adapter agent (`base`)."""
    base: str = ""
    """Makes the agent a LoRA adapter of `bases.<base>`: then `model` stays empty and the base's
    model, dtype and engine settings are the agent's."""
    lora_rank: int = 8
    """An adapter agent's LoRA rank r (PEFT's names here and below)."""
    lora_alpha: float = 16.0
    """An adapter agent's LoRA scale: the update is (alpha / r) B A."""
    lora_dropout: float = 0.0
    """An adapter agent's dropout on the adapter's input."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """The modules an adapter agent adapts, checked against the base's module names before
    anything loads the base."""
    group_size: int = 4
    """Samples per prompt (n, at least 2), the default n of `ctx.generate` and `ctx.chat`;
    advantages are normalised within the group."""
    max_tokens: int = 8
    """A cap on each turn's output; generation ends at EOS or a stop string."""
    temperature: float = 1.0
    """Sampling temperature."""
    lr: float = 2e-3
    """Adam learning rate. The default suits a LoRA adapter agent too: on the adapter jobs shipped
    in examples/ it did best of the rates measured (1e-3 to 2e-2), 5e-3 already hurt the review
    team's critic and reviser and 1e-2 or more collapsed agents of both jobs (bench/RESULTS.md,
    adapter_lr)."""
    max_grad_norm: float = 1.0
    """Gradient clipping: the gradient's norm is clipped to this."""
    # Sampling (every ctx.generate / ctx.chat call may override these).
    top_p: float = 1.0
    """Nucleus sampling: the most likely tokens until their probability reaches top_p."""
    top_k: int = 0
    """Top-k sampling; 0: no top-k cut."""
    stop: list[str] = field(default_factory=list)
    """Generation ends at these strings (cut from `sample.text`)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation also ends at these token ids."""
    ignore_eos: bool = False
    """True: always write `max_tokens` tokens (fixed-length outputs)."""
    max_model_len: int = 0
    """The rollout engine's context length (prompt + output); 0: 64 on CPU, the model's own on
    CUDA."""
    # The loss (protocol.LossOptions says what each name means). Defaults: plain GRPO.
    loss_agg: LossAggregation = "seq_mean"
    """How a sample's per-token loss terms become one number: "seq_mean" (the mean over its tokens;
    the step divides by the samples), "token_mean" (the sum over its tokens; the step divides by
    the global batch's tokens) or "constant" (the sum over its tokens / `loss_constant`, as in
    Dr. GRPO; the step divides by the samples)."""
    loss_constant: float = 0.0
    """The divisor of "constant" aggregation; 0: `max_tokens`."""
    normalize_adv_std: bool = True
    """Advantages divided by their group's std (false: Dr. GRPO)."""
    off_policy: OffPolicyCorrection = "tis"
    """The correction for samples of older policies when `pipeline.max_staleness` > 0: "tis",
    "ppo_clip", "token_mis", "seq_mis", "gspo", "cispo" or "decoupled" (protocol.OffPolicyCorrection
    says what each does). TIS's cap is `pipeline.clip_ratio`; the others' constants are the keys
    below."""
    clip_eps: float = 0.2
    """`ppo_clip`: the ratio clipped to [1 - clip_eps, 1 + clip_eps]."""
    dual_clip: float = 0.0
    """`ppo_clip`: above 1 turns on dual-clip with this constant c (a negative advantage's term is
    bounded at c A); 0: off."""
    is_low: float = 0.5
    """`token_mis` / `seq_mis`: ratios outside [is_low, is_high] are masked."""
    is_high: float = 2.0
    """`token_mis` / `seq_mis`: the upper end of the kept ratios (see `is_low`)."""
    gspo_eps_low: float = 3e-4
    """`gspo`: the sequence ratio clipped to [1 - gspo_eps_low, 1 + gspo_eps_high]."""
    gspo_eps_high: float = 4e-4
    """`gspo`: the upper clip of the sequence ratio (see `gspo_eps_low`)."""
    cispo_eps_high: float = 2.0
    """`cispo`: the detached weight clipped to [0, 1 + cispo_eps_high]."""
    behav_weight_cap: float = 5.0
    """`decoupled` (AReaL's decoupled PPO): a token whose behaviour weight, the proximal policy's
    probability over the sampler's, exceeds this is masked; the trust region around the proximal
    policy is `clip_eps` (and `dual_clip`), as for `ppo_clip`."""
    kl_coef: float = 0.0
    """KL penalty towards the initial weights; 0: none (no reference model is built)."""
    # Agents that play but do not learn, and distillation from them.
    train: bool = True
    """False: a frozen agent (a judge, an opponent, a teacher): served by rollout engines like any
    agent, never trained: no trainer, no optimizer state, no weight sync; its samples need no
    reward and are recorded as generated, not trained."""
    adapter: str = ""
    """A frozen adapter agent's weights (`train = false` with `base`): a PEFT adapter directory of
    its base, such as an agent's folder in an earlier run's checkpoint."""
    snapshot_of: str = ""
    """Makes the agent a frozen copy of the trained agent named here at an earlier version
    (self-play against one's past): it takes that agent's model (for an adapter agent, one more
    adapter of its base), starts at its initial weights and is refreshed to its newest version
    every `snapshot_every` of its steps, through the weight sync's parameter channel."""
    snapshot_every: int = 1
    """A snapshot's refresh interval, in steps of the agent it copies."""
    teacher: str = ""
    """On-policy distillation: the agent (frozen, a snapshot, or trained) that scores this agent's
    sampled tokens; its per-token reverse KL, this agent's logprob minus the teacher's, enters
    this agent's loss (`teacher_coef`). The teacher must share this agent's tokenizer."""
    teacher_coef: float = 1.0
    """With `teacher`: the per-token advantage is the reward's minus teacher_coef x (student
    logprob - teacher logprob), the reverse KL's gradient on the student's own samples."""
    teacher_only: bool = False
    """With `teacher`: the reward's advantage is left out, the reverse KL alone trains the agent
    (rewards are still recorded)."""
    teacher_kl_cap: float = 0.0
    """With `teacher`: > 0 clips each token's (student logprob - teacher logprob) to [-cap, cap]
    nats before it enters the advantage, so that the tokens the teacher finds nearly impossible
    (a wrong answer's -5 to -9 nats) do not outweigh the reward's advantage; 0: not clipped."""
    teacher_top_k: int = 0
    """With `teacher`: k > 0 distils from the teacher's whole next-token distribution, not the one
    sampled token: its prefill of each sample also returns its k most likely ids and their
    logprobs at every output position, and the loss adds teacher_coef x the forward KL from the
    teacher's distribution restricted to those k ids (renormalised) to the student's (its own,
    unscaled, probability of each, not renormalised: mass outside the k ids is pulled down too),
    at each trained token, averaged as the policy loss's tokens; the advantage is then the
    reward's alone (none with `teacher_only`). k the vocabulary's size: the whole distribution,
    exactly. 0: the sampled token's reverse KL in the advantage. At most 20 (the rollout
    engine's max_logprobs)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal (no advantage, no gradient) is
    dropped before it reaches a micro-batch, and more episodes are drawn so that the step keeps
    its batch size, up to `pipeline.max_extra_episodes`."""
    # Devices and precision.
    dtype: ModelDtype = "auto"
    """What the rollout engine runs in and the trainer computes in; "auto" is resolved by each
    worker: bfloat16 where it has CUDA, float32 on CPU."""
    train_precision: TrainPrecision = "mixed"
    """"mixed": float32 master weights and optimizer state, forward and backward autocast to `dtype`
    (a no-op in float32); "pure": weights, gradients and optimizer state all in `dtype` (refused
    with float16, whose Adam eps is 0)."""
    activation_checkpointing: bool = False
    """The trainer recomputes activations in backward (Hugging Face
    `gradient_checkpointing_enable`): less memory, more compute."""
    compile_layers: bool = False
    """The trainer `torch.compile`s each RMSNorm and MLP module of the decoder (dynamic shapes),
    fusing their elementwise work; the first micro-batch pays the compile (seconds), and on the
    CPU it needs a C++ compiler."""
    gpu_memory_utilization: float = 0.9
    """CUDA rollout engines: the share of the GPU vLLM may claim (weights + KV cache), split
    between the engines of rollout workers that share a GPU. On CPU the KV cache stays 256 MiB."""
    tensor_parallel_size: int = 1
    """Ranks one rollout engine spans (vLLM's tensor parallelism), a process each: on CUDA a GPU
    each (each rollout worker's GPU list must hold at least the largest); on CPU, cores of their
    own."""
    block_size: int = 0
    """Tokens per KV-cache block of the rollout engine; its prefix cache (a group's samples sharing
    their prompt, a later turn its conversation) reuses whole blocks only. 0: the device's
    default, 16 on CUDA and 128 on CPU, longer than the CPU's 64-token context: set 32 (the CPU's
    least) there to see prefix-cache hits. Otherwise a multiple of 16 (of 32 on CPU)."""
    tool_parser: str = ""
    """The vLLM tool parser ("hermes", "llama3_json", "mistral", ...) that turns this agent's
    replies on the OpenAI endpoint into `tool_calls` when a call passes `tools`; "": replies stay
    text."""

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
                           self.gspo_eps_low, self.gspo_eps_high, self.cispo_eps_high, self.behav_weight_cap,
                           self.teacher_coef if self.teacher else 0.0, self.teacher_only,
                           self.teacher_kl_cap, self.teacher_top_k if self.teacher else 0)

    @property
    def frozen(self) -> bool:
        """Served, never trained: `train = false`, or a snapshot of another agent."""
        return not self.train or bool(self.snapshot_of)

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
        if self.behav_weight_cap <= 1:
            return (f"behav_weight_cap must be > 1, got {self.behav_weight_cap} (decoupled PPO masks tokens whose "
                    f"behaviour weight exceeds it; a weight of 1 is on-policy)")
        return ""


# How episodes are admitted and assigned to global batches (PipelineConfig.admission).
ADMISSION = ("step", "continuous", "capacity")
# The settings under which a batch trains the first episodes to end (the rest: "step").
CONTINUOUS_ADMISSION = frozenset({"continuous", "capacity"})


def admits_continuously(admission: str | None) -> bool:
    """Whether a `pipeline.admission` setting (as a config or a logged one says it) fills
    batches by the order episodes end."""
    return admission in CONTINUOUS_ADMISSION

@dataclass
class PipelineConfig:
    mode: str = "sync"
    """"sync" (roll out the whole global batch, then train each agent, then sync: the baseline) or
    "async" (micro-batches are trained while rollout continues)."""
    max_staleness: int = 0
    """K: no sample with a turn older than v - K trains version v. 0: exactly on-policy, the same
    update as sync mode; above 0 the loss corrects for the lag (`agents.*.off_policy`)."""
    queries_per_step: int = 8
    """Episodes per global batch (every agent steps once per batch)."""
    micro_batch: int = 16
    """Samples per micro-batch, per agent."""
    micro_batch_tokens: int = 0
    """Above 0: micro-batches are cut by this many tokens instead (a group's prompt once plus every
    output, as the trainer computes them), so each takes about the same memory and time whatever
    lengths the policy writes; `micro_batch` is then unused. Whole groups either way: a group
    larger than the budget is a micro-batch of its own."""
    max_concurrent_episodes: int = 16
    """Episodes running at once."""
    episode_timeout_s: float = 120.0
    """An episode running longer fails (alone)."""
    tool_threads: int = 4
    """The thread pool `ctx.call` runs blocking tool, environment and reward functions in."""
    tool_timeout_s: float = 60.0
    """`ctx.call`'s time limit unless the call gives its own; past it only that episode fails."""
    max_skipped_steps: int = 3
    """A step whose gradient is not finite is skipped (weights unchanged, a `StepSkipped` event, a
    count in metrics); this many skipped steps of one agent in a row stop the run."""
    clip_ratio: float = 2.0
    """TIS's truncation cap (`agents.*.off_policy = "tis"`): the importance weight is min(ratio,
    clip_ratio). Only TIS reads it; PPO's clip range is `agents.*.clip_eps`."""
    max_failed_share: float = 0.5
    """A run that cannot learn stops (exit status 1, the first failure's traceback shown) when more
    than this share of a step's episodes fail; 1.0: never."""
    allow_empty_steps: bool = False
    """False: an agent that gets no trainable sample in a step stops the run (exit status 1); true:
    it steps on nothing (a workflow that calls some agent only now and then)."""
    max_extra_episodes: int = 0
    """With `agents.*.dynamic_sampling`: the episodes a global batch may draw beyond
    `queries_per_step` to replace the groups dynamic sampling dropped; a batch that still lacks
    groups then stops the run with an error naming the agent. 0: 3 x `queries_per_step`."""

    def extra_episodes(self) -> int:
        """The bound on a batch's extra episodes (`max_extra_episodes`, 0 read as its default)."""
        return self.max_extra_episodes or 3 * self.queries_per_step

    in_flight: str = "keep"
    """What a weight sync does to the requests in flight on an instance, in async mode with
    max_staleness >= 1: "keep" (the default: the weights are replaced between two engine steps
    and they continue on the keys and values the old weights computed), "recompute" (they
    continue after vLLM rebuilds their cache from prompt plus tokens so far under the new
    weights) or "finish" (the load waits for them and holds new ones back, so every sample is
    one version's). Every token records the version that produced it
    and staleness counts a sample's oldest token. With max_staleness 0 and in sync mode a sync
    always finishes them (nothing spans a version). Adapter agents alike: under "keep" and
    "recompute" the new adapter version takes the old one's slot and the agent's requests in flight
    move to it; under "finish" they end under the version they were admitted with (an adapter load
    never waits)."""
    admission: str = "step"
    """How episodes are admitted and which global batch trains them: "step" (episode i of batch t
    is batch t's; its turns wait at the staleness gate until the version allows batch t, and the
    step waits for its slowest episode), "continuous" (a batch trains the first `queries_per_step`
    episodes to end, whichever batch started them, so the step waits for no slow episode: the
    slowest carry over into the next batch, their tokens so far kept and continued under the new
    weights; an episode's first turn is admitted while the episodes running and ended fit in the
    batches every trained agent's version may generate for, plus `partial_rollout` spares; a
    sample whose oldest token is then too stale is dropped and counted, and an episode still
    running once every batch its bound allows is full is abandoned at once: its requests aborted
    in the engines, its samples dropped and counted, its place given to a fresh spare) or "capacity" (as
    "continuous", but a spare is spent only on an instance that has drained: beyond what the
    bound admits, an episode's first turn is admitted only while one of its agent's instances has
    no group left, at most one such episode per drained instance). "continuous" and "capacity"
    need async mode, max_staleness >= 1 and `in_flight` "keep" or "recompute"; not with dynamic
    sampling. A checkpoint of either records its episodes in flight and resumes under "continuous"
    or "capacity" only (a "step" one under any)."""
    partial_rollout: int = 0
    """With `admission = "continuous"` or `"capacity"`: episodes over-provisioned beyond what the
    staleness bound admits, so an instance is given more groups before the version moves; the
    unfinished ones carry over. Under "continuous" they start with the first batch and, since the
    last N to end are always too many for the batches their bound allows, about N episodes a step
    are too stale: each is abandoned as soon as every batch its bound allows is full (its requests
    aborted, its samples dropped and counted, so it takes no later batch's place and no more engine
    time), and a fresh spare takes its place; under "capacity" at most this many are over at once,
    and only while an instance of the agent has drained, so a spare is spent (and a drop risked)
    only where an engine would otherwise idle. The last batch trains every episode left (nothing
    lost, nothing trained twice). 0: none."""


@dataclass
class EnvConfig:
    processes: int = 2
    """Processes per environment worker that run stateless calls (`ctx.call`), one call at a time
    each; a call waits in the worker's queue for a free one. Under Ray, the CPUs an environment
    worker asks for."""
    max_sessions: int = 16
    """Sessions (`ctx.env_session`) one environment worker holds at once, each in a process of its
    own; another waits for one to close."""
    process_memory_mb: int = 0
    """Each of an environment worker's processes may use this much address space (RLIMIT_AS): a call
    that allocates past it fails alone (MemoryError, or its process dies and is replaced). 0: no
    limit."""
    retries: int = 0
    """A stateless call whose environment worker died (or hung and was declared dead) is sent to
    another this many times; 0: it fails, and with it its episode. A session's calls never are:
    its state died with the worker."""


@dataclass
class RouterConfig:
    within_agent: str = "least_loaded"
    """Level 2 (within an agent): "least_loaded" sends each group (the n samples of one prompt)
    whole to the less loaded of two instances drawn at random; "round_robin" is the static
    baseline."""
    min_part: int = 16
    """A group larger than an instance's fair share of its agent's work is split over instances in
    contiguous parts of at least this many samples (each part prefills the prompt again)."""
    affinity_bound: float = 2.0
    """A later turn of a conversation goes back to the instance of the turn before (its prefix
    cache holds the conversation) while that instance's outstanding work is at most this many
    times the alternative's; 0: by load alone."""
    coalesce_tokens: float = 256.0
    """Groups of one agent routed in the same event-loop turn share an instance, and so one
    message, while that instance's outstanding work is at most this many tokens over the
    least-loaded rule's own pick's (a group costs its members' prompts and max_tokens: small
    groups share, large ones spread); 0: every group by the rule alone. Not with round_robin."""
    placement: str = "chain"
    """How the rollout instances are first shared among the agents, before any demand is measured:
    "chain" weighs each agent by group_size x max_tokens x its position in [agents] (in a pipeline
    a later agent is asked more often: each plan makes several answers, each answer several
    checks); "parallel" by group_size x max_tokens alone (every agent asked as often as any
    other: agents answering side by side, a debate, a vote). With measured_placement, the first
    batch's tokens correct it; with across_agents, measured demand moves instances from there."""
    measured_placement: bool = True
    """Once the first batch's rollout ended: where each instance of one agent was sent
    disparity_threshold times the tokens of each of another's and that agent's instances were
    busy half the time or more, share the instances out again in proportion to the tokens each
    agent was sent (instances move as across_agents moves them); false: only say so in the log."""
    across_agents: bool = False
    """Level 1 (across agents): move rollout instances between agents from measured demand."""
    disparity_threshold: float = 5.0
    """The per-instance demand ratio between agents that triggers a level-1 move."""
    patience: int = 3
    """Consecutive observations above the threshold before a move."""
    cooldown_s: float = 5.0
    """After a move, no other move for this long (no thrashing)."""
    interval_s: float = 0.5
    """How often demand is observed."""


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
    """The episode function: a built-in name ("digit_chain"), "package.module:function" or
    "path/file.py:function" (in a TOML file, relative to its folder)."""
    steps: int = 20
    """Optimizer steps (global batches); every agent steps once per batch."""
    seed: int = 0
    """Seeds the data order, every episode's randomness and every sample's sampling."""
    out: str = ""
    """The run directory; empty: `runs/<timestamp>`."""
    checkpoint_every: int = 10
    """A checkpoint (weights, optimizer state, controller state: what `--resume` continues from)
    after every this many steps, and always after the last; 0: only at the end."""
    keep_checkpoints: int = 3
    """The newest this many checkpoints are kept (and `checkpoints/final`)."""
    env_latency_ms: float = 0.0
    """Mean latency of the simulated environment or tool call `ctx.env()`."""
    progress: bool = True
    """The progress line per step and the set-up progress; `--no-progress` sets it false."""
    event_log: bool = True
    """Write `RUN_DIR/events.log`; off only to measure its overhead."""
    trackers: list[str] = field(default_factory=list)
    """Where metrics rows (and sample texts) go besides metrics.jsonl: any of "tensorboard"
    (`RUN_DIR/tensorboard`) and "wandb" (TRACKERS). W&B runs offline unless WANDB_MODE says
    otherwise (its files land in `RUN_DIR/wandb`; `wandb sync` uploads them)."""
    wandb_project: str = "flexmarl"
    """The W&B project."""
    samples_per_step: int = 0
    """Every optimizer step writes this many of each agent's trained samples, as text (each turn,
    its policy version, the reward; best and worst first), to `RUN_DIR/samples.jsonl` and the
    trackers; `flexmarl samples RUN_DIR` prints them. 0: none."""


@dataclass
class DataConfig:
    train: str = ""
    """Rows a user's episodes receive as `ctx.item`: a .jsonl / .json / .parquet / .csv file or a
    directory written by `datasets.Dataset.save_to_disk` (in a TOML file, relative to its
    folder). Empty: no dataset (the workflow makes its own queries, like the built-in digit
    chain)."""
    eval: str = ""
    """Held-out rows for `[eval]`; never trained."""
    shuffle: bool = True
    """A new order every epoch, from `run.seed`."""
    epochs: int = 0
    """Passes over the data; 0: as many as the run needs."""


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate after every N optimizer steps, and always the final weights at the end; 0: never."""
    episodes: int = 16
    """Held-out episodes per evaluation (eval rows, cycled)."""
    temperature: float = 0.0
    """Sampling temperature of evaluations; 0: greedy. Evaluation episodes take one sample per
    call."""
    at_start: bool = False
    """With `every` above 0: also evaluate the initial weights, before the first step (rows at
    step 0)."""


@dataclass
class OpenAIConfig:
    enabled: bool = False
    """Serve the run's OpenAI-compatible endpoint (controller/serving/openai_api.py): `model`
    names an agent, the API key names an episode. Off unless enabled."""
    host: str = "127.0.0.1"
    """Where the endpoint listens; any host but loopback requires a key (`key_env`)."""
    port: int = 0
    """The endpoint's port; 0 picks a free port (logged, and written to `RUN_DIR/openai.url`)."""
    key_env: str = "FLEXMARL_OPENAI_KEY"
    """The environment variable holding the endpoint's key. Off loopback it is required: episode
    keys are it, a dash and the episode's id, and `flexmarl serve` accepts it alone."""
    max_request_bytes: int = 8 * 1024 * 1024
    """A larger request body is refused (413)."""
    max_request_tokens: int = 0
    """A call whose prompt (with what its conversation already holds) is longer, in tokens, is
    refused (400) before any engine sees it; 0: as long as the agent's context allows (its
    `max_model_len` less the call's `max_tokens`). Text that cannot fit is refused before it is
    tokenized."""
    max_n: int = 64
    """The most samples one call may ask for (`n`); more is refused (400)."""


@dataclass
class ViewConfig:
    enabled: bool = True
    """Serve the run's web view from the controller (controller/view/): every agent's curves, each
    worker's busy and idle time, the episodes as trees of turns; the pages `flexmarl view RUN_DIR`
    serves. It reads the run's files, and only while a page is open."""
    host: str = "127.0.0.1"
    """Where the view listens; any host but loopback requires a key (`key_env`)."""
    port: int = 0
    """The view's port; 0 picks a free port (logged, and written to `RUN_DIR/view.url`)."""
    key_env: str = "FLEXMARL_VIEW_KEY"
    """The environment variable holding the view's key. Off loopback it is required: a browser opens
    `URL/?key=KEY` once (a cookie keeps it for the session), a script sends `Authorization: Bearer
    KEY`."""


@dataclass
class ExperimentConfig:
    run: RunConfig = field(default_factory=RunConfig)
    """`[run]`: what to train, for how long, and what the run writes."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """`[transport]`: the controller's ZeroMQ socket, heartbeats and CURVE keys."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """`[cluster]`: the worker processes, their GPUs and their restarts."""
    ray: RayConfig = field(default_factory=RayConfig)
    """`[ray]`: the Ray cluster, for `cluster.launcher = "ray"`."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """`[pipeline]`: global batches and micro-batches, staleness, episodes and when a run stops."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """`[router]`: which rollout instance generates each group (level 2), and how many instances
    each agent has (level 1)."""
    data: DataConfig = field(default_factory=DataConfig)
    """`[data]`: the rows episodes receive."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """`[eval]`: held-out episodes that never train."""
    openai: OpenAIConfig = field(default_factory=OpenAIConfig)
    """`[openai]`: the run's OpenAI-compatible endpoint."""
    view: ViewConfig = field(default_factory=ViewConfig)
    """`[view]`: the run's web view, served by the controller while it runs."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """`[env]`: the environment workers' process pools (`cluster.env_workers`)."""
    bases: dict[str, BaseConfig] = field(default_factory=dict)
    """`[bases.NAME]`, one table per base model that adapter agents share."""
    agents: dict[str, AgentConfig] = field(default_factory=dict)
    """`[agents.NAME]`, one table per agent: its model, sampling, loss, devices and precision."""

    def widest_engine(self) -> int:
        """The ranks of the widest rollout engine: its agents' largest tensor_parallel_size."""
        return max([a.tensor_parallel_size for a in self.agents.values()]
                   + [b.tensor_parallel_size for b in self.bases.values()], default=1)

    def in_flight(self) -> str:
        """What a weight sync does to the requests in flight (`pipeline.in_flight`, where it
        applies: async mode, max_staleness >= 1; "finish" otherwise)."""
        pipeline = self.pipeline
        return pipeline.in_flight if pipeline.mode == "async" and pipeline.max_staleness > 0 else "finish"

    def _check_admission(self) -> None:
        p = self.pipeline
        if p.admission not in ADMISSION:
            raise ConfigError(f"pipeline.admission must be one of {', '.join(map(repr, ADMISSION))}, "
                              f"got {p.admission!r}")
        if p.partial_rollout < 0:
            raise ConfigError(f"pipeline.partial_rollout must be >= 0 (0: no spare episodes), got {p.partial_rollout}")
        if p.partial_rollout and not admits_continuously(p.admission):
            raise ConfigError("pipeline.partial_rollout needs pipeline.admission = \"continuous\" or \"capacity\" "
                              "(spare episodes carry over only when a batch trains the first episodes to end)")
        if not admits_continuously(p.admission):
            return
        if p.mode != "async" or p.max_staleness < 1:
            raise ConfigError(f"pipeline.admission = {p.admission!r} needs mode = \"async\" and max_staleness >= 1 "
                              "(sync mode and max_staleness 0 train each batch on its own episodes, exactly on-policy)")
        if p.in_flight == "finish":
            raise ConfigError(f"pipeline.admission = {p.admission!r} needs in_flight = \"keep\" or \"recompute\" "
                              "(an episode carried over continues across the sync)")
        dynamic = [name for name, a in self.agents.items() if a.dynamic_sampling]
        if dynamic:
            raise ConfigError(f"pipeline.admission = {p.admission!r} cannot be used with dynamic sampling "
                              f"(agents.{dynamic[0]}.dynamic_sampling): its top-ups count a batch's own episodes")

    def validate(self) -> "ExperimentConfig":
        if self.run.steps < 1:
            raise ConfigError(f"run.steps must be >= 1, got {self.run.steps}: a run of no optimizer step "
                              "trains nothing")
        if self.pipeline.mode not in ("sync", "async"):
            raise ConfigError(f"pipeline.mode must be 'sync' or 'async', got {self.pipeline.mode!r}")
        if self.pipeline.max_staleness < 0:
            raise ConfigError("pipeline.max_staleness must be >= 0")
        if self.pipeline.in_flight not in IN_FLIGHT:
            raise ConfigError(f"pipeline.in_flight must be one of {', '.join(map(repr, IN_FLIGHT))}, "
                              f"got {self.pipeline.in_flight!r}")
        self._check_admission()
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
        if self.pipeline.max_extra_episodes < 0:
            raise ConfigError(f"pipeline.max_extra_episodes must be >= 0 (0: 3 x queries_per_step), got "
                              f"{self.pipeline.max_extra_episodes}")
        if not 0.0 <= self.pipeline.max_failed_share <= 1.0:
            raise ConfigError(f"pipeline.max_failed_share must be in [0, 1] (1: never stop for failed "
                              f"episodes), got {self.pipeline.max_failed_share}")
        if self.cluster.rollout_workers < 1 or self.cluster.trainer_workers < 1:
            raise ConfigError("cluster needs at least one rollout and one trainer worker")
        if self.cluster.env_workers < 0:
            raise ConfigError(f"cluster.env_workers must be >= 0 (0: tools run in the controller), "
                              f"got {self.cluster.env_workers}")
        if self.env.processes < 1 or self.env.max_sessions < 1:
            raise ConfigError(f"env.processes and env.max_sessions must be >= 1, got {self.env.processes} and "
                              f"{self.env.max_sessions}")
        if self.env.process_memory_mb < 0 or self.env.retries < 0:
            raise ConfigError("env.process_memory_mb (0: no limit) and env.retries must be >= 0")
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
            if agent.off_policy == "decoupled" and self.cluster.trainer_group_size > 1:
                raise ConfigError(f"agents.{name}.off_policy = \"decoupled\" keeps the previous version's weights "
                                  f"on a single-process trainer; set cluster.trainer_group_size = 1 or choose "
                                  f"another correction")
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
        check_roles(self)
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
        if self.router.coalesce_tokens < 0 or not math.isfinite(self.router.coalesce_tokens):
            raise ConfigError(f"router.coalesce_tokens must be a finite number >= 0 (0: no coalescing), got "
                              f"{self.router.coalesce_tokens}")
        if self.router.min_part < 1 or self.router.affinity_bound < 0:
            raise ConfigError(f"router.min_part must be >= 1 and router.affinity_bound >= 0 (0: no affinity), got "
                              f"{self.router.min_part} and {self.router.affinity_bound}")
        if self.router.placement not in ("chain", "parallel"):
            raise ConfigError(f"router.placement must be 'chain' or 'parallel', got {self.router.placement!r}")
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
        if not 0 <= self.view.port < 65536:
            raise ConfigError(f"view.port must be in [0, 65535] (0: a free port), got {self.view.port}")
        if self.openai.max_request_tokens < 0 or self.openai.max_n < 1:
            raise ConfigError("openai.max_request_tokens must be >= 0 (0: the agent's context) and openai.max_n >= 1")
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
    `data.eval`, every `agents.*.adapter`, and every `agents.*.model` and `bases.*.model` that is a directory or a
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
    for agent in tables:  # a frozen adapter agent's directory too
        if isinstance(agent, dict) and isinstance(agent.get("adapter"), str) and agent["adapter"]:
            agent["adapter"] = absolute(agent["adapter"])
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


# ---------------------------------------------------------------- agents that play but do not learn

# What a snapshot takes from the agent it copies (the same model, or one more adapter of
# the same base, so that the copy's weights load into its engine as they are).
SNAPSHOT_KEYS = ("model", "base", "max_model_len", "dtype", "gpu_memory_utilization", "tensor_parallel_size",
                 "block_size", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules")


def trained_agents(cfg: ExperimentConfig) -> list[str]:
    """The agents that learn (every one but the frozen and the snapshots), in config order."""
    return [name for name, agent in cfg.agents.items() if not agent.frozen]


def check_roles(cfg: ExperimentConfig) -> None:
    """Frozen agents, snapshots and teachers well formed, one line per mistake; a snapshot
    takes the model (or base and LoRA shape) of the agent it copies."""
    default = AgentConfig()
    declared = ", ".join(cfg.agents)
    for name, agent in cfg.agents.items():
        if agent.snapshot_of:
            _inherit_snapshot(cfg, name, agent, default, declared)
        if agent.frozen:
            trains = [k for k in ("teacher", "dynamic_sampling") if getattr(agent, k) != getattr(default, k)]
            if trains:
                raise ConfigError(f"agents.{name}.{trains[0]} is set, but agents.{name} is frozen "
                                  f"({'a snapshot' if agent.snapshot_of else 'train = false'}): it learns nothing")
        if agent.adapter and not (agent.base and not agent.train and not agent.snapshot_of):
            raise ConfigError(f"agents.{name}.adapter is for a frozen adapter agent (train = false with base); "
                              f"a trained adapter agent starts from its base")
        if agent.base and not agent.train and not agent.snapshot_of and not agent.adapter:
            raise ConfigError(f"agents.{name} is a frozen adapter of bases.{agent.base} without its adapter: set "
                              f"agents.{name}.adapter to a PEFT adapter directory (an agent's folder of an "
                              f"earlier run's checkpoint), or make it a whole model")
        if agent.teacher:
            if agent.teacher == name or agent.teacher not in cfg.agents:
                raise ConfigError(f"agents.{name}.teacher = {agent.teacher!r}: "
                                  + ("an agent cannot teach itself" if agent.teacher == name else
                                     f"no [agents.{agent.teacher}] is declared (declared: {declared})"))
            if agent.teacher_coef <= 0:
                raise ConfigError(f"agents.{name}.teacher_coef must be > 0, got {agent.teacher_coef}")
            if agent.teacher_kl_cap < 0:
                raise ConfigError(f"agents.{name}.teacher_kl_cap must be >= 0 (0: not clipped), "
                                  f"got {agent.teacher_kl_cap}")
            if not 0 <= agent.teacher_top_k <= MAX_SCORE_TOP_K:
                raise ConfigError(f"agents.{name}.teacher_top_k = {agent.teacher_top_k}: must be 0 (the sampled "
                                  f"token's reverse KL) to {MAX_SCORE_TOP_K} (the rollout engine's max_logprobs)")
            if agent.teacher_top_k and agent.teacher_kl_cap:
                raise ConfigError(f"agents.{name}.teacher_kl_cap clips the sampled token's reverse KL, which "
                                  f"teacher_top_k = {agent.teacher_top_k} replaces; set one of them")
        elif agent.teacher_top_k:
            raise ConfigError(f"agents.{name}.teacher_top_k = {agent.teacher_top_k} needs a teacher "
                              f"(agents.{name}.teacher)")
    for name in cfg.agents:  # a cycle of teachers: each would wait for the other's version
        seen = [name]
        while cfg.agents[seen[-1]].teacher:
            seen.append(cfg.agents[seen[-1]].teacher)
            if seen[-1] in seen[:-1]:
                raise ConfigError(f"agents.{name}.teacher: the teachers form a cycle "
                                  f"({' -> '.join(seen[seen.index(seen[-1]):])}); a teacher learns from none of "
                                  f"its students")
    if not trained_agents(cfg) and cfg.agents:
        raise ConfigError("every agent is frozen (train = false or snapshot_of): the run would train nothing; "
                          "leave at least one agent trained")


def _inherit_snapshot(cfg: ExperimentConfig, name: str, agent: AgentConfig, default: AgentConfig,
                      declared: str) -> None:
    source = cfg.agents.get(agent.snapshot_of)
    if agent.snapshot_of == name or source is None:
        raise ConfigError(f"agents.{name}.snapshot_of = {agent.snapshot_of!r}: "
                          + ("an agent cannot be a snapshot of itself" if source is agent else
                             f"no [agents.{agent.snapshot_of}] is declared (declared: {declared})"))
    if source.frozen:
        raise ConfigError(f"agents.{name}.snapshot_of = {agent.snapshot_of!r}, a frozen agent: its weights never "
                          f"change, so a snapshot of it is the agent itself; name {agent.snapshot_of!r} instead")
    if agent.snapshot_every < 1:
        raise ConfigError(f"agents.{name}.snapshot_every must be >= 1, got {agent.snapshot_every}")
    for key in SNAPSHOT_KEYS:
        own, theirs = getattr(agent, key), getattr(source, key)
        if own != getattr(default, key) and own != theirs:
            raise ConfigError(f"agents.{name}.{key} is set, but agents.{name} is a snapshot of "
                              f"agents.{agent.snapshot_of}, whose model it takes; remove it")
        setattr(agent, key, list(theirs) if isinstance(theirs, list) else theirs)


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


def versions_resident(cfg: ExperimentConfig, agent: str = "") -> int:
    """How many versions of one agent an engine may hold at once: the newest and the K
    older ones requests in flight may still use (K = 0 in sync mode: no request outlives
    a sync). With `agent` named: one for a trained agent whose requests move to each new
    version as it loads (`in_flight` "keep" or "recompute": the new version is loaded into
    the old one's slot, vLLM removing the old before adding the new); a snapshot's
    refreshes let its requests finish under the version they began with, so it keeps
    K + 1; a frozen agent that is no snapshot (`train = false`) never loads a second version:
    one."""
    lagging = 1 + (cfg.pipeline.max_staleness if cfg.pipeline.mode == "async" else 0)
    if not agent:
        return lagging
    a = cfg.agents[agent]
    if not a.train and not a.snapshot_of:
        return 1
    if not a.frozen and cfg.in_flight() in ("keep", "recompute"):
        return 1
    return lagging


def _versions_in_use(cfg: ExperimentConfig, agents: list[str]) -> str:
    """'each have 3 versions', or 'have 3, 3 and 1 versions' where they differ."""
    counts = [versions_resident(cfg, name) for name in agents]
    if len(set(counts)) == 1:
        return f"each have {counts[0]} versions"
    return f"have {', '.join(map(str, counts[:-1]))} and {counts[-1]} versions"


def required_slots(cfg: ExperimentConfig, base: str) -> LoraSlots:
    """The slots the job needs on an engine of `base`: every version of every adapter
    agent that may be resident at once, and a rank covering every agent's."""
    names = adapter_agents(cfg, base)
    agents = [cfg.agents[name] for name in names]
    loras = sum(versions_resident(cfg, name) for name in names)
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
            f"({', '.join(agents)}) may {_versions_in_use(cfg, agents)} in use at once "
            f"(pipeline.max_staleness + 1; one where pipeline.in_flight moves a trained agent's requests to "
            f"each new version, and for an agent with train = false), so an engine must hold {need.max_loras} adapters. Raise "
            f"max_loras to {need.max_loras} (or leave it 0 to have it computed), lower "
            f"pipeline.max_staleness, or move some agents to another base")
    if b.max_lora_rank and (b.max_lora_rank not in VLLM_LORA_RANKS or b.max_lora_rank < need.max_lora_rank):
        raise error(f"bases.{base}.max_lora_rank = {b.max_lora_rank} must be one of {VLLM_LORA_RANKS} and at "
                    f"least the largest lora_rank of its agents; {need.max_lora_rank} would do (or 0: computed)")
    if b.max_cpu_loras and b.max_cpu_loras < (b.max_loras or need.max_loras):
        raise error(f"bases.{base}.max_cpu_loras = {b.max_cpu_loras} is below max_loras "
                    f"({b.max_loras or need.max_loras}); vLLM holds at least as many adapters as a batch mixes")
