"""What the experience store's group record costs: the training wire's bytes per micro-batch,
and reading a sample through its read-only view.

1. Wire: the TRAIN_MICROBATCH messages the pipeline sends for a global batch, made the way
   the controller makes them (a real `ExperienceStore`: groups opened, their replies
   recorded as the rollout packed them, rewarded, cut into micro-batches by the pipeline's
   rule) and encoded by the protocol; bytes per micro-batch (all frames), and the same
   micro-batches in the message shape the protocol had before groups crossed the wire
   (`--old`: a sample a struct, its group's prompt copied into each, ids, logprobs and the
   mask as msgpack lists, its name as a string; the structs as protocol 8 declared them),
   for
   - default: the embedded default job (the digit chain: planner, solver and checker
     groups of 4, 4 and 2, outputs of 3, 6 and 1 ids, its prompts; micro-batches of 32);
   - group16: groups of 16 samples of one 512-token prompt, outputs of --output-len ids,
     micro-batches of 64 samples.
2. Views: `last_turn` of each choice of an 8-choice reply of 256, 1,024 and 4,096 output
   ids (what the OpenAI endpoint reads to answer a call), and a read of `output_ids`, in
   microseconds per choice: the median of --reps.

    python bench/micro/group_record.py [--output-len 128] [--reps 200]
    python bench/micro/group_record.py --smoke
"""

from __future__ import annotations

import argparse
import array
import json
import random
import statistics
import time

import msgspec

from flexmarl.controller.serving.openai_turns import last_turn
from flexmarl.controller.state.decisions import MicroBatchSize
from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.store import ExperienceStore, TurnSampling
from flexmarl.controller.tasks import digit_chain as dc
from flexmarl.runtime import protocol
from flexmarl.runtime.keys import GroupKey


class OldTurnSampling(msgspec.Struct, array_like=True):
    start: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


class OldTrainSample(msgspec.Struct, array_like=True):
    """protocol 8's TrainSample: one sample of a micro-batch."""

    sample_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    advantage: float
    rollout_logprobs: list[float]
    versions: list[int]
    temperature: float = 1.0
    loss_mask: list[int] = []
    top_p: float = 1.0
    top_k: int = 0
    turns: list[OldTurnSampling] = []


class OldTrainMicroBatch(msgspec.Struct, array_like=True):
    """protocol 8's TrainMicroBatch: the micro-batch as a list of samples."""

    request_id: int
    agent: str
    version: int
    samples: list[OldTrainSample]
    max_staleness: int = 0
    clip_ratio: float = 2.0
    loss: protocol.LossOptions = msgspec.field(default_factory=protocol.LossOptions)


def unpacked(typecode: str, data: bytes) -> list:
    return array.array(typecode, protocol.native(typecode, data)).tolist()


def old_message(msg: protocol.TrainMicroBatch) -> OldTrainMicroBatch:
    """The micro-batch `msg` as protocol 8 sent it: the same samples, each whole."""
    samples = []
    for g in msg.groups:
        prompt = unpacked(protocol.TOKEN_TYPECODE, g.prompt_ids)
        ids = unpacked(protocol.TOKEN_TYPECODE, g.output_ids)
        logprobs = unpacked(protocol.LOGPROB_TYPECODE, g.rollout_logprobs)
        mask = list(g.loss_mask)
        start = 0
        for j, n in enumerate(g.lengths):
            own = mask[start:start + n]
            samples.append(OldTrainSample(g.key.sample(j), list(prompt), ids[start:start + n], g.advantages[j],
                                          logprobs[start:start + n], [g.versions[j]], g.temperature,
                                          [] if all(own) else own, g.top_p, g.top_k))
            start += n
    return OldTrainMicroBatch(msg.request_id, msg.agent, msg.version, samples, msg.max_staleness, msg.clip_ratio,
                              msg.loss)


