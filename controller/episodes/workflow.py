"""The workflow API: a multi-agent episode is a user-written async function.

    async def episode(ctx: EpisodeContext) -> None:
        plans = await ctx.generate("planner", "Sort 3 1 2", n=4)      # text or token ids
        for plan in plans:
            ctx.reward(plan, score(plan.text))
        answers = await ctx.chat("solver", [{"role": "user", "content": ctx.item["question"]}])
        for a in answers:                                              # a conversation each
            verdict = await ctx.generate("verifier", f"Q: ... A: {a.text} Verdict:")
            await ctx.continue_chat(a, [{"role": "user", "content": f"A reviewer says {verdict[0].text}"}])
            ctx.reward(a, await ctx.call(check, a.text, timeout=5))    # blocking code off the loop
        async with ctx.env_session(Maze, seed=3) as env:               # a stateful environment
            state = await env.step("left")

`ctx.generate` / `ctx.chat` open one group in the experience store (n samples of one
prompt; their advantages are relative to each other), send it through the rollout client
as one request (the prompt once, n, the seed base: one future for the group) and return
read-only views of its samples (store.SampleView, O(1) per access) with their outputs.
`ctx.continue_chat` (or `ctx.continue_ids`) adds another turn to a sample: the new
messages' ids are appended (not trained), then the agent's next turn is generated
(trained), by the instance that generated the turn before if it can (its prefix cache
holds the conversation); every turn records the policy version that produced it and waits
at the staleness gate first. Token ids are the source of truth: `sample.output_ids` are the engine's ids, `sample.text` only
decodes them. A sample changes only through the context (`reward`, `continue_*`), and the
context exposes nothing else of the run: the store, the rollout client, the staleness gate
and the endpoint it works with are its own. Concurrency inside an episode (branches) and
across episodes is plain asyncio; the episode runner bounds it.

`ctx.call(fn, ...)` runs a tool, environment or reward function off the event loop: on an
environment worker (controller/environments/: `fn` by reference, its arguments and value
as msgpack) when the run has any, else in the controller's tool pool. `ctx.env_session`
holds a stateful environment for the episode (on one worker, or here), closed when the
`async with` ends, however it ends.

Agent code written against the OpenAI API takes part through the run's endpoint
(openai_api.py): `ctx.openai_client()` (or `ctx.openai_base_url` and `ctx.openai_api_key`)
points it at this episode, and each call becomes a `chat` or `continue_chat` of this
context (openai_turns.py); `ctx.reward` takes the completion ids it returned, and
`ctx.reward_all` rewards every sample of an agent at once.

If an episode raises or overruns its timeout, it is closed: its other branches still
running are cancelled, any later `generate` in it raises `EpisodeClosed`, and every group
it opened that is not yet trainable is dropped with the reason, counted and logged; the
run goes on.

Group keys (runtime/keys.py: the episode, the agent, the call's place; and with them the
per-sample sampling seeds) follow from the episode, the agent, the prompt, the calling
branch's place in the workflow and how many identical calls that branch made before,
never from which branch happens to call or finish first, so the same episode draws the
same tokens in sync and async mode, with any latency and any number of instances. A branch's place is its path of task creation from the episode: the episode
is (), the i-th task it creates (asyncio.gather creates one per awaitable, in order) is
(i,), that task's j-th is (i, j). `run_episode` installs the task factory that records it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import itertools
import logging
import random
import types
import zlib
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Protocol

from flexmarl.runtime import protocol
from flexmarl.runtime.keys import SCORE_TURN, GroupKey, TurnKey

from ..environments.local import LocalSession, run_here
from ..state.failures import RunFailed, user_frame, user_traceback
from ..state.groups import GroupOutput, Scored, scored
from ..state.store import PENDING, ExperienceStore, SampleView, TurnSampling
from .tokens import PromptTooLong, text_size

log = logging.getLogger("flexmarl.workflow")


SAMPLING_KEYS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos"})


class UnknownAgent(ValueError):
    """A workflow named an agent the config does not define."""


# The running task's place in its episode's tree of tasks (see the module docstring).
BRANCH: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar("flexmarl_branch", default=())
# The most tokens the prompt of the call being made may have, besides the agent's context
# (0: no cap of its own): set by the OpenAI endpoint around each call it hands over.
PROMPT_CAP: contextvars.ContextVar[int] = contextvars.ContextVar("flexmarl_prompt_cap", default=0)
# The running task's count of the tasks it created so far, kept in its own context beside
# BRANCH: (the task's id, the count). A context copied from a task's (a callback's, or a task
# made without the factory) holds another task's id, and so no count of its own.
_CHILDREN: contextvars.ContextVar[tuple[int, Iterator[int]]] = contextvars.ContextVar("flexmarl_children")
# The task running on a loop. Where `asyncio.current_task` is a Python function (3.11), it
# is a lookup in asyncio's table of running tasks, made here directly: a task's creation
# and every turn of an episode paid a Python frame for it. Elsewhere (implemented in C) it
# is called as it is.
_current_task: Callable[[asyncio.AbstractEventLoop], asyncio.Task | None] = (
    asyncio.tasks._current_tasks.get
    if isinstance(asyncio.current_task, types.FunctionType) and hasattr(asyncio.tasks, "_current_tasks")
    else asyncio.current_task)


def _branch_task_factory(loop: asyncio.AbstractEventLoop, coro: Any, *, context: Any = None,
                         **kwargs: Any) -> asyncio.Task:
    """Creates tasks as asyncio does, each with its BRANCH: the parent's plus the number
    of tasks the parent created before it (program order, never timing)."""
    parent = _current_task(loop)
    context = context.copy() if context is not None else contextvars.copy_context()  # the task's own
    if parent is None:
        return asyncio.Task(coro, loop=loop, context=context, **kwargs)
    children = _CHILDREN.get(None)  # the parent's, in its context (the one running)
    if children is None or children[0] != id(parent):
        children = (id(parent), itertools.count())
        _CHILDREN.set(children)
    task = asyncio.Task(coro, loop=loop, context=context, **kwargs)
    context.run(_enter, BRANCH.get() + (next(children[1]),), id(task))
    return task


def _enter(branch: tuple[int, ...], task: int) -> None:
    """In a new task's context: its BRANCH, and no task made by it yet."""
    BRANCH.set(branch)
    _CHILDREN.set((task, itertools.count()))


