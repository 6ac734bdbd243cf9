"""Groups put into an experience store as the rollout side and a workflow would: opened,
generated (one output per member) and rewarded."""

from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.store import TurnSampling
from flexmarl.runtime.keys import GroupKey


def key(call: str, agent: str = "a", episode: str = "e") -> GroupKey:
    return GroupKey(episode, agent, call)


def generated(store, k: GroupKey, outputs, version=0, logprob: float = -0.5):
    """The group's outputs came back: member j's ids `outputs[j]`, by `version` (one for all,
    or one per member)."""
    store.record_group(k, output_of([list(o) for o in outputs], [[logprob] * len(o) for o in outputs], version),
                       TurnSampling(0))


def filled(store, agent: str, call: str, rewards, batch: int = 1, version=0, output=(2,), prompt=(1,)) -> GroupKey:
    """A group of `len(rewards)` members opened, generated (each `output`) and rewarded."""
    k = key(call, agent)
    store.open_group(k, list(prompt), len(rewards), batch)
    generated(store, k, [output] * len(rewards), version)
    store.set_group_rewards(k, rewards)
    return k
