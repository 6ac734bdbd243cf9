"""The wire protocol: every message between the controller and its workers, declared once.

A message on the wire is a ZeroMQ multipart message:

    frame 0   one byte, the message kind (``Kind``), then the body: a msgspec Struct
              encoded as MessagePack
    frame 1.. raw buffers (tensor bytes), sent and received without copies

Kind and body share a frame: a frame costs a call into libzmq on each side, and most
messages are that frame alone.

Each Struct names its direction in a comment (sender -> receiver). Decoding is typed:
the kind byte picks the Struct, and msgspec validates field types, so a body that does
not match its kind is an error, never a half-filled object. Nothing here ever uses pickle.
Parameter handles (`ParamHandle`, from the torch-free runtime.params.types) travel typed
inside the messages, so a worker gets them decoded and the controller never imports torch.

This module knows nothing about sockets, workers or the controller's state.
"""

from __future__ import annotations

import array
import enum
import sys
from typing import Any, Literal, Sequence

import msgspec

from .keys import GroupKey
from .params.types import ParamHandle

# Bumped on every wire-format change, and when what a message means changes (8: a reply
# carrying the worker's load stands in for its heartbeat; 9: environment workers and their
# calls; 10: LoadAdapter; 11: teachers' logprobs, decoupled PPO; 12: groups named by typed
# keys, a later turn by its turn number, the training message carries groups, a teacher's
# logprobs packed per group; 13: a load may let the requests in flight continue, and a reply
# carries its tokens' versions; 14: the teacher's per-token KL capped in the advantage; 15: a
# teacher's scoring returns its top-k next-token ids and logprobs at each scored position, and
# the training message carries them; 16: kind and body in one frame; 17: AbortGroups, and a
# group comes back refused as aborted): the controller refuses workers of another version.
PROTOCOL_VERSION = 17

# The most next-token ids and logprobs a scoring request may ask for per position
# (GenGroup.score_top_k): the rollout engine is started with this cap (vLLM's max_logprobs).
MAX_SCORE_TOP_K = 20