def track_branches() -> None:
    """Installs the factory that gives every task its BRANCH on the running loop (unless
    the loop already has a task factory of its own, which is then left alone)."""
    loop = asyncio.get_running_loop()
    if loop.get_task_factory() is None:
        loop.set_task_factory(_branch_task_factory)


class EpisodeClosed(Exception):
    """The episode already failed; its remaining branches may not generate."""


class Generator(Protocol):
    async def generate(self, agent: str, group: protocol.GenGroup, after: str = "") -> GroupOutput:
        """The group's output; `after`: the instance that generated the turn before (a later turn)."""


class EpisodeEndpoint(Protocol):
    """What an episode needs of the run's OpenAI endpoint (serving/openai_api.py): a session
    whose key names this episode, its calls turns of this context."""

    def open_session(self, ctx: EpisodeContext) -> Any: ...


@dataclass
class AgentDefaults:
    """An agent's sampling settings from the config; every call may override them."""
    max_tokens: int
    temperature: float
    group_size: int
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    frozen: bool = False  # served, never trained: its samples need no reward
    teacher: str = ""  # on-policy distillation: the agent that scores its samples
    teacher_top_k: int = 0  # > 0: the teacher's top-k next tokens at each scored position too

    @classmethod
    def of(cls, c: Any) -> "AgentDefaults":
        return cls(c.max_tokens, c.temperature, c.group_size, c.top_p, c.top_k, list(c.stop),
                   list(c.stop_token_ids), c.ignore_eos, c.frozen, c.teacher, c.teacher_top_k)


