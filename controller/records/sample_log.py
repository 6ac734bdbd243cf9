"""What the agents actually said: a few trained samples per agent per step, as text.

With `run.samples_per_step = N`, every optimizer step of every agent writes N of the
samples it trained to RUN_DIR/samples.jsonl (and to the trackers: `log_samples`), the
best and the worst reward first, the rest spread evenly between them. Each line:

    {"step": 3, "agent": "solver", "sample_id": "...", "group": [EPISODE, AGENT, CALL],
     "member": 1, "reward": 0.75, "versions": [2, 2],
     "turns": [{"role": "user", "text": "What is 7 + 5?"},
               {"role": "assistant", "text": "13", "version": 2}, ...]}

A conversation (`ctx.chat`) is given by its messages; a sample made from text or token ids
by its prompt and then each stretch of its output ids, decoded with the agent's tokenizer:
the agent's own turns ("agent", with the policy version of each) and the ids appended
between them ("appended"). A sample whose turn's weights changed under it (a sync that let
its request continue) also has "token_versions": its output ids' versions as runs,
[version, count] each, in order. `flexmarl samples RUN_DIR` prints the file
(`format_samples`). `sample_id` is the sample's name for people; `group` (its group's key,
runtime/keys.py, as a list) and `member` say which sample it is to a program (the web view).

A frozen agent's samples (generated, never trained) are written the same way, marked
`"trained": false`, once the step of their batch has ended (`record_served`).

`SampleLog.group_ready` is told each trainable group's samples (read-only views) and keeps
what a row needs of them (the store lets the group go once trained) until its step is
recorded; `group_served` keeps a frozen agent's served samples the same way.
It does not know pipelines, trainers or how samples are made.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

from flexmarl.runtime.atomic import write_text_atomically

if TYPE_CHECKING:
    from .trackers import Tracker

FILE = "samples.jsonl"


class Decoder(Protocol):
    """What the log needs of an agent's tokenizer (episodes/tokens.AgentTokenizer)."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class _Snapshot:
    """What a row needs of a sample, as its view gave it when its group was ready. The
    sequences are the view's own (read-only memoryviews of buffers the store never changes
    in place, or lists made for it), turned into lists only for the samples a row is
    written of: most of them are never written."""

    batch: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    mask: Sequence[int]
    versions: list[int]
    reward: float | None  # None: a frozen agent's sample the workflow gave no reward
    messages: Sequence[Mapping[str, Any]] | None
    group: list[str]  # the group's key (episode, agent, call)
    member: int
    token_versions: Sequence[int]  # its output ids' versions