# Default cap on one message (all frames together). Parameters never travel over this
# socket (they use the parameter channel), so control messages stay far below it.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ProtocolError(Exception):
    """A message could not be decoded: unknown kind, bad body, wrong frame count.

    `reason` is a short fixed category ("bad body", "unknown kind", ...) that receivers
    count by; the message text adds the details, which come from the peer and vary."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    REJECT = 3
    HEARTBEAT = 4
    SHUTDOWN = 5
    BYE = 6
    ERROR = 7
    ECHO = 8
    ECHO_REPLY = 9
    LOAD_MODEL = 10
    MODEL_LOADED = 11
    GENERATE = 12
    GENERATED = 13
    ABORT_GROUPS = 19
    LOAD_WEIGHTS = 14
    WEIGHTS_LOADED = 15
    CANCEL_LOAD = 16
    LOAD_CANCELLED = 17
    LOAD_ADAPTER = 18
    INIT_AGENT = 20
    AGENT_READY = 21
    TRAIN_MICROBATCH = 22
    MICROBATCH_DONE = 23
    OPTIM_STEP = 24
    STEP_DONE = 25
    PUBLISH_WEIGHTS = 26
    WEIGHTS_PUBLISHED = 27
    SAVE_CHECKPOINT = 28
    CHECKPOINT_SAVED = 29
    OFFLOAD_AGENT = 30
    AGENT_OFFLOADED = 31
    LOAD_AGENT = 32
    RELEASE_STATE = 33
    STATE_RELEASED = 34
    ENV_SETUP = 40
    ENV_READY = 41
    ENV_CALLS = 42
    ENV_RESULTS = 43
    ENV_CANCEL = 44


class Message(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """Base of every wire struct; ``KIND`` maps it to its frame-0 byte. Messages hold plain
    data, never a reference cycle: the collector does not track them (gc=False), nor the
    per-group and per-sample structs inside them."""

    KIND = 0  # overridden; a ClassVar since it is not a field


# ---------------------------------------------------------------- session


class Hello(Message):
    # Worker -> Controller: first message on a new connection.
    KIND = Kind.HELLO
    protocol_version: int
    worker_id: str
    role: str  # "rollout" | "trainer" | "env"
    host: str
    pid: int
    devices: list[str] = []  # torch devices the worker computes on: ["cuda:0"], or ["cpu"]
    capacity: dict[str, float] = {}
    # The GPUs it was pinned to (its CUDA_VISIBLE_DEVICES entries); empty: not pinned.
    visible_gpus: list[str] = []


class Welcome(Message):
    # Controller -> Worker: registration accepted; heartbeat settings the worker must use.
    KIND = Kind.WELCOME
    protocol_version: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


class Reject(Message):
    # Controller -> Worker: registration refused (bad version, duplicate id); worker exits.
    KIND = Kind.REJECT
    reason: str


class Heartbeat(Message):
    # Worker <-> Controller: liveness, both ways on the same socket; workers attach load. Each
    # side sends one an interval after its last message to the other side, a worker after its
    # last message carrying its load (a reply to GENERATE does): a busy peer sends none.
    KIND = Kind.HEARTBEAT
    seq: int
    load: dict[str, float] = {}


class Shutdown(Message):
    # Controller -> Worker: stop now and exit.
    KIND = Kind.SHUTDOWN
    reason: str


class Bye(Message):
    # Worker -> Controller: the worker is leaving in an orderly way.
    KIND = Kind.BYE
    reason: str


class Error(Message):
    # Worker <-> Controller: a request failed (recoverable) or the sender is dying (not).
    KIND = Kind.ERROR
    request_id: int
    message: str
    recoverable: bool = True


class Echo(Message):
    # Controller -> Worker: round trip for health checks and benchmarks; buffers come back.
    KIND = Kind.ECHO
    request_id: int
    payload: bytes = b""


class EchoReply(Message):
    # Worker -> Controller: the Echo's payload (and buffers) unchanged, and the worker's
    # load counters as of now (a heartbeat's may be a second old).
    KIND = Kind.ECHO_REPLY
    request_id: int
    payload: bytes = b""
    load: dict[str, float] = {}


# ---------------------------------------------------------------- model settings

# A model's number format. "auto" is resolved by the worker, which alone knows its device:
# bfloat16 on CUDA, float32 on CPU.
ModelDtype = Literal["auto", "bfloat16", "float16", "float32"]
# "mixed": float32 weights and optimizer state, forward and backward autocast to the dtype.
# "pure": weights, gradients and optimizer state all in the dtype (half the memory; small
# updates can round away).
TrainPrecision = Literal["mixed", "pure"]


class EngineSettings(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    # How a rollout engine runs a model (inside LoadModel).
    dtype: ModelDtype = "auto"
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the GPU vLLM may claim; CPU: unused
    tensor_parallel_size: int = 1  # ranks one engine spans: a GPU each, or on the CPU cores of its own
    # CUDA: rollout engines the controller has placed on this engine's GPU (workers that
    # were not pinned to GPUs of their own share one); they split the share between them.
    engines_on_gpu: int = 1
    # LoRA slots of an engine that serves agents as adapters of its model (a base); 0: no
    # LoRA. max_loras: adapters one batch may mix (every resident version of every agent);
    # max_lora_rank: the largest rank, one vLLM accepts; max_cpu_loras: adapters held.
    max_loras: int = 0
    max_lora_rank: int = 0
    max_cpu_loras: int = 0
    # Tokens per KV-cache block: the prefix cache reuses whole blocks only. 0: the device's
    # default (vLLM's: 128 on CPU, where 32 is the least; 16 on CUDA).
    block_size: int = 0


class LoraSettings(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    # An agent that is a LoRA adapter of a base model: its adapter's shape (inside
    # InitAgent, LoadAgent, LoadWeights and LoadAdapter). PEFT's names: the update is
    # (alpha / rank) * B @ A on each module named in `target_modules`.
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


class TrainerSettings(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    # How a trainer holds and computes an agent (inside InitAgent and LoadAgent).
    dtype: ModelDtype = "auto"
    precision: TrainPrecision = "mixed"
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, more time
    # torch.compile the decoder's norms and MLPs (their elementwise work fused): CUDA only
    compile_layers: bool = False


# ---------------------------------------------------------------- rollout


class LoadModel(Message):
    # Controller -> Rollout: (re)start the engine on an agent's model at a version.
    KIND = Kind.LOAD_MODEL
    request_id: int
    agent: str
    model_path: str
    version: int
    seed: int = 0
    max_model_len: int = 64  # 0: the device's default (64 on CPU, the model's own on CUDA)
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    # A checkpoint's directory: file (relative to model_path) -> SHA-256 from its manifest,
    # checked before the engine reads any of them (runtime/checksums.py). Empty: none.
    checksums: dict[str, str] = {}


class ModelLoaded(Message):
    # Rollout -> Controller: the engine serves `agent` at `version`.
    KIND = Kind.MODEL_LOADED
    request_id: int
    agent: str
    version: int
    seconds: float


class GenGroup(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """The samples of one prompt (part of a Generate): `n` of them, drawn with seeds
    `seed`, `seed + 1`, ..., run by the engine as one request with n outputs (the prompt's
    pass shared). A group split over instances travels as contiguous parts, each naming
    its first member; a later turn of a conversation is a group of one: member `first` of
    the group `key`, at turn `turn`. Replies name the part by (key, first, turn)."""

    key: GroupKey
    agent: str
    n: int
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int  # member j of this part draws with seed + j
    first: int = 0  # the part's first member within its group (a split group's later parts)
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    stop: list[str] = []  # generation ends at any of these strings (cut from the text; the ids keep its last token)
    stop_token_ids: list[int] = []  # ... or at any of these tokens (included)
    ignore_eos: bool = False  # True: always write max_tokens tokens
    # An adapter agent's version the group is generated with (its adapter at that version
    # must be loaded); -1: the newest the instance holds.
    version: int = -1
    # 0: the group's first turn; k >= 1: turn k of member `first` (n is 1); keys.SCORE_TURN:
    # a teacher's scoring of member `first` (with score_from)
    turn: int = 0
    # >= 1: score, do not generate (n is 1): the model's logprob of each of prompt_ids
    # from this index on, in one prefill (a teacher scoring member `first` of the student's
    # group `key`); they come back as the member's ids and logprobs. -1: generate.
    score_from: int = -1
    # With score_from: > 0 also returns, at each scored position, the model's score_top_k
    # most likely next-token ids and their logprobs (GroupResult.top_ids / top_logprobs), at
    # most MAX_SCORE_TOP_K; 0: the scored ids' logprobs only.
    score_top_k: int = 0


class Generate(Message):
    # Controller -> Rollout: every group bound for this instance in one turn of the
    # controller's loop, of any agent the instance serves.
    KIND = Kind.GENERATE
    request_id: int
    groups: list[GenGroup]


# Token ids and logprobs travel as packed arrays: int32 and float32, little-endian, every
# sample's back to back (vLLM's logprobs are float32: nothing is lost).
TOKEN_TYPECODE, LOGPROB_TYPECODE = "i", "f"


_SWAP = sys.byteorder != "little"


def packed(typecode: str, values: Any) -> bytes:
    """`values` (ints or floats, or an array of them) as a packed little-endian array."""
    out = values if isinstance(values, array.array) and values.typecode == typecode else array.array(typecode, values)
    if _SWAP:
        out = array.array(typecode, out)
        out.byteswap()
    return out.tobytes()


def native(typecode: str, data: bytes) -> bytes:
    """Packed little-endian bytes as this machine's own order (the bytes themselves on a
    little-endian machine: no copy), for a memoryview cast to read; and back, the same swap."""
    if not _SWAP:
        return data
    out = array.array(typecode, data)
    out.byteswap()
    return out.tobytes()


def unpacked(typecode: str, data: bytes | memoryview) -> array.array:
    """The array `packed` made (a copy the caller owns)."""
    out = array.array(typecode)
    out.frombytes(data)
    if _SWAP:
        out.byteswap()
    return out


class GroupResult(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """One finished part of a group: every member's tokens, the sampler's logprobs, the
    weights version used."""

    key: GroupKey
    first: int
    version: int
    lengths: list[int]  # output tokens of each member, in order
    token_ids: bytes  # TOKEN_TYPECODE array: every member's ids, back to back
    logprobs: bytes  # LOGPROB_TYPECODE array: one per token
    # Why each member ended: "length" (max_tokens), "stop" (end of sequence, a stop token or
    # a stop string; the ids keep the token that completed a stop string), "" if not said.
    finish_reasons: list[str] = []
    # Prompt tokens the engine found in its prefix cache, as vLLM counts them for the
    # request (for a group of n, the count of a member after the first).
    cached_tokens: int = 0
    turn: int = 0  # the GenGroup's
    # TOKEN_TYPECODE array, one per token: the policy version that produced it, where a
    # weight load let the request continue (IN_FLIGHT "keep" or "recompute") so its tokens
    # span versions; empty: every token is `version`'s (the version it was admitted under).
    token_versions: bytes = b""
    # A scoring request with score_top_k = k: per scored position, the model's k most likely
    # next-token ids (TOKEN_TYPECODE) and their logprobs (LOGPROB_TYPECODE), most likely first,
    # k per position back to back; empty otherwise.
    top_ids: bytes = b""
    top_logprobs: bytes = b""


class GroupRefused(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """One group (part) the engine refused to run (empty prompt, too long for the model, a
    token id outside the vocabulary, settings the engine rejects, an agent the instance
    does not serve). Only this group failed: the worker is up and the rest of its message
    runs. Retrying it on an instance of the same model fails the same way."""

    key: GroupKey
    first: int
    reason: str
    turn: int = 0  # the GenGroup's
    aborted: bool = False  # not refused: an AbortGroups named it (its episode was abandoned)


class AbortGroups(Message):
    # Controller -> Rollout: nobody waits for these groups (or parts) any more, each named
    # by (key, first, turn) as in its Generate (their episode was abandoned): one still
    # queued is dropped, one running is aborted in the engine. No reply of its own: each
    # comes back once, in its Generate's reply, as a GroupRefused with `aborted`; one that
    # had already finished came back as it would, and the name is ignored.
    KIND = Kind.ABORT_GROUPS
    request_id: int
    keys: list[GroupKey]
    firsts: list[int]
    turns: list[int]


class Generated(Message):
    # Rollout -> Controller: finished groups of a Generate, plus current load. Every group
    # of the request comes back exactly once, whole, in `results` or in `refused` (an
    # aborted one there too).
    KIND = Kind.GENERATED
    request_id: int
    results: list[GroupResult]
    done: bool  # the last reply for this request_id
    load: dict[str, float] = {}
    refused: list[GroupRefused] = []


class LoadWeights(Message):
    # Controller -> Rollout: replace the engine's weights in place from a published handle;
    # with `lora`, add the agent's adapter at `version` instead (the handle holds the
    # adapter's tensors under PEFT's names), its older versions kept while requests use them
    # ("finish") or its requests moved to the new one ("keep", "recompute": `in_flight`).
    KIND = Kind.LOAD_WEIGHTS
    request_id: int
    agent: str
    version: int
    # From WeightsPublished; the controller passes it on, never reads it. None: with
    # `adapter_dir`, a frozen adapter agent's weights are read from that directory.
    handle: ParamHandle | None
    rank: int = 0  # nccl: the instance's first rank in the handle's communicator (its engine's
    # worker r takes rank + r); 0 otherwise
    lora: LoraSettings | None = None
    adapter_dir: str = ""  # a PEFT adapter directory (adapter_model.safetensors) on the worker's host
    # What the load does to the requests in flight (IN_FLIGHT): "finish" ("" too) waits for
    # them and holds new ones back; "keep" replaces the weights between two engine steps and
    # they continue on their cache; "recompute" also rebuilds their cache under the new weights.
    in_flight: str = ""


# What a weight load does to the requests in flight on the instance (LoadWeights.in_flight).
IN_FLIGHT = ("finish", "keep", "recompute")


class CancelLoad(Message):
    # Controller -> Rollout: the LoadWeights of the publication `key` (its handle's key)
    # cannot complete (another rank of its NCCL broadcast died): it fails now, whether still
    # queued or receiving, a whole model's and an adapter's alike. A later publication of
    # the same version (the sync retried) has another key and is never affected.
    KIND = Kind.CANCEL_LOAD
    request_id: int
    agent: str
    key: str


class LoadCancelled(Message):
    # Rollout -> Controller: the cancel is in force; the LoadWeights it named replies Error.
    KIND = Kind.LOAD_CANCELLED
    request_id: int
    agent: str


class LoadAdapter(Message):
    # Controller -> Rollout: add the PEFT adapter directory `path` (a checkpoint's agent
    # directory) as `agent`'s adapter at `version` to the engine of its base, as a
    # LoadWeights with `lora` adds a published one (`flexmarl serve`). `checksums`: its
    # files' SHA-256s from the checkpoint's manifest, checked before any is read. Replied
    # to with WeightsLoaded.
    KIND = Kind.LOAD_ADAPTER
    request_id: int
    agent: str
    version: int
    path: str
    lora: LoraSettings
    checksums: dict[str, str] = {}


class WeightsLoaded(Message):
    # Rollout -> Controller: the engine now samples with `version`.
    KIND = Kind.WEIGHTS_LOADED
    request_id: int
    agent: str
    version: int
    seconds: float


# ---------------------------------------------------------------- trainer


# How a sample's per-token loss terms become one number, and what the optimizer step
# divides the global batch's sum by (workers/trainer/loss.py holds the table):
#   seq_mean    mean over the sample's tokens; the step divides by the samples
#   token_mean  sum over the sample's tokens; the step divides by the global batch's tokens
#   constant    sum over the sample's tokens / `constant`; the step divides by the samples
LossAggregation = Literal["seq_mean", "token_mean", "constant"]
# How a token sampled by an older policy is weighted (only when max_staleness > 0), with
# r = pi / mu the trainer's over the sampler's probability (workers/trainer/loss.py holds the table):
#   tis       truncated importance sampling: weight min(r, clip_ratio), detached
#   ppo_clip  PPO's surrogate, r clipped to [1 - clip_eps, 1 + clip_eps] (dual-clip optional)
#   token_mis masked importance sampling per token: weight r, detached, 0 outside [is_low, is_high]
#   seq_mis   the same with the sample's whole ratio prod r_t, so a sample is kept or masked whole
#   gspo      GSPO: PPO's surrogate on the sample's length-normalised ratio (prod r_t)^(1/|y|)
#   cispo     CISPO: weight clip(r, 0, 1 + cispo_eps_high), detached, on every token's logp
#   decoupled AReaL's decoupled PPO: PPO's surrogate on pi / pi_prox (the proximal policy: the
#             agent's weights at the previous version, scored by the trainer), clipped as
#             ppo_clip, times the behaviour weight pi_prox / mu, detached, a token whose
#             behaviour weight exceeds behav_weight_cap masked
OffPolicyCorrection = Literal["tis", "ppo_clip", "token_mis", "seq_mis", "gspo", "cispo", "decoupled"]


class LossOptions(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """An agent's loss settings, carried by every TrainMicroBatch (so they need no
    parking when the agent's state moves between trainers). Defaults: plain GRPO."""

    agg: LossAggregation = "seq_mean"
    constant: float = 1.0  # the divisor of "constant" aggregation (Dr. GRPO: max tokens)
    off_policy: OffPolicyCorrection = "tis"
    # KL penalty against the agent's initial weights (the model at its model_path);
    # 0 builds no reference model at all.
    kl_coef: float = 0.0
    # The corrections' constants (each used by the corrections named):
    clip_eps: float = 0.2  # ppo_clip: r clipped to [1 - clip_eps, 1 + clip_eps]
    dual_clip: float = 0.0  # ppo_clip: > 1 bounds a negative advantage's term at dual_clip * |A|; 0 off
    is_low: float = 0.5  # token_mis, seq_mis: ratios outside [is_low, is_high] are masked
    is_high: float = 2.0
    gspo_eps_low: float = 3e-4  # gspo: the sequence ratio clipped to [1 - low, 1 + high]
    gspo_eps_high: float = 4e-4
    cispo_eps_high: float = 2.0  # cispo: the detached weight clipped to [0, 1 + cispo_eps_high]
    behav_weight_cap: float = 5.0  # decoupled: tokens whose pi_prox / mu exceeds it are masked
    # On-policy distillation: each sample's tokens come with a teacher's logprobs
    # (TrainSample.teacher_logprobs); the per-token advantage is the reward's (0 with
    # teacher_only) minus teacher_coef * (the student's logprob - the teacher's), detached.
    teacher_coef: float = 0.0
    teacher_only: bool = False
    teacher_kl_cap: float = 0.0  # > 0: each token's difference clipped to [-cap, cap] in the advantage
    # > 0: the teacher's top-k next-token distribution comes with each output id
    # (TrainGroup.teacher_top_ids / teacher_top_logprobs) and the loss adds teacher_coef x the
    # forward KL from it to the student's at each trained token (the advantage is then the
    # reward's alone; loss.py `top_k_kl`); 0: the sampled-token reverse KL in the advantage.
    teacher_top_k: int = 0