def wire_bytes(groups: list[tuple[str, list[int], list[list[int]]]], micro_batch: int,
               old: bool = False) -> dict[str, list[int]]:
    """Per agent, the bytes of each TRAIN_MICROBATCH of a batch of `groups` (agent, prompt,
    outputs): as sent now, or (`old`) in protocol 8's shape (the kind byte and the body)."""
    store = ExperienceStore(sorted({agent for agent, _, _ in groups}))
    for i, (agent, prompt, outputs) in enumerate(groups):
        key = GroupKey("s1q0", agent, f"{i:08x}-0")
        store.open_group(key, prompt, len(outputs), 1)
        store.record_group(key, output_of(outputs, [[-0.5] * len(o) for o in outputs], 0), TurnSampling(0))
        store.set_group_rewards(key, [float(j % 2) for j in range(len(outputs))])
    sizes: dict[str, list[int]] = {}
    for agent in sorted({agent for agent, _, _ in groups}):
        for mb in store.form_micro_batches(agent, 1, MicroBatchSize(micro_batch), True, False, 0):
            msg = protocol.TrainMicroBatch(1, agent, 1, mb.wire())
            nbytes = 1 + len(msgspec.msgpack.encode(old_message(msg))) if old else protocol.frames_nbytes(protocol.encode(msg))
            sizes.setdefault(agent, []).append(nbytes)
    return sizes


def default_job(queries: int, rng: random.Random) -> list[tuple[str, list[int], list[list[int]]]]:
    """The digit chain's groups of `queries` episodes, with the real prompts and output lengths."""
    groups = []
    for _ in range(queries):
        query = dc.make_query(rng)
        plans = [[rng.choice(dc.DIGIT_IDS) for _ in range(dc.OUTPUT_LEN[dc.PLANNER])] for _ in range(4)]
        groups.append((dc.PLANNER, dc.planner_prompt(query), plans))
        for plan in plans:
            answers = [[rng.choice(dc.DIGIT_IDS) for _ in range(dc.OUTPUT_LEN[dc.SOLVER])] for _ in range(4)]
            groups.append((dc.SOLVER, dc.solver_prompt(plan), answers))
            for answer in answers:
                verdicts = [[rng.choice(dc.DIGIT_IDS) for _ in range(dc.OUTPUT_LEN[dc.CHECKER])] for _ in range(2)]
                groups.append((dc.CHECKER, dc.checker_prompt(plan, answer), verdicts))
    return groups


def group16_job(groups: int, output_len: int, rng: random.Random) -> list[tuple[str, list[int], list[list[int]]]]:
    return [("agent", [rng.randrange(4, 32000) for _ in range(512)],
             [[rng.randrange(4, 32000) for _ in range(output_len)] for _ in range(16)]) for _ in range(groups)]


def view_us(tokens: int, choices: int, reps: int) -> dict[str, float]:
    """Microseconds per choice to read `last_turn` and `output_ids` of an n-choice reply."""
    store = ExperienceStore(["a"])
    key = GroupKey("e", "a", "g")
    store.open_group(key, list(range(32)), choices, 1)
    store.record_group(key, output_of([[7] * tokens] * choices, [[-0.5] * tokens] * choices), TurnSampling(0))
    views = store.views(key)
    out = {}
    for name, read in (("last_turn_us", lambda v: v.last_turn), ("output_ids_us", lambda v: v.output_ids),
                       ("last_turn_as_lists_us", last_turn)):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for v in views:
                read(v)
            times.append((time.perf_counter() - t0) / choices)
        out[name] = round(1e6 * statistics.median(times), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-len", type=int, default=128, help="output ids per sample of the group16 job")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="small batches, few repetitions")
    args = parser.parse_args()
    rng = random.Random(0)
    jobs = {"default": (default_job(2 if args.smoke else 16, rng), 32),
            "group16": (group16_job(4 if args.smoke else 16, 16 if args.smoke else args.output_len, rng), 64)}
    for name, (groups, micro_batch) in jobs.items():
        old = wire_bytes(groups, micro_batch, old=True)
        for agent, sizes in wire_bytes(groups, micro_batch).items():
            print(json.dumps({"wire": name, "agent": agent, "micro_batches": len(sizes),
                              "samples": sum(len(o) for a, _, o in groups if a == agent),
                              "bytes_per_micro_batch": round(statistics.mean(sizes)), "bytes_max": max(sizes),
                              "old_bytes_per_micro_batch": round(statistics.mean(old[agent])),
                              "old_bytes_max": max(old[agent]),
                              "old_over_new": round(statistics.mean(old[agent]) / statistics.mean(sizes), 2)}))
    for tokens in (256, 1024, 4096):
        row = view_us(tokens, 8, 5 if args.smoke else args.reps)
        print(json.dumps({"view": f"{tokens} tokens x 8 choices", **row}))


if __name__ == "__main__":
    main()