def request_seed(run_seed: int, key: GroupKey, member: int = 0, turn: int = 0) -> int:
    """Deterministic per-sample sampling seed: the same sample draws the same tokens under
    the same weights, whatever the batch it lands in (sync and async agree).

    A group's members (the first turn of member i) get consecutive seeds, base + i with the
    base from the group's key: a rollout worker then adds the group to its engine as one
    request of n samples (vLLM seeds sample i with base + i), the tokens unchanged. A later
    turn's seed is hashed from its turn key whole."""
    if not turn:
        return (zlib.crc32(f"{run_seed}:{key}".encode()) & 0x3FFFFFFF) + member
    return zlib.crc32(f"{run_seed}:{TurnKey(key, member, turn)}".encode()) & 0x7FFFFFFF


class EnvSessionHandle(Protocol):
    """A session as an episode holds it: on a worker (environments/client.py, `EnvSession`)
    or here (environments/local.py, `LocalSession`); `env.NAME(...)` is `env.call("NAME", ...)`."""

    async def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any: ...

    def close_soon(self) -> None: ...


class EnvCaller(Protocol):
    """Environment workers, as `ctx.call` and `ctx.env_session` use them
    (environments/client.py, `EnvClient`)."""

    async def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], timeout_s: float,
                   episode: str = "") -> Any: ...

    async def open_session(self, factory: Callable[..., Any], args: tuple, kwargs: dict[str, Any], timeout_s: float,
                           episode: str = "") -> EnvSessionHandle: ...


@dataclass(frozen=True)
class GroupPlace:
    """Where an episode opened a group: the episode, and the branch of its tree of tasks the
    call came from (`BRANCH`: () the episode's own task, (2, 0) the first task the third
    one made)."""

    episode: str
    branch: tuple[int, ...]


def group_place(key: GroupKey) -> GroupPlace | None:
    """The group `key` read back into its place: the branch is in the key's `call`, as
    `EpisodeContext.group_key` made it (`CRC-OCCURRENCE` or `CRC-bBRANCH-OCCURRENCE`), for
    readers of the event log (the web view); None for a key that method did not make."""
    parts = key.call.split("-")
    if not key.episode or len(parts) not in (2, 3) or not parts[-1].isdecimal():
        return None
    if len(parts) == 2:
        return GroupPlace(key.episode, ())
    place = parts[1].removeprefix("b").split(".")
    if not parts[1].startswith("b") or not all(p.isdecimal() for p in place):
        return None
    return GroupPlace(key.episode, tuple(int(p) for p in place))


@dataclass
class ToolPool:
    """Where `ctx.call` runs functions: on environment workers (`remote`), or else in the
    controller's bounded pool (`executor`; None: asyncio's default); and how long one
    call may take unless it says."""

    executor: Executor | None = None
    timeout_s: float = 60.0
    remote: EnvCaller | None = None


@dataclass
class _Calls:
    """What the episode's code called so far: per (agent, prompt, branch) the calls (the
    next group's id), and the tasks that generated (cancelled when the episode fails)."""

    counts: Counter = field(default_factory=Counter)
    branches: set = field(default_factory=set)