class StepStats(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What one optimizer step trained on and how it went; means are over the step's
    trained tokens unless said otherwise."""

    loss: float = 0.0  # the objective whose gradient was applied (KL penalty included)
    grad_norm: float = 0.0  # before clipping
    entropy: float = 0.0  # of the trained (temperature-scaled) policy
    response_len_mean: float = 0.0  # output tokens per sample
    response_len_max: int = 0
    # Sampler vs trainer on the same tokens, d = trainer_logprob - sampler_logprob, over
    # the tokens that came with sampler logprobs: mean |d|, and KL(sampler || trainer)
    # by the k3 estimator mean(exp(d) - 1 - d) (non-negative, unbiased under the sampler).
    logprob_abs_diff: float = 0.0
    rollout_kl: float = 0.0
    clip_frac: float = 0.0  # tokens whose importance weight the off-policy correction clipped or masked
    ref_kl: float = 0.0  # KL(policy || reference) by k3; 0 without a KL penalty
    samples: int = 0
    tokens: int = 0
    # The gradient was not finite (an overflow, say): the step was skipped, the weights
    # and optimizer state are as before it and the gradients are dropped; the version
    # still advances (versions count global batches), its weights those of the last.
    skipped: bool = False
    # On-policy distillation: the student's logprob minus its teacher's, per trained token
    # (an estimate of the reverse KL on the student's own samples); 0 without a teacher.
    teacher_kl: float = 0.0
    # With teacher_top_k: the forward KL from the teacher's top-k distribution to the
    # student's, per trained token (the dense distillation term before teacher_coef).
    teacher_top_kl: float = 0.0


class InitAgent(Message):
    # Controller -> Trainer: build an agent's training state (model + optimizer). With
    # `lora`, the agent is a new adapter of the base at `model_path` (loaded once per
    # trainer, frozen) and its training state is the adapter and its optimizer state.
    KIND = Kind.INIT_AGENT
    request_id: int
    agent: str
    model_path: str
    lr: float
    seed: int
    max_grad_norm: float = 1.0
    settings: TrainerSettings = msgspec.field(default_factory=TrainerSettings)
    lora: LoraSettings | None = None


class AgentReady(Message):
    # Trainer -> Controller: the agent's state is resident; its parameter count.
    KIND = Kind.AGENT_READY
    request_id: int
    agent: str
    version: int
    num_params: int


class MemberTurn(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True, gc=False):
    """A later turn of one member of a TrainGroup: its output ids from `start` (its first
    generated id) until the member's next turn were sampled at these settings."""

    member: int
    start: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


class TrainGroup(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """One group of a micro-batch (the n samples of one prompt), as the experience store
    keeps it: the prompt once, every member's output ids and the sampler's logprobs packed
    back to back (member j's are the `lengths[j]` after the members before it), an
    advantage per member."""

    key: GroupKey
    prompt_ids: bytes  # TOKEN_TYPECODE array
    lengths: list[int]  # output ids of each member, in order
    output_ids: bytes  # TOKEN_TYPECODE array: every member's, back to back
    rollout_logprobs: bytes  # LOGPROB_TYPECODE array: the sampler's, one per output id (empty: none)
    advantages: list[float]  # per member
    versions: list[int]  # per member: the oldest policy version of any of its turns
    # The distribution the members' first turn was sampled from, which the sampler's
    # logprobs are of and the trainer scores under: logits / temperature (0, greedy:
    # unscaled), cut to the top_k largest (0: no cut), then to the smallest set of
    # probability >= top_p, renormalised (workers/trainer/sampling.py).
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # int8 per output id: 1 where the agent generated it (trained), 0 where it was appended
    # between turns of a conversation (other agents' messages, tool results). Empty: all 1.
    loss_mask: bytes = b""
    turns: list[MemberTurn] = []  # the members' later turns, each with its own settings
    # On-policy distillation: LOGPROB_TYPECODE array, the teacher's logprob of every output
    # id (0.0 for ids appended between turns), packed as output_ids, from a prefill of
    # prompt + output on the teacher; empty for an agent without a teacher.
    teacher_logprobs: bytes = b""
    # With the agent's teacher_top_k = k: per output id, the teacher's k most likely ids at
    # that position (TOKEN_TYPECODE) and their logprobs (LOGPROB_TYPECODE), k per id, packed as
    # output_ids (an appended id's: never read); empty otherwise.
    teacher_top_ids: bytes = b""
    teacher_top_logprobs: bytes = b""


class TrainMicroBatch(Message):
    # Controller -> Trainer: forward/backward one micro-batch, accumulate gradients.
    KIND = Kind.TRAIN_MICROBATCH
    request_id: int
    agent: str
    version: int  # the version these gradients will produce (current + 1)
    groups: list[TrainGroup]
    max_staleness: int = 0  # above 0, samples are corrected as `loss.off_policy` says
    clip_ratio: float = 2.0  # importance ratio cap for off-policy samples
    loss: LossOptions = msgspec.field(default_factory=LossOptions)


class MicroBatchDone(Message):
    # Trainer -> Controller: gradients accumulated for this micro-batch.
    KIND = Kind.MICROBATCH_DONE
    request_id: int
    agent: str
    loss: float
    tokens: int
    seconds: float


class OptimStep(Message):
    # Controller -> Trainer: apply the accumulated gradients; the agent becomes `version`.
    # Micro-batch losses are sums over samples; the trainer divides the summed gradient
    # once by what the aggregation names (the global batch's samples or tokens, which it
    # counts itself), so the step is the full-batch mean whatever the split. `samples` is
    # how many samples the step covers (0: none, the version still advances): a trainer
    # that accumulated a different number refuses the step. The step ends the agent's last
    # publication (its weights may be published where they live): send it only once
    # nothing reads that.
    KIND = Kind.OPTIM_STEP
    request_id: int
    agent: str
    version: int
    samples: int


class StepDone(Message):
    # Trainer -> Controller: optimizer step applied.
    KIND = Kind.STEP_DONE
    request_id: int
    agent: str
    version: int
    grad_norm: float  # before clipping (also in `stats`)
    seconds: float
    stats: StepStats = msgspec.field(default_factory=StepStats)


# PublishWeights.version asking for the version the agent is at, whichever it is (the
# reply names it): what a joining instance is loaded with, so a step that raced the join
# is published instead of refused.
CURRENT_VERSION = -1


class PublishWeights(Message):
    # Controller -> Trainer: make the agent's weights available to rollout workers.
    KIND = Kind.PUBLISH_WEIGHTS
    request_id: int
    agent: str
    version: int  # refused unless the agent is at it; CURRENT_VERSION: whichever it is at
    # "shm", "tcp", "cuda_ipc", "nccl", ...: the controller picks it from where the ends are
    transport: str
    targets: list[str] = []  # worker ids that will receive; over nccl, see ranks_per_target
    group: str = ""  # nccl: the communicator's name, kept while the agent's targets stay the same
    # nccl: ranks each target takes, one per worker of its engine (tensor parallelism):
    # targets[i] takes ranks 1 + i * ranks_per_target onwards
    ranks_per_target: int = 1


class WeightsPublished(Message):
    # Trainer -> Controller: the handle receivers pass to LoadWeights.
    KIND = Kind.WEIGHTS_PUBLISHED
    request_id: int
    agent: str
    version: int
    handle: ParamHandle
    nbytes: int
    seconds: float


# The training state's file inside an agent's checkpoint directory (SAVE_CHECKPOINT with
# full_state). Not *.bin or *.pt, so loaders of Hugging Face weights never take it for weights.
TRAINING_STATE_FILE = "training_state.flexmarl"


class SaveCheckpoint(Message):
    # Controller -> Trainer: write the agent's weights (HF safetensors; an adapter agent's
    # as a PEFT adapter: adapter_config.json + adapter_model.safetensors) to the directory
    # `path`; with `full_state`, also its whole training state (weights, optimizer state,
    # version) as a parameter-channel disk file there, which LOAD_AGENT can resume from.
    KIND = Kind.SAVE_CHECKPOINT
    request_id: int
    agent: str
    path: str
    full_state: bool = False


class CheckpointSaved(Message):
    # Trainer -> Controller: checkpoint written.
    KIND = Kind.CHECKPOINT_SAVED
    request_id: int
    agent: str
    path: str
    version: int
    state: ParamHandle | None = None  # the training state's disk file, with full_state
    nbytes: int = 0  # bytes written


class OffloadAgent(Message):
    # Controller -> Trainer: publish the agent's whole training state (weights, pending
    # gradients, optimizer state) over the parameter channel and stop holding it live.
    # The published copy stays with this trainer until RELEASE_STATE.
    KIND = Kind.OFFLOAD_AGENT
    request_id: int
    agent: str
    transport: str = "shm"


class AgentOffloaded(Message):
    # Trainer -> Controller: the state is parked; `handle` lets any trainer load it.
    KIND = Kind.AGENT_OFFLOADED
    request_id: int
    agent: str
    version: int
    accumulated: int
    handle: ParamHandle  # the parked state; the controller passes it on, never reads it
    nbytes: int
    seconds: float
    # A trainer group parks each rank's shard where that rank runs: `handle` is rank 0's,
    # these are ranks 1..N-1's. Empty for a single-process trainer.
    shards: list[ParamHandle] = []


class LoadAgent(Message):
    # Controller -> Trainer: rebuild an agent's training state from a parked copy. The
    # agent becomes resident only after the whole state arrived and its checksum matched.
    KIND = Kind.LOAD_AGENT
    request_id: int
    agent: str
    model_path: str
    lr: float
    max_grad_norm: float
    version: int
    accumulated: int
    handle: ParamHandle  # from AgentOffloaded
    settings: TrainerSettings = msgspec.field(default_factory=TrainerSettings)
    shards: list[ParamHandle] = []  # from AgentOffloaded
    lora: LoraSettings | None = None  # an adapter agent: the parked state is its adapter's (see InitAgent)
    # A checkpoint's training state file: its SHA-256 from the checkpoint's manifest, checked
    # before it is read (runtime/checksums.py). Empty: a parked copy in memory, not a file.
    checksum: str = ""


class ReleaseState(Message):
    # Controller -> Trainer: drop a parked copy (its new owner has loaded it).
    KIND = Kind.RELEASE_STATE
    request_id: int
    agent: str
    handle: ParamHandle  # from AgentOffloaded
    shards: list[ParamHandle] = []  # from AgentOffloaded


class StateReleased(Message):
    # Trainer -> Controller: the parked copy is gone.
    KIND = Kind.STATE_RELEASED
    request_id: int
    agent: str


# ---------------------------------------------------------------- environment


class EnvSetup(Message):
    # Controller -> Env: import the workflow's module in a pool of `processes` processes (and
    # in every process started later, for a session or to replace one that died); the reply
    # is EnvReady once each has, or an Error naming what failed.
    KIND = Kind.ENV_SETUP
    request_id: int
    workflow: str  # run.workflow as the controller resolved it: "/abs/file.py:fn" or "pkg.module:fn"
    processes: int = 2  # processes that run stateless calls, one call at a time each
    max_sessions: int = 16  # sessions held at once (a process each); more wait for one to close
    memory_mb: int = 0  # each process's address-space limit (RLIMIT_AS); 0: none


class EnvReady(Message):
    # Env -> Controller: the pool runs; `sandbox` says what the sandbox cannot do on this
    # host ("" where it can do everything: runtime/sandbox.py).
    KIND = Kind.ENV_READY
    request_id: int
    processes: int
    seconds: float
    sandbox: str = ""


# What an EnvCall asks: "call" a function (or, with a session, one of its object's methods),
# "open" a session (the function makes its object, in a process of its own), "close" it.
EnvOp = Literal["call", "open", "close"]


class EnvCall(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """One call of a tool, environment or reward function (part of EnvCalls). Its arguments
    travel as the controller encoded them and are decoded only by the process that runs it."""

    call_id: int  # unique in the run; its result names it
    module: str  # the function's module, as its __module__
    name: str  # its qualified name in the module; a session's call: the method's name
    payload: bytes  # msgpack of [args, kwargs]
    timeout_s: float  # from the start of its run; past it the process running it is stopped
    op: EnvOp = "call"
    session: str = ""  # the session it belongs to ("" a stateless call)
    episode: str = ""  # the episode that called, for the worker's log lines


class EnvCalls(Message):
    # Controller -> Env: every call bound for this worker in one turn of the controller's loop.
    KIND = Kind.ENV_CALLS
    request_id: int
    calls: list[EnvCall]


# Why a call failed: it raised; it ran past its time limit; its process died under it (a
# crash, a memory limit); its result cannot be sent; it was cancelled; its session is gone.
EnvFailure = Literal["", "raised", "timeout", "crashed", "unsendable", "cancelled", "session_lost", "refused"]


class EnvResult(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """A call's outcome: its value (msgpack), or why it failed in one line (`error`), the
    traceback of the user's code that raised in `detail`."""

    call_id: int
    value: bytes = b""
    failure: EnvFailure = ""
    error: str = ""
    detail: str = ""
    seconds: float = 0.0  # it ran this long


class EnvResults(Message):
    # Env -> Controller: finished calls of an EnvCalls, and the worker's load. Every call of
    # the request comes back exactly once, in some reply; `done`: the last for request_id.
    KIND = Kind.ENV_RESULTS
    request_id: int
    results: list[EnvResult]
    done: bool
    load: dict[str, float] = {}


class EnvCancel(Message):
    # Controller -> Env: no one waits for these calls any more (their time ran out, their
    # episode failed): one still queued is dropped, a running one has its process stopped.
    # No reply of its own: each call's result comes back as "cancelled" in its EnvResults.
    KIND = Kind.ENV_CANCEL
    request_id: int
    call_ids: list[int]


MESSAGE_TYPES: dict[int, type[Message]] = {
    int(cls.KIND): cls for cls in Message.__subclasses__()
}
assert len(MESSAGE_TYPES) == len(Kind), "every Kind needs exactly one Struct"

_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in MESSAGE_TYPES.items()}


def encode(msg: Message, buffers: Sequence[Any] = ()) -> list[Any]:
    """Frames for `msg`: its kind and body (`encode_one`), then `buffers` (bytes,
    memoryview, numpy arrays) as they are."""
    return [encode_one(msg), *buffers]


def encode_one(msg: Message) -> bytearray:
    """The first frame of `msg`: its kind byte, then its body (encoded in place after it: no copy)."""
    frame = bytearray((msg.KIND,))
    _encoder.encode_into(msg, frame, 1)
    return frame


def decode(frames: Sequence[Any]) -> tuple[Message, list[Any]]:
    """Inverse of `encode`. Raises ProtocolError naming what was wrong."""
    if not frames:
        raise ProtocolError("expected at least 1 frame (kind and body), got none", "too few frames")
    first = memoryview(frames[0])
    if first.nbytes < 2:
        raise ProtocolError(f"frame 0 must hold the kind byte and a body, got {first.nbytes} bytes",
                            "bad kind frame")
    kind = first[0]
    try:
        decoder = _decoders[kind]
    except KeyError:
        raise ProtocolError(f"unknown message kind {kind}", "unknown kind") from None
    try:
        msg = decoder.decode(first[1:])
    # msgspec reports a string that is not UTF-8 as UnicodeDecodeError, not DecodeError.
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"bad {Kind(kind).name} body: {shorten(str(exc))}", "bad body") from None
    return msg, list(frames[1:])


def shorten(text: str, limit: int = 200) -> str:
    """Peer-controlled text in a log line or reason, cut to a bounded length."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def frames_nbytes(frames: Sequence[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)
