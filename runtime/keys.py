"""Identity, typed: which group a sample belongs to, and which turn of a sample a request is.

A group is the n samples of one call of the workflow (`ctx.generate`, `ctx.chat`): its
`GroupKey` is the episode, the agent and the call's place in the episode. A sample is a
member of a group: (group key, member index). A later turn of a conversation is a
`TurnKey`: (group key, member, turn), turn 1 the sample's second. Keys travel as they are,
typed, in the wire protocol (protocol.GenGroup) and the event log (events.Parts); nothing
parses them.

`str(key)` is the key's name for people (log lines, errors, `flexmarl samples`) and the
material its sampling seeds are hashed from; it is made here and never read back (the one
reader of older strings, for event logs written before keys were typed, is
runtime/legacy_events.py).

Plain data: no controller, no workers.
"""

from __future__ import annotations

import msgspec


# The turn that names a teacher's scoring of a member (a prefill of the member's prompt and
# output on the teacher, protocol.GenGroup.score_from): a request of the member that
# generates no sample; turn 0 is its first turn, k >= 1 its later ones.
SCORE_TURN = -1


class GroupKey(msgspec.Struct, array_like=True, frozen=True, order=True, gc=False):
    """A group: `call` names the call's place in its episode (made by the episode context
    from the prompt, the calling branch and how many identical calls came before; an
    opaque name, equal only to itself)."""

    episode: str
    agent: str
    call: str

    def __str__(self) -> str:
        return f"{self.episode}/{self.agent}-{self.call}"

    def sample(self, member: int) -> str:
        """Member `member`'s name, for people."""
        return f"{self}/{member}"


class TurnKey(msgspec.Struct, array_like=True, frozen=True, order=True, gc=False):
    """Turn `turn` (1: the second) of member `member` of `group`: one request of one sample."""

    group: GroupKey
    member: int
    turn: int

    def __str__(self) -> str:
        return f"{self.group}/{self.member}@{self.turn}"
