"""The wire protocol: every message between the controller and its workers, declared once.

A message on the wire is a ZeroMQ multipart message:

    frame 0   one byte, the message kind (``Kind``)
    frame 1   the body, a msgspec Struct encoded as MessagePack
    frame 2.. raw buffers (tensor bytes), sent and received without copies

Each Struct names its direction in a comment (sender -> receiver). Decoding is typed:
the kind byte picks the Struct, and msgspec validates field types, so a body that does
not match its kind is an error, never a half-filled object. Nothing here ever uses pickle.

This module knows nothing about sockets, workers or the controller's state.
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

import msgspec

PROTOCOL_VERSION = 1

# Default cap on one message (all frames together). Parameters never travel over this
# socket (they use the parameter channel), so control messages stay far below it.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ProtocolError(Exception):
    """A message could not be decoded: unknown kind, bad body, wrong frame count."""


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
    LOAD_WEIGHTS = 14
    WEIGHTS_LOADED = 15
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


class Message(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Base of every wire struct; ``KIND`` maps it to its frame-0 byte."""

    KIND = 0  # overridden; a ClassVar since it is not a field


# ---------------------------------------------------------------- session


class Hello(Message):
    # Worker -> Controller: first message on a new connection.
    KIND = Kind.HELLO
    protocol_version: int
    worker_id: str
    role: str  # "rollout" | "trainer"
    host: str
    pid: int
    devices: list[str] = []
    capacity: dict[str, float] = {}


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
    # Worker <-> Controller: liveness, both ways on the same socket; workers attach load.
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


# ---------------------------------------------------------------- rollout


class LoadModel(Message):
    # Controller -> Rollout: (re)start the engine on an agent's model at a version.
    KIND = Kind.LOAD_MODEL
    request_id: int
    agent: str
    model_path: str
    version: int
    seed: int = 0
    max_model_len: int = 64


class ModelLoaded(Message):
    # Rollout -> Controller: the engine serves `agent` at `version`.
    KIND = Kind.MODEL_LOADED
    request_id: int
    agent: str
    version: int
    seconds: float