class SampleLog:
    def __init__(self, run_dir: str | Path, per_step: int, tokenizers: Mapping[str, Decoder],
                 trackers: Iterable[Tracker] = (), *, resumed_after: int | None = None) -> None:
        self.per_step = per_step
        self.tokenizers = tokenizers  # agent -> AgentTokenizer, filled at set-up
        self.trackers = list(trackers)
        self.path = Path(run_dir) / FILE
        # agent -> group key -> (sample name, snapshot) per member
        self._kept: dict[str, dict[Any, list[tuple[str, _Snapshot]]]] = defaultdict(dict)
        self._served: dict[str, list[tuple[str, _Snapshot]]] = defaultdict(list)  # frozen agent -> its served samples
        if resumed_after is None:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():  # a resumed run writes the steps after its checkpoint again
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and (step := _step_of(line)) is not None and step <= resumed_after]
            write_text_atomically(self.path, "".join(line + "\n" for line in kept))

    def group_ready(self, agent: str, key: Any, samples: list[Any]) -> None:
        """The group `key` is trainable: its members' views."""
        self._kept[agent][key] = [(s.sample_id, _snapshot(s)) for s in samples]

    def group_served(self, agent: str, samples: list[Any]) -> None:
        """A frozen agent's group was served: its members' views."""
        self._served[agent] += [(s.sample_id, _snapshot(s)) for s in samples]

    def record_served(self, step: int) -> list[dict[str, Any]]:
        """Writes `per_step` of each frozen agent's samples of the batches up to `step`
        (marked not trained) and forgets the rest of them."""
        rows = []
        for agent, kept in self._served.items():
            due = [(sid, snap) for sid, snap in kept if snap.batch <= step]
            kept[:] = [(sid, snap) for sid, snap in kept if snap.batch > step]
            rows += [{**self._row(step, agent, sid, snap), "trained": False} for sid, snap in pick(due, self.per_step)]
        self._write(step, rows)
        return rows

    def record(self, step: int, agent: str, keys: list[Any]) -> list[dict[str, Any]]:
        """Writes `per_step` of the samples `agent` trained at `step` (the groups `keys`);
        forgets the rest of that step and every earlier one (dropped samples too)."""
        kept = self._kept[agent]
        trained = [member for key in keys for member in kept.get(key, ())]
        for key in [key for key, members in kept.items() if members and members[0][1].batch <= step]:
            del kept[key]
        rows = [self._row(step, agent, sid, snap) for sid, snap in pick(trained, self.per_step)]
        self._write(step, rows)
        return rows

    def _write(self, step: int, rows: list[dict[str, Any]]) -> None:
        if rows:
            with open(self.path, "a") as fh:
                fh.writelines(json.dumps(row) + "\n" for row in rows)
            for agent in dict.fromkeys(row["agent"] for row in rows):
                for tracker in self.trackers:
                    if hasattr(tracker, "log_samples"):
                        tracker.log_samples(step, agent, [row for row in rows if row["agent"] == agent])

    def _row(self, step: int, agent: str, sample_id: str, snap: _Snapshot) -> dict[str, Any]:
        row = {"step": step, "agent": agent, "sample_id": sample_id, "group": snap.group, "member": snap.member,
               "reward": snap.reward, "versions": snap.versions, "turns": self._turns(agent, snap)}
        token_versions = runs(snap.token_versions)
        if len(token_versions) > len(snap.versions):  # a turn's tokens span versions
            row["token_versions"] = token_versions
        return row

    def _turns(self, agent: str, snap: _Snapshot) -> list[dict[str, Any]]:
        if snap.messages is not None:
            messages = [dict(m) for m in snap.messages]
            versions = iter(snap.versions)
            turns = []
            replies = sum(1 for m in messages if m.get("role") == "assistant")
            prompt_replies = replies - len(snap.versions)  # assistant turns given in the prompt
            for m in messages:
                turn = {"role": m.get("role", "?"), "text": str(m.get("content", ""))}
                if m.get("role") == "assistant":
                    if prompt_replies > 0:
                        prompt_replies -= 1
                    else:
                        turn["version"] = next(versions, None)
                turns.append(turn)
            return turns
        decode = self._decoder(agent)
        turns = [{"role": "prompt", "text": decode(list(snap.prompt_ids))}]
        versions = iter(snap.versions)
        for generated, ids in _stretches(list(snap.output_ids), list(snap.mask)):
            turn = {"role": "agent" if generated else "appended", "text": decode(ids)}
            if generated:
                turn["version"] = next(versions, None)
            turns.append(turn)
        return turns

    def _decoder(self, agent: str) -> Callable[[list[int]], str]:
        tok = self.tokenizers.get(agent)
        return tok.decode if tok is not None else (lambda ids: " ".join(map(str, ids)))


def _snapshot(s: Any) -> _Snapshot:
    """What a row needs of a sample's view, without a copy of its tokens (O(1) a sample)."""
    return _Snapshot(s.batch, s.prompt_ids, s.output_ids, s.mask, s.versions, s.reward, s.messages,
                     [s.key.episode, s.key.agent, s.key.call], s.member, s.token_versions)


