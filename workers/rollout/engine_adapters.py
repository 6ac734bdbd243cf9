"""Which adapter versions an engine holds, which requests use each, and when each may go.

An engine that serves agents as LoRA adapters of its model holds, per agent, the newest
version it was sent and every older version a request in flight still uses: a request
runs to its end under the adapter it was admitted with, whatever arrives meanwhile. A
version that is neither the newest nor in use is retired at once (the engine unloads it
and deletes its directory). The engine holds at most `capacity` adapters (its
max_cpu_loras); a new version that would pass it is refused before anything changes.

Each version gets a name `agent@version` and a LoRA id of its own, never reused: vLLM's
prefix cache keys blocks on the adapter's name and path, so two versions (or two agents)
never share cached keys and values.

Plain bookkeeping: no vLLM, no files. `VllmEngine` does the loading and unloading.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        newest = self._newest.get(agent, -1)
        if version <= newest:
            raise ValueError(f"adapter {agent}@{version} is not newer than the loaded {agent}@{newest}")
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

    def use(self, request: str, adapter: ResidentAdapter) -> None:
        adapter.users.add(request)
        self._user_of[request] = adapter

    def release(self, request: str) -> None:
        """The request finished or was aborted; its adapter may become retirable."""
        adapter = self._user_of.pop(request, None)
        if adapter is not None:
            adapter.users.discard(request)

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
        return gone

    def _held(self) -> str:
        return ", ".join(r.name for r in self._resident.values()) or "none"
