"""Which adapter versions an engine holds, which requests use each, and when each may go.

An engine that serves agents as LoRA adapters of its model holds, per agent, the newest
version it was sent and every older version a request in flight still uses: a request
runs to its end under the adapter it was admitted with, whatever arrives meanwhile. A
version that is neither the newest nor in use is retired at once (the engine unloads it
and deletes its directory). The engine holds at most `capacity` adapters (its
max_cpu_loras); a new version that would pass it is refused before anything changes.

Or a new version moves the requests along (`move`, a load "keep" or "recompute"): it
takes the newest version's LoRA id, so the requests running under that id run under the
new weights from their next token on. Each such request's moves are noted (the version
from then on and each sample's tokens so far), so its tokens' versions can be told
(`token_versions`).

Each version gets a name `agent@version` and a LoRA id of its own, never reused: vLLM's
prefix cache keys blocks on the adapter's name and path, so two versions (or two agents)
never share cached keys and values.

Plain bookkeeping: no vLLM, no files. `VllmEngine` does the loading and unloading.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field


# A sample missing from a move's counts had finished: every token of it came before.
FINISHED = sys.maxsize


@dataclass
class Moves:
    """A request's adapter versions: `first` from its first token, then each `(version,
    tokens so far per sample index)` of a move, in order."""

    first: int
    then: list[tuple[int, dict[int, int]]] = field(default_factory=list)

    def token_versions(self, lengths: list[int]) -> list[int]:
        """Per token of samples `lengths` long, back to back, the version that produced it."""
        out: list[int] = []
        for j, length in enumerate(lengths):
            version, start = self.first, 0
            for later, starts in self.then:
                end = max(start, min(starts.get(j, FINISHED), length))
                out += [version] * (end - start)
                version, start = later, end
            out += [version] * (length - start)
        return out


class AdapterSlotsFull(RuntimeError):
    """A new adapter version would exceed the engine's adapter capacity; nothing changed."""


@dataclass
class ResidentAdapter:
    agent: str
    version: int
    lora_id: int  # vLLM's lora_int_id, unique within the engine's life
    path: str  # the directory vLLM loaded it from (and reloads it from after an eviction)
    users: set[str] = field(default_factory=set)  # engine request names admitted under it

    @property
    def name(self) -> str:
        return f"{self.agent}@{self.version}"


class AdapterRegistry:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._resident: dict[tuple[str, int], ResidentAdapter] = {}
        self._newest: dict[str, int] = {}
        self._user_of: dict[str, ResidentAdapter] = {}
        self._next_id = 1
        self._moves: dict[str, Moves] = {}  # a request moved to newer versions -> its moves

    def __len__(self) -> int:
        return len(self._resident)

    def resident(self) -> list[tuple[str, int]]:
        """(agent, version) of every adapter held, oldest first per agent."""
        return sorted(self._resident)

    def serves(self, agent: str) -> bool:
        return agent in self._newest

    def newest(self, agent: str) -> int:
        return self._newest[agent]

    def resolve(self, agent: str, version: int = -1) -> ResidentAdapter:
        """The adapter a request of `agent` runs under: `version`, or the newest (-1).
        Raises KeyError saying what is held."""
        if agent not in self._newest:
            raise KeyError(f"no adapter of {agent!r} is loaded here (loaded: {self._held()})")
        key = (agent, self._newest[agent] if version < 0 else version)
        if key not in self._resident:
            raise KeyError(f"{agent!r} version {version} is not loaded here (loaded: {self._held()})")
        return self._resident[key]

    def serving(self, agent: str, version: int = -1) -> ResidentAdapter:
        """The adapter a request issued under `agent`'s `version` runs under: that version
        if held, else the newest when it is newer (this instance took a newer one while
        the sync that brings every instance to it was under way); never an older one."""
        newest = self._newest.get(agent)
        if newest is not None and version >= 0 and (agent, version) not in self._resident and newest > version:
            return self._resident[(agent, newest)]
        return self.resolve(agent, version)

    def check_room(self, agent: str, version: int) -> None:
        """Raises unless `agent` at `version` can be added now (a newer version than held,
        and room for it once the versions it retires are gone)."""
        self.check_newer(agent, version)
        freed = sum(1 for r in self._resident.values() if r.agent == agent and not r.users)
        if len(self._resident) - freed + 1 > self.capacity:
            raise AdapterSlotsFull(
                f"adapter {agent}@{version} does not fit: the engine holds {len(self._resident)} adapters "
                f"({self._held()}), {len(self._resident) - freed} of them in use, and has room for "
                f"{self.capacity} (max_cpu_loras); requests of older versions must finish first")

    def reserve_id(self) -> int:
        """A LoRA id never given before (one failed load wastes one; ids are plenty)."""
        self._next_id += 1
        return self._next_id - 1

    def add(self, adapter: ResidentAdapter) -> None:
        """Registers a version `check_room` allowed, now loaded; the caller then `retire`s."""
        self._resident[(adapter.agent, adapter.version)] = adapter
        self._newest[adapter.agent] = adapter.version

    def check_newer(self, agent: str, version: int) -> None:
        """Raises unless `version` is newer than `agent`'s newest (what `move` needs)."""
        newest = self._newest.get(agent, -1)
        if version <= newest:
            raise ValueError(f"adapter {agent}@{version} is not newer than the loaded {agent}@{newest}")

    def move(self, agent: str, version: int, path: str,
             tokens_so_far: Callable[[str], dict[int, int]]) -> tuple[ResidentAdapter, str]:
        """`agent`'s newest adapter becomes `version`, now loaded from `path` under the same
        LoRA id: its requests run under `version` from their next token. `tokens_so_far`
        gives a request's tokens per sample index (a sample it leaves out has finished).
        Returns the adapter and the directory it was loaded from before (the caller deletes it)."""
        self.check_newer(agent, version)
        adapter = self._resident.pop((agent, self._newest[agent]))
        for request in adapter.users:
            moves = self._moves.setdefault(request, Moves(adapter.version))
            moves.then.append((version, tokens_so_far(request)))
        old, adapter.version, adapter.path = adapter.path, version, path
        self._resident[(agent, version)] = adapter
        self._newest[agent] = version
        return adapter, old

    def use(self, request: str, adapter: ResidentAdapter) -> None:
        adapter.users.add(request)
        self._user_of[request] = adapter

    def release(self, request: str) -> Moves | None:
        """The request finished or was aborted; its adapter may become retirable. Returns
        its moves (None: it ran under the version it was admitted with throughout)."""
        adapter = self._user_of.pop(request, None)
        if adapter is not None:
            adapter.users.discard(request)
        return self._moves.pop(request, None)

    def retire(self) -> list[ResidentAdapter]:
        """Takes out and returns every adapter neither newest nor in use."""
        gone = [r for r in self._resident.values() if not r.users and self._newest[r.agent] != r.version]
        for r in gone:
            del self._resident[(r.agent, r.version)]
        return gone

    def clear(self) -> list[ResidentAdapter]:
        gone = list(self._resident.values())
        self._resident.clear()
        self._newest.clear()
        self._user_of.clear()
        self._moves.clear()
        return gone

    def _held(self) -> str:
        return ", ".join(r.name for r in self._resident.values()) or "none"