class EpisodeContext:
    """What an episode's code is handed: the agents to call, its dataset row (`item`), a
    random generator of its own (`rng`), tools, and nothing else of the run."""

    def __init__(self, episode_id: str, batch: int, rng: random.Random, store: ExperienceStore,
                 generator: Generator, agents: dict[str, AgentDefaults], run_seed: int, env_latency_ms: float = 0.0,
                 *, gate: Callable[[str, int], Awaitable[None]] | None = None, item: Any = None,
                 tokenizers: dict[str, Any] | None = None, tools: ToolPool | None = None,
                 eval_temperature: float | None = None, trains: bool = True,
                 endpoint: EpisodeEndpoint | None = None) -> None:
        self.episode_id = episode_id
        self.batch = batch  # the global batch this episode belongs to
        self.rng = rng
        self.agents = agents
        self.run_seed = run_seed
        self.env_latency_ms = env_latency_ms
        self.item = item  # the episode's dataset row (None without a dataset)
        self.tokenizers = tokenizers if tokenizers is not None else {}  # agent -> AgentTokenizer (tokens.py)
        self.tools = tools or ToolPool()
        # Evaluation: one greedy (or eval.temperature) sample per call, never trained.
        self.eval_temperature = eval_temperature
        # Serving (`flexmarl serve`): calls of any n, at their own settings, never trained.
        self.trains = trains
        self.closed = ""  # why the episode failed, once it has
        self.failure = ""  # ... and, when it raised, the traceback of the user's code (state/failures.py)
        self._store = store
        self._generator = generator
        # Awaited before every turn: blocks until the agent's rollout weights are recent
        # enough for this global batch (the staleness bound, checked per turn).
        self._gate = gate
        # The run's OpenAI endpoint (openai_api.py), when `openai.enabled`: this episode's
        # calls through it are turns of this context (openai_turns.py).
        self._endpoint = endpoint
        self._opened: list[GroupKey] = []  # the groups this episode opened, in order
        self._called = _Calls()
        self._openai: Any = None  # this episode's OpenAITurns, once its key was asked for
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop its turns run on, once one has

    def group_key(self, agent: str, prompt_ids: list[int]) -> GroupKey:
        """The next group's key: the same call in the same place of the workflow (the same
        branch, after as many identical calls of that branch) gets the same key in every
        run, whatever the timing."""
        branch = BRANCH.get()
        crc = zlib.crc32(repr(prompt_ids if type(prompt_ids) is list else list(prompt_ids)).encode())
        counted, counts = (agent, crc, branch), self._called.counts
        occurrence = counts.get(counted, 0)
        counts[counted] = occurrence + 1
        place = f"b{'.'.join(map(str, branch))}-" if branch else ""
        return GroupKey(self.episode_id, agent, f"{crc:08x}-{place}{occurrence}")  # read back by group_place

    async def generate(self, agent: str, prompt: str | list[int], n: int | None = None,
                       **sampling: Any) -> list[SampleView]:
        """n samples of `agent` for one prompt (text, tokenized with the agent's tokenizer,
        or token ids). `sampling` overrides the agent's settings for this call:
        max_tokens, temperature, top_p, top_k, stop, stop_token_ids, ignore_eos."""
        if isinstance(prompt, str):
            tok = self.tokenizer(agent)
            prompt_ids = await tok.sized(len(prompt), self.prompt_room(agent, sampling), lambda: tok.encode(prompt))
        else:
            prompt_ids = list(prompt)
        return await self._open(agent, prompt_ids, n, sampling, None)

    async def chat(self, agent: str, messages: list[dict], n: int | None = None, tools: list[dict] | None = None,
                   **sampling: Any) -> list[SampleView]:
        """n conversations of `agent` starting from `messages` (the agent's chat template
        makes the prompt, with `tools` if given); each sample's `messages` ends with the
        assistant's reply."""
        tok = self.tokenizer(agent)
        prompt_ids = await tok.sized(text_size(messages), self.prompt_room(agent, sampling),
                                     lambda: tok.chat_prompt(messages, tools))
        return await self._open(agent, prompt_ids, n, sampling, messages)

    async def continue_chat(self, sample: SampleView, messages: list[dict], tools: list[dict] | None = None,
                            **sampling: Any) -> SampleView:
        """Another turn of a `chat` sample: `messages` (other agents' words, tool results)
        are appended, then the agent replies. The trained sample stays one sequence whose
        loss covers only the agent's own turns."""
        self._own(sample)
        said = sample.messages
        if said is None:
            raise ValueError(f"{sample.sample_id} was not made by ctx.chat; use ctx.continue_ids")
        tok = self.tokenizer(sample.agent)
        ids = sample.output_ids
        ended_with_eos = ids is not None and len(ids) > 0 and ids[-1] == tok.eos_token_id
        before = [dict(m) for m in said]
        after = before + [dict(m) for m in messages]
        room = self.prompt_room(sample.agent, sampling)
        if room:  # what the conversation holds already takes room too
            room = max(1, room - len(sample.prompt_ids) - len(ids))
        appended = await tok.sized(text_size(before) + text_size(messages), room,
                                   lambda: tok.chat_delta(before, after, ended_with_eos, tools), "the appended messages")
        self._store.annotate(sample.key, sample.member, sample.text, after)
        return await self._turn(sample, appended, sampling)

    async def continue_ids(self, sample: SampleView, appended_ids: list[int], **sampling: Any) -> SampleView:
        """Another turn of any sample: `appended_ids` (not trained), then the agent's turn."""
        self._own(sample)
        return await self._turn(sample, list(appended_ids), sampling)

    def prompt_room(self, agent: str, sampling: dict) -> int:
        """The most tokens a prompt of `agent` may have in this call: its context less the
        turn's max_tokens, and the call's own cap (PROMPT_CAP); 0: no limit known."""
        cap = PROMPT_CAP.get()
        tok = self.tokenizers.get(agent)
        context = getattr(tok, "context", 0) or 0 if tok is not None else 0  # 0: unknown, the engine alone checks
        if not context:
            return cap
        room = max(1, context - (sampling.get("max_tokens") or self.agents[agent].max_tokens))
        return min(room, cap) if cap else room

    def _fits(self, agent: str, tokens: int, sampling: dict) -> None:
        room = self.prompt_room(agent, sampling)
        if room and tokens > room:
            raise PromptTooLong(f"the prompt is {tokens} tokens; agent {agent} takes at most {room} here")

    def tokenizer(self, agent: str) -> Any:
        self._check_agent(agent)
        if agent not in self.tokenizers:
            raise ValueError(f"agent {agent!r}'s model has no tokenizer; pass token ids instead of text")
        return self.tokenizers[agent]

    def _check_agent(self, agent: str) -> None:
        if agent not in self.agents:
            raise UnknownAgent(f"workflow asked for agent {agent!r}, which is not configured "
                               f"(agents: {', '.join(self.agents)})")

    # ---------------------------------------------------------------- one turn

    async def _open(self, agent: str, prompt_ids: list[int], n: int | None, sampling: dict,
                    messages: list[dict] | None) -> list[SampleView]:
        if self.closed:
            raise EpisodeClosed(self.closed)
        self._check_agent(agent)
        if not prompt_ids:
            raise ValueError(f"{agent}: the prompt is empty; an agent needs something to continue")
        self._fits(agent, len(prompt_ids), sampling)
        if n is None:  # a group; one sample where nothing is trained
            n = self.agents[agent].group_size if self.trains else 1
        if self.eval_temperature is not None:
            n = 1
        elif n < 2 and self.trains:
            raise ValueError(f"generate({agent!r}, n={n}): a group needs at least 2 samples, since "
                             f"advantages are rewards relative to the group's other samples")
        await self._wait_at_gate(agent)
        key = self.group_key(agent, prompt_ids)
        self._store.open_group(key, prompt_ids, n, self.batch)
        self._opened.append(key)
        group, drawn = self._request(agent, key, prompt_ids, n, request_seed(self.run_seed, key), sampling)
        self._store.record_group(key, await self._generator.generate(agent, group), drawn)
        views = self._store.views(key)
        if agent in self.tokenizers:
            for view in views:
                self._after_turn(view, None if messages is None else list(messages), group.stop)
        return views

    async def _turn(self, sample: SampleView, appended: list[int], sampling: dict) -> SampleView:
        if self.closed:
            raise EpisodeClosed(self.closed)
        key, member, agent = sample.key, sample.member, sample.agent
        await self._wait_at_gate(agent)
        context, after, turn = self._store.turn_context(key, member, appended)  # one request per turn
        self._fits(agent, len(context), sampling)
        group, drawn = self._request(agent, key, context, 1, request_seed(self.run_seed, key, member, turn), sampling,
                                     member, turn)
        output = await self._generator.generate(agent, group, after)
        self._store.record_turn(key, member, appended, output, drawn)
        view = self._store.view(key, member)
        if agent in self.tokenizers:
            said = view.messages
            self._after_turn(view, None if said is None else [dict(m) for m in said], group.stop)
        return view

    def _own(self, sample: SampleView) -> None:
        if sample.key.episode != self.episode_id or sample.key not in self._opened:
            raise ValueError(f"{sample.sample_id} belongs to another episode")

    async def _wait_at_gate(self, agent: str) -> None:
        loop = self._loop
        if loop is None:  # asked once: asyncio's asking costs a system call (its fork check)
            loop = self._loop = asyncio.get_running_loop()
        task = _current_task(loop)
        if task is not None:
            self._called.branches.add(task)
        if self._gate is not None:
            await self._gate(agent, self.batch)  # every turn: the staleness bound
        if self.closed:  # failed while this branch waited at the gate
            raise EpisodeClosed(self.closed)

    def _request(self, agent: str, key: GroupKey, context: list[int], n: int, seed: int, sampling: dict,
                 member: int = 0, turn: int = 0) -> tuple[protocol.GenGroup, TurnSampling]:
        """The group to generate (`key` naming it, `context` its prompt, member j drawn with
        seed + j; a later turn: of member `member`, at turn `turn`) and the distribution it
        is sampled from (what the trainer will score it under)."""
        d = self.agents[agent]
        if sampling:  # the call's own settings over the agent's
            unknown = set(sampling) - SAMPLING_KEYS
            if unknown:
                raise TypeError(f"unknown sampling settings {sorted(unknown)} (known: "
                                f"{', '.join(sorted(SAMPLING_KEYS))})")
            d = dataclasses.replace(d, **{k: v for k, v in sampling.items() if v is not None})
        temperature = self.eval_temperature if self.eval_temperature is not None else d.temperature
        # The agent's stop lists are shared, not copied: nothing changes a group once made.
        group = protocol.GenGroup(key, agent, n, context, d.max_tokens, temperature, seed, member, d.top_p, d.top_k,
                                  d.stop, d.stop_token_ids, d.ignore_eos, turn=turn)
        return group, TurnSampling(0, temperature, d.top_p, d.top_k)

    def _after_turn(self, sample: SampleView, messages: list | None, stop: list[str]) -> None:
        """The turn's text (decoded; a stop string's last token is in the ids, not the text)
        and the conversation with the reply appended."""
        tok = self.tokenizers[sample.agent]
        ids, _ = sample.last_turn
        text = tok.decode(ids.tolist())
        if sample.finish_reason == "stop" and stop:
            cut = min((i for i in (text.find(x) for x in stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
        if messages is not None:
            messages = messages + [{"role": "assistant", "content": text}]
        self._store.annotate(sample.key, sample.member, text, messages)

    async def close(self, why: str) -> None:
        """Fails the episode: cancels its other branches and drops every group it opened
        that is not yet trainable (including ones a branch opened after the failure)."""
        self.closed = why
        me = asyncio.current_task()
        branches = [t for t in self._called.branches if t is not me and not t.done()]
        for task in branches:
            task.cancel()
        await asyncio.gather(*branches, return_exceptions=True)
        for key in self._opened:
            self._store.drop_group(key, why)

    async def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Runs a tool, environment or reward function off the event loop and returns its
        result. With environment workers (`cluster.env_workers`) it runs on the least loaded
        one: `fn` must be a module-level function (sent by module and name) and its
        arguments and value msgpack values (sent in the wire's encoding; tuples come back
        as lists); a crash, a memory blow-up or a hang there costs this episode only.
        Without them it runs in the controller's tool pool (`pipeline.tool_threads`
        threads; an async one is awaited). Past `timeout` seconds (default
        `pipeline.tool_timeout_s`) it raises TimeoutError, which fails this episode only."""
        if self.closed:
            raise EpisodeClosed(self.closed)
        limit = self.tools.timeout_s if timeout is None else timeout
        if self.tools.remote is not None:
            return await self.tools.remote.call(fn, args, kwargs, limit, self.episode_id)
        return await run_here(self.tools.executor, fn, args, kwargs, limit)

    @contextlib.asynccontextmanager
    async def env_session(self, factory: Callable[..., Any], *args: Any, timeout: float | None = None,
                          **kwargs: Any) -> AsyncIterator[Any]:
        """A stateful environment for this episode: `factory(*args, **kwargs)` makes its
        object (on one environment worker, in a process of its own, or here without them),
        `await env.step(...)` calls any of its methods there (each under `timeout`), and it
        is closed (its `close()` runs) when the `async with` ends: at the end of the
        episode's use, on its failure, on its cancellation. A session whose worker died is
        lost: its calls raise."""
        if self.closed:
            raise EpisodeClosed(self.closed)
        limit = self.tools.timeout_s if timeout is None else timeout
        env: EnvSessionHandle
        if self.tools.remote is not None:
            env = await self.tools.remote.open_session(factory, args, kwargs, limit, self.episode_id)
        else:
            env = await LocalSession.open(factory, args, kwargs, self.tools.executor, limit)
        try:
            yield env
        finally:
            env.close_soon()

    def reward(self, sample: SampleView | str, value: float | list[float]) -> None:
        """The reward of a sample; or, given the id of a completion the OpenAI endpoint
        returned, of its samples: one value, or one per choice (by index). A frozen agent's
        samples need none; one given is recorded with them, never trained on."""
        if type(sample) is SampleView and type(value) is float:  # the common case, one check
            self._store.set_view_reward(sample, value)
            return
        if isinstance(sample, str):
            samples = self._endpoint_turns().completion(sample)
            values = list(value) if isinstance(value, (list, tuple)) else [value] * (len(samples) == 1)
            if len(values) != len(samples):
                raise ValueError(f"completion {sample} has {len(samples)} choices: give one reward per choice "
                                 f"(a list, by index), or reward them with ctx.reward_all")
            for s, v in zip(samples, values):
                self._store.set_reward(s.key, s.member, v)
            return
        if isinstance(value, (list, tuple)):
            raise TypeError(f"the reward of {sample.sample_id} is one number, not {value!r}")
        self._store.set_view_reward(sample, value)

    def samples(self, agent: str) -> list[SampleView]:
        """Every sample `agent` made in this episode so far (ctx.generate, ctx.chat, the
        OpenAI endpoint), in the order their groups opened."""
        self._check_agent(agent)
        return self._store.agent_views(self._opened, agent)

    def reward_all(self, agent: str, value: float | Callable[[SampleView], float]) -> None:
        """Rewards every sample of `agent` in this episode that has none yet: with `value`,
        or with `value(sample)` where it is a function (a sample's reward from its own
        text or conversation)."""
        for s in self.samples(agent):
            if s.reward is None and s.status == PENDING:
                self._store.set_reward(s.key, s.member, value(s) if callable(value) else value)

    # ---------------------------------------------------------------- the OpenAI endpoint

    @property
    def openai_base_url(self) -> str:
        """Where an OpenAI client reaches the run's endpoint (`openai.enabled`)."""
        return self._endpoint_turns().base_url

    @property
    def openai_api_key(self) -> str:
        """The key that names this episode: every call made with it is a turn of it."""
        return self._endpoint_turns().api_key

    def openai_client(self, **options: Any) -> Any:
        """An `openai.AsyncOpenAI` configured for this episode (`options` go to it). Its
        calls carry the calling branch's place in the workflow, so they open the same
        groups, with the same sampling seeds, as the same `ctx.chat` calls would."""
        return self._endpoint_turns().client(**options)

    def _endpoint_turns(self) -> Any:
        if self._openai is None:
            if self._endpoint is None:
                raise RuntimeError("the OpenAI endpoint is off: set openai.enabled = true in the job's config")
            self._openai = self._endpoint.open_session(self)
        return self._openai

    # ---------------------------------------------------------------- for the endpoint's turns (openai_turns.py)

    @property
    def opened(self) -> list[GroupKey]:
        """The groups this episode opened, in order."""
        return list(self._opened)

    def _groups_opened(self) -> int:
        return len(self._opened)

    def _drop_since(self, count: int, why: str) -> None:
        """Drops the groups opened after the first `count` (a call that failed alone)."""
        for key in self._opened[count:]:
            self._store.drop_group(key, why)

    # ---------------------------------------------------------------- the episode's end

    async def score_by_teachers(self) -> None:
        """The episode's workflow ended: every sample of a distilled agent is final (no turn
        follows), so its teacher scores it, each member's prompt and output in one prefill on
        the teacher's engine (no second generation), after the teacher's own turn of the
        staleness gate; the store records which teacher version scored which member."""
        if not self.trains or self.eval_temperature is not None:
            return  # nothing of it is trained
        await asyncio.gather(*(self._score_group(key) for key in self._store.to_score(self._opened)))

    async def _score_group(self, key: GroupKey) -> None:
        teacher = self._store.teacher_of(key.agent)
        top_k = self.agents[key.agent].teacher_top_k
        await self._wait_at_gate(teacher)

        async def score(member: int, ids: list[int], start: int) -> Scored:
            # The student's group and member name the request; the teacher serves it.
            return scored(await self._generator.generate(teacher, protocol.GenGroup(
                key, teacher, 1, ids, 1, 1.0, 0, member, turn=SCORE_TURN, score_from=start, score_top_k=top_k)))

        outputs = await asyncio.gather(*(score(j, ids, start)
                                         for j, (ids, start) in enumerate(self._store.sequences(key))))
        self._store.record_teacher(key, [s.logprobs for s in outputs], [s.version for s in outputs],
                                   [(s.top_ids, s.top_logprobs) for s in outputs] if top_k else None, top_k)

    def serve_frozen(self) -> None:
        """The episode ended well: its frozen agents' groups are served (generated, never trained)."""
        self._store.serve_groups(self._opened)

    async def end(self) -> None:
        """The episode is over: its key names no live episode from now on."""
        if self._openai is not None:
            await self._openai.end()

    async def env(self, mean_ms: float | None = None) -> None:
        """A simulated tool/environment call: exponentially distributed latency."""
        mean = self.env_latency_ms if mean_ms is None else mean_ms
        if mean > 0:
            await asyncio.sleep(self.rng.expovariate(1000.0 / mean))


Episode = Callable[[EpisodeContext], Awaitable[None]]


async def run_episode(episode: Episode, ctx: EpisodeContext, timeout_s: float) -> str:
    """Runs one episode; returns "" on success or the reason it failed (groups dropped).
    The reason names the user's frame that raised; `ctx.failure` keeps their traceback.
    It runs in the calling task, which becomes the root of the episode's branches."""
    track_branches()
    BRANCH.set(())
    task = asyncio.current_task()
    assert task is not None  # called from a coroutine
    _CHILDREN.set((id(task), itertools.count()))  # its branches are numbered from 0
    try:
        why = await _outcome(episode, ctx, timeout_s)
    finally:
        await ctx.end()
    if why:
        log.warning("%s; dropping its unfinished groups", why)
        await ctx.close(why)
    return why


async def _outcome(episode: Episode, ctx: EpisodeContext, timeout_s: float) -> str:
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            await episode(ctx)
            await ctx.score_by_teachers()
        # A frozen agent's groups need no reward: they are served, never trained.
        unfinished = [k for k in ctx._store.pending(ctx._opened) if not ctx.agents[k.agent].frozen]
        if unfinished:
            named = ctx._openai.name_groups(unfinished) if ctx._openai is not None else list(map(str, unfinished))
            raise RuntimeError(f"episode ended without rewarding every sample of {named[:3]}")
        ctx.serve_frozen()
        return ""
    except (asyncio.CancelledError, RunFailed):  # RunFailed: the run's failure (no instance left), not the episode's
        raise
    except Exception as exc:  # a user's reward function or workflow bug: drop, count, go on
        if isinstance(exc, TimeoutError) and deadline.expired():
            ctx.failure = why = f"episode {ctx.episode_id} timed out after {timeout_s:.0f}s"
            return why
        # a tool's own timeout (ctx.call) is the episode's failure, not its deadline
        where = user_frame(exc)
        ctx.failure = user_traceback(exc)
        return f"episode {ctx.episode_id} failed: {type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")