class GenRequest(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One sample to generate (part of a Generate batch)."""

    sample_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int


class Generate(Message):
    # Controller -> Rollout: a batch of samples for the agent the engine serves.
    KIND = Kind.GENERATE
    request_id: int
    agent: str
    items: list[GenRequest]


class GenResult(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One finished sample: tokens, the sampler's logprobs, the weights version used."""

    sample_id: str
    token_ids: list[int]
    logprobs: list[float]
    version: int


class GenRefused(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One sample the engine refused to run (empty prompt, too long for the model, a token
    id outside the vocabulary, settings the engine rejects). Only this sample failed: the
    worker is up and the rest of its batch runs. Retrying it on an instance of the same
    model fails the same way."""

    sample_id: str
    reason: str


class Generated(Message):
    # Rollout -> Controller: results of (part of) a Generate batch, plus current load.
    # Every sample of the batch comes back exactly once, in `results` or in `refused`.
    KIND = Kind.GENERATED
    request_id: int
    agent: str
    results: list[GenResult]
    done: bool  # the last reply for this request_id
    load: dict[str, float] = {}
    refused: list[GenRefused] = []


class LoadWeights(Message):
    # Controller -> Rollout: replace the engine's weights in place from a published handle.
    KIND = Kind.LOAD_WEIGHTS
    request_id: int
    agent: str
    version: int
    handle: bytes  # an encoded runtime.param_channel handle; opaque to the controller


class WeightsLoaded(Message):
    # Rollout -> Controller: the engine now samples with `version`.
    KIND = Kind.WEIGHTS_LOADED
    request_id: int
    agent: str
    version: int
    seconds: float


# ---------------------------------------------------------------- trainer


class InitAgent(Message):
    # Controller -> Trainer: build an agent's training state (model + optimizer).
    KIND = Kind.INIT_AGENT
    request_id: int
    agent: str
    model_path: str
    lr: float
    seed: int
    max_grad_norm: float = 1.0


class AgentReady(Message):
    # Trainer -> Controller: the agent's state is resident; its parameter count.
    KIND = Kind.AGENT_READY
    request_id: int
    agent: str
    version: int
    num_params: int


class TrainSample(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One sample in a micro-batch. `rollout_logprobs` are the sampler's, per output token."""

    sample_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    advantage: float
    rollout_logprobs: list[float]
    versions: list[int]  # policy version of every turn that produced the sample


class TrainMicroBatch(Message):
    # Controller -> Trainer: forward/backward one micro-batch, accumulate gradients.
    KIND = Kind.TRAIN_MICROBATCH
    request_id: int
    agent: str
    version: int  # the version these gradients will produce (current + 1)
    samples: list[TrainSample]
    max_staleness: int = 0
    clip_ratio: float = 2.0  # truncated importance sampling cap for off-policy samples


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
    # Micro-batch losses are sums over samples; scaling the summed gradient once by
    # 1 / (samples in the global batch) gives the full-batch mean whatever the split, and
    # the batch size need only be known when the last micro-batch is in.
    KIND = Kind.OPTIM_STEP
    request_id: int
    agent: str
    version: int
    grad_scale: float = 1.0


class StepDone(Message):
    # Trainer -> Controller: optimizer step applied.
    KIND = Kind.STEP_DONE
    request_id: int
    agent: str
    version: int
    grad_norm: float
    seconds: float


class PublishWeights(Message):
    # Controller -> Trainer: make the agent's weights available to rollout workers.
    KIND = Kind.PUBLISH_WEIGHTS
    request_id: int
    agent: str
    version: int
    transport: str = "auto"  # "shm", "tcp", ... ; "auto" picks from where the ends are
    targets: list[str] = []  # worker ids that will receive


class WeightsPublished(Message):
    # Trainer -> Controller: the handle receivers pass to LoadWeights.
    KIND = Kind.WEIGHTS_PUBLISHED
    request_id: int
    agent: str
    version: int
    handle: bytes
    nbytes: int
    seconds: float


class SaveCheckpoint(Message):
    # Controller -> Trainer: write the agent's weights (HF safetensors) to `path`.
    KIND = Kind.SAVE_CHECKPOINT
    request_id: int
    agent: str
    path: str


class CheckpointSaved(Message):
    # Trainer -> Controller: checkpoint written.
    KIND = Kind.CHECKPOINT_SAVED
    request_id: int
    agent: str
    path: str
    version: int


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
    handle: bytes
    nbytes: int
    seconds: float


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
    handle: bytes


class ReleaseState(Message):
    # Controller -> Trainer: drop a parked copy (its new owner has loaded it).
    KIND = Kind.RELEASE_STATE
    request_id: int
    agent: str
    handle: bytes


class StateReleased(Message):
    # Trainer -> Controller: the parked copy is gone.
    KIND = Kind.STATE_RELEASED
    request_id: int
    agent: str


MESSAGE_TYPES: dict[int, type[Message]] = {
    int(cls.KIND): cls for cls in Message.__subclasses__()
}
assert len(MESSAGE_TYPES) == len(Kind), "every Kind needs exactly one Struct"

_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in MESSAGE_TYPES.items()}


def encode(msg: Message, buffers: Sequence[Any] = ()) -> list[Any]:
    """Frames for `msg`; `buffers` (bytes, memoryview, numpy arrays) are appended as-is."""
    return [bytes((int(msg.KIND),)), _encoder.encode(msg), *buffers]


def decode(frames: Sequence[Any]) -> tuple[Message, list[Any]]:
    """Inverse of `encode`. Raises ProtocolError naming what was wrong."""
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames (kind, body), got {len(frames)}")
    kind_frame = memoryview(frames[0])
    if kind_frame.nbytes != 1:
        raise ProtocolError(f"frame 0 must be one byte (the kind), got {kind_frame.nbytes} bytes")
    kind = kind_frame[0]
    decoder = _decoders.get(kind)
    if decoder is None:
        raise ProtocolError(f"unknown message kind {kind}")
    try:
        msg = decoder.decode(frames[1])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad {Kind(kind).name} body: {exc}") from None
    return msg, list(frames[2:])


def frames_nbytes(frames: Sequence[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)