def runs(versions: Any) -> list[list[int]]:
    """A sequence of versions as runs, [version, count] each, in order."""
    out: list[list[int]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _step_of(line: str) -> int | None:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a line torn by a crash
        return None


def pick(items: list[tuple[str, _Snapshot]], n: int) -> list[tuple[str, _Snapshot]]:
    """The best and the worst reward first, then the rest evenly spread between them."""
    ranked = sorted(items, key=lambda item: -(item[1].reward if item[1].reward is not None else -math.inf))
    if n <= 0 or not ranked:
        return []
    if len(ranked) <= n:
        chosen = list(range(len(ranked)))
    else:
        chosen = sorted({round(i * (len(ranked) - 1) / max(1, n - 1)) for i in range(n)})
    order = [chosen[0]] + ([chosen[-1]] if len(chosen) > 1 else []) + chosen[1:-1]
    return [ranked[i] for i in order]


def _stretches(ids: list[int], mask: list[int]) -> list[tuple[bool, list[int]]]:
    """The output ids cut where the mask changes: (generated?, ids) in order."""
    out: list[tuple[bool, list[int]]] = []
    for i, m in zip(ids, mask or [1] * len(ids)):
        if out and out[-1][0] == bool(m):
            out[-1][1].append(i)
        else:
            out.append((bool(m), [i]))
    return out


def format_samples(rows: list[dict[str, Any]], step: int | None = None, agent: str | None = None) -> str:
    """The rows as a person reads them: by step, then agent, best and worst reward first."""
    lines: list[str] = []
    shown = [r for r in rows if (step is None or r["step"] == step) and (agent is None or r["agent"] == agent)]
    for (s, a) in sorted({(r["step"], r["agent"]) for r in shown}, key=lambda k: (k[0], k[1])):
        mine = [r for r in shown if r["step"] == s and r["agent"] == a]
        rewards = [r["reward"] for r in mine if r["reward"] is not None] or [math.nan]
        lines.append(f"=== step {s}  agent {a}  ({len(mine)} samples, reward {max(rewards):.3f} best, "
                     f"{min(rewards):.3f} worst)")
        for r in mine:
            label = "best" if r["reward"] == max(rewards) else "worst" if r["reward"] == min(rewards) else ""
            served = "  (served: generated, not trained)" if r.get("trained") is False else ""
            reward = "none" if r["reward"] is None else f"{r['reward']:.3f}"
            lines.append(f"--- {r['sample_id']}  reward {reward} {label}  versions {r['versions']}{served}")
            if r.get("token_versions"):  # weights changed under a turn: which tokens each version made
                lines.append("  tokens by version: " + ", ".join(f"v{v} x{n}" for v, n in r["token_versions"]))
            for t in r["turns"]:
                version = f" (v{t['version']})" if t.get("version") is not None else ""
                text = t["text"].replace("\n", "\n    ")
                lines.append(f"  {t['role']}{version}: {text}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n" if lines else "no samples recorded (is run.samples_per_step set?)\n"


def selection_problem(rows: list[dict[str, Any]], step: int | None = None, agent: str | None = None) -> str | None:
    """Why `--step` / `--agent` select none of `rows`, in a line; None when they select some."""
    steps, agents = sorted({r["step"] for r in rows}), sorted({r["agent"] for r in rows})
    if not rows:
        return "no samples recorded (set run.samples_per_step = N to record N per agent per step)"
    if step is not None and step not in steps:
        return f"no samples of step {step}: the run recorded steps {steps[0]} to {steps[-1]}"
    if agent is not None and agent not in agents:
        return f"no samples of agent {agent!r}: the run recorded {', '.join(agents)}"
    if step is not None and agent is not None and not any(r["step"] == step and r["agent"] == agent for r in rows):
        return f"no samples of agent {agent!r} at step {step}"
    return None


def read_samples(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: set run.samples_per_step = N to record N samples per "
                                f"agent per step")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
