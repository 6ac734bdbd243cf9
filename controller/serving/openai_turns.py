"""One episode's calls of the OpenAI API, as turns of its agents.

The endpoint (openai_api.py) hands each call, parsed and authorised, to the `OpenAITurns`
of the episode its key names. A chat call:

- continues a sample when its messages extend that sample's conversation as the client
  saw it (the messages it was called with, then the reply as returned: text and tool
  calls, then new messages): the new messages are appended and the agent takes another
  turn (`ctx.continue_chat`). The earlier replies stay the engine's own ids: rendering
  them again from their text could tokenize them otherwise, and the trained sample would
  no longer be what the sampler drew. Of several samples the call extends (two choices
  that said the same), the first whose conversation has not moved on and that no other
  call is continuing at the moment;
- otherwise opens a group (`ctx.chat`): `n` samples; without `n`, what ctx.chat gives (the
  agent's group_size in training, one sample in evaluation).

A text completion opens a group (`ctx.generate`), or continues a sample whose prompt and
reply begin the new prompt (`ctx.continue_ids` with the rest, as ids).

Each call goes through the episode context, so it waits at the staleness gate and records
its policy version and sampling settings like any turn. Each completion id names its
samples (`ctx.reward(completion_id, ...)`). Responses are vLLM's OpenAI protocol models; a
reply's tool calls are parsed from its text by the agent's vLLM tool parser
(`agents.*.tool_parser`), while what is trained stays the engine's ids.

Settings a call may carry that would change the distribution tokens are drawn from
(penalties, logit bias, min_p, constrained output) are refused: the trainer scores every
token under temperature, top_k and top_p alone, and anything else would make the sampler's
logprobs disagree with it.

It does not know HTTP or keys (openai_api.py), nor how samples are stored.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..state.store import PENDING

if TYPE_CHECKING:
    from ..episodes.workflow import EpisodeContext

# The request fields a call may set, besides those honoured below: they change nothing
# about the tokens drawn (an id, a user name, the sampling seed: each sample's seed
# follows from its id, for sync and async runs to draw alike).
HARMLESS = frozenset({"model", "user", "seed", "parallel_tool_calls", "request_id", "session_id",
                      "service_tier", "include_reasoning", "skip_special_tokens",
                      "spaces_between_special_tokens", "stream_options", "stream"})
HONOURED = frozenset({"messages", "prompt", "n", "temperature", "top_p", "top_k", "max_tokens",
                      "max_completion_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs",
                      "top_logprobs", "tools", "tool_choice", "return_token_ids"})
# Values of refused fields that change nothing (a penalty of 0, a factor of 1).
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "length_penalty": 1,
           "min_p": 0, "min_tokens": 0}
TEXT_PARTS = ("text", "input_text", "output_text")


class CallError(Exception):
    """A call this episode cannot serve, with the HTTP status and the field to blame."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class Conversation:
    """A sample's conversation as its client saw it: every message, its reply last."""
    agent: str
    sample: Any
    said: list[tuple]  # canonical messages (see `canonical`)
    busy: bool = False  # a call is continuing it now: a concurrent call must take another


def check_supported(request: Any) -> None:
    """Refuses a setting the trainer could not score under (see the module docstring)."""
    fields = type(request).model_fields
    for name in sorted(request.model_fields_set - HONOURED - HARMLESS):
        spec = fields.get(name)
        if spec is None:  # not a field vLLM knows: nothing reads it
            continue
        value = getattr(request, name)
        if value is not None and value != spec.get_default(call_default_factory=True) and value != NEUTRAL.get(name):
            raise CallError(400, f"{name} is not supported here: the trainer scores each token under "
                                 f"temperature, top_k and top_p alone, so a call may not change how tokens "
                                 f"are drawn otherwise", name)
    chat_top = getattr(request, "top_logprobs", 0) or 0
    text_top = request.logprobs if isinstance(request.logprobs, int) and not isinstance(request.logprobs, bool) else 0
    if chat_top > 0 or text_top > 1:
        raise CallError(400, "logprobs of other tokens than the sampled one are not available: the engine returns "
                             "the sampled token's logprob only", "top_logprobs" if chat_top else "logprobs")
    if getattr(request, "tool_choice", None) not in (None, "none", "auto"):
        raise CallError(400, "tool_choice may be 'auto' or 'none': a reply is never constrained (the tokens "
                             "trained are the model's own)", "tool_choice")


def sampling_of(request: Any) -> dict[str, Any]:
    """The per-call sampling settings a request sets (the agent's config gives the rest)."""
    given = request.model_fields_set
    stop = request.stop
    settings = {
        "max_tokens": (vars(request).get("max_completion_tokens") or vars(request).get("max_tokens")
                       if given & {"max_tokens", "max_completion_tokens"} else None),
        "temperature": request.temperature, "top_p": request.top_p,
        "top_k": 0 if request.top_k == -1 else request.top_k,
        "stop": [stop] if isinstance(stop, str) else (list(stop) or None if stop else None),
        "stop_token_ids": list(request.stop_token_ids) or None if request.stop_token_ids else None,
        "ignore_eos": request.ignore_eos or None,
    }
    return {k: v for k, v in settings.items() if v is not None}


def text_of(content: Any, index: int) -> str:
    """A message's content as text; refuses parts that are not text (images, audio)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") not in TEXT_PARTS:
            raise CallError(400, f"messages[{index}]: content parts of type {part.get('type')!r} are not "
                                 f"supported; the agents read text", f"messages[{index}].content")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def plain_message(message: dict, index: int) -> dict:
    """The message as a chat template reads it: text content, tool calls with their
    arguments as objects."""
    plain = {k: v for k, v in message.items() if k in ("role", "name", "tool_call_id") and v is not None}
    plain["content"] = text_of(message.get("content"), index)
    calls = message.get("tool_calls")
    if calls:
        plain["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": _arguments(c["function"]["arguments"])}}
                               for c in calls]
    return plain


def canonical(message: dict) -> tuple:
    """What identifies a message when a client sends it back: role, text, tool calls
    (name and arguments, whatever their JSON spacing), the tool call answered."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls") or ())
    return message["role"], message.get("content") or "", calls, message.get("tool_call_id") or ""


def last_turn(sample: Any) -> tuple[list[int], list[float]]:
    """The ids and sampler's logprobs of the sample's last turn, as lists for a response
    (the view gives them without a copy: `SampleView.last_turn`)."""
    ids, logprobs = sample.last_turn
    return ids.tolist(), logprobs.tolist()


class TurnEndpoint(Protocol):
    """What an episode's turns need of the endpoint they came through (openai_api.py)."""

    base_url: str
    tool_parsers: dict[str, type]  # agent -> its vLLM tool parser class

    def transport(self) -> Any: ...  # the in-process httpx transport of ctx.openai_client()

    async def mark_branch(self, request: Any) -> None: ...  # an httpx request hook

    def forget(self, key: str) -> None: ...  # the episode ended: its key names nothing now


class OpenAITurns:
    def __init__(self, ctx: EpisodeContext, endpoint: TurnEndpoint, api_key: str) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.api_key = api_key
        self.conversations: list[Conversation] = []
        self.texts: list[tuple[str, Any, list[int]]] = []  # text completions: agent, sample, prompt + reply ids
        self.completions: dict[str, list[Any]] = {}  # completion id -> its samples, by choice index
        self.clients: list[Any] = []
        self._ids = itertools.count()

    @property
    def base_url(self) -> str:
        return self.endpoint.base_url

    # ---------------------------------------------------------------- the episode's side

    def client(self, **options: Any) -> Any:
        import openai

        # The episode's client and the endpoint share this process: its requests go straight
        # to the endpoint's handler (no socket, no HTTP parsing, no certificate store), in
        # the calling task; the URL stays the endpoint's, so what the client reports is real.
        http = openai.DefaultAsyncHttpx2Client(transport=self.endpoint.transport(),
                                               event_hooks={"request": [self.endpoint.mark_branch]})
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, http_client=http,
                                    max_retries=0, **options)
        self.clients.append(client)
        return client

    def completion(self, completion_id: str) -> list[Any]:
        if completion_id not in self.completions:
            raise KeyError(f"no completion {completion_id!r} in episode {self.ctx.episode_id}")
        return self.completions[completion_id]

    def name_groups(self, keys: list[Any]) -> list[str]:
        """The completions (and choices) holding the unrewarded samples of these groups."""
        wanted, named = set(keys), []
        for cid, samples in self.completions.items():
            unrewarded = [i for i, s in enumerate(samples) if s.key in wanted and s.reward is None]
            if unrewarded:
                which = "" if len(samples) == 1 else f" (choices {', '.join(map(str, unrewarded))})"
                named.append(f"{samples[0].agent} {cid}{which}")
        covered = {s.key for samples in self.completions.values() for s in samples}
        return named + [str(k) for k in keys if k not in covered]

    async def end(self) -> None:
        self.endpoint.forget(self.api_key)
        for client in self.clients:
            await client.close()

    # ---------------------------------------------------------------- calls

    async def chat(self, request: Any) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
        )

        check_supported(request)
        agent = request.model
        if not request.messages:
            raise CallError(400, "messages is empty: a chat call needs at least one message", "messages")
        messages = [plain_message(m, i) for i, m in enumerate(request.messages)]
        said = [canonical(m) for m in messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        sampling = sampling_of(request)
        held = self._continued(agent, said)
        if held is not None:
            if "n" in request.model_fields_set and request.n != 1:
                raise CallError(400, "a call that continues a conversation takes one reply: n must be 1", "n")
            held.busy = True
            try:
                await self._turn(self.ctx.continue_chat(held.sample, messages[len(held.said):], tools=tools,
                                                        **sampling))
            finally:
                held.busy = False
            samples = [held.sample]
        else:
            n = request.n if "n" in request.model_fields_set else None
            samples = await self._turn(self.ctx.chat(agent, messages, n=n, tools=tools, **sampling))
        cid = self._new_id("chatcmpl", samples)
        choices, completion_tokens = [], 0
        context = _context(samples[0])
        for index, sample in enumerate(samples):
            ids, logprobs = last_turn(sample)
            message, finish = self._reply(sample, ids, request, sampling)
            reply = plain_message(message.model_dump(exclude_none=True), len(messages))
            self._remember(held, agent, sample, said + [canonical(reply)])
            choices.append(ChatCompletionResponseChoice(
                index=index, message=message, finish_reason=finish,
                logprobs=self._chat_logprobs(agent, ids, logprobs) if request.logprobs else None,
                token_ids=ids if request.return_token_ids else None))
            completion_tokens += len(ids)
        return ChatCompletionResponse(
            id=cid, model=agent, choices=choices, usage=_usage(len(context), completion_tokens),
            prompt_token_ids=context if request.return_token_ids else None)

    async def complete(self, request: Any) -> Any:
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice

        check_supported(request)
        agent, tok = request.model, self.ctx.tokenizer(request.model)
        sampling = sampling_of(request)
        prompt = self._prompt_ids(request, tok)
        if isinstance(prompt, str):  # checked for size before it is tokenized (in a thread when large)
            text = prompt
            prompt_ids = await self._turn(tok.sized(len(text), self.ctx.prompt_room(agent, sampling),
                                                    lambda: tok.encode(text)))
        else:
            prompt_ids = prompt
        held = next((t for t in self.texts if t[0] == agent and len(t[2]) < len(prompt_ids)
                     and prompt_ids[:len(t[2])] == t[2] and _open(t[1])), None)
        if held is not None:
            if request.n != 1:
                raise CallError(400, "a call that continues a completion takes one reply: n must be 1", "n")
            self.texts.remove(held)  # taken: a concurrent call must find another
            await self._turn(self.ctx.continue_ids(held[1], prompt_ids[len(held[2]):], **sampling))
            samples = [held[1]]
        else:
            n = request.n if "n" in request.model_fields_set else None
            samples = await self._turn(self.ctx.generate(agent, prompt_ids, n=n, **sampling))
        cid = self._new_id("cmpl", samples)
        choices, completion_tokens = [], 0
        for index, sample in enumerate(samples):
            ids, logprobs = last_turn(sample)
            self.texts.append((agent, sample, sample.prompt_ids.tolist() + sample.output_ids.tolist()))
            choices.append(CompletionResponseChoice(
                index=index, text=sample.text, finish_reason=self._finish(sample, ids, sampling),
                logprobs=self._text_logprobs(agent, ids, logprobs) if request.logprobs else None,
                token_ids=ids if request.return_token_ids else None,
                prompt_token_ids=prompt_ids if request.return_token_ids else None))
            completion_tokens += len(ids)
        return CompletionResponse(id=cid, model=agent, choices=choices,
                                  usage=_usage(len(prompt_ids), completion_tokens))

    # ---------------------------------------------------------------- helpers

    async def _turn(self, call: Any) -> Any:
        """Runs a context call; what it refuses (a bad setting, a prompt the tokenizer or
        the engine cannot take, a sample that cannot go on) is the caller's 400, and a
        group the failed call opened is dropped: the call failed alone."""
        from ..episodes.workflow import EpisodeClosed
        from ..rollout.router import RequestRefused

        opened = self.ctx._groups_opened()
        try:
            return await call
        except EpisodeClosed as exc:
            raise CallError(409, f"the episode already failed: {exc}") from None
        except (ValueError, TypeError, RequestRefused) as exc:
            self.ctx._drop_since(opened, f"its call failed: {exc}")
            raise CallError(400, str(exc)) from None

    def _continued(self, agent: str, said: list[tuple]) -> Conversation | None:
        best = None
        for c in self.conversations:
            if (c.agent == agent and len(c.said) < len(said) and (best is None or len(c.said) > len(best.said))
                    and not c.busy and said[:len(c.said)] == c.said and _open(c.sample)):
                best = c
        return best

    def _remember(self, held: Conversation | None, agent: str, sample: Any, said: list[tuple]) -> None:
        if held is not None:
            held.said = said
        else:
            self.conversations.append(Conversation(agent, sample, said))

    def _new_id(self, kind: str, samples: list[Any]) -> str:
        cid = f"{kind}-{self.ctx.episode_id}-{next(self._ids)}"
        self.completions[cid] = samples
        return cid

    def _prompt_ids(self, request: Any, tok: Any) -> str | list[int]:
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise CallError(400, "prompt is empty: the agent needs something to continue", "prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            return list(prompt)
        raise CallError(400, "prompt must be one text or one list of token ids (one prompt per call; use n for "
                             "several samples of it)", "prompt")

    def _reply(self, sample: Any, ids: list[int], request: Any, sampling: dict) -> tuple[Any, str]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage

        parser = self.endpoint.tool_parsers.get(sample.agent)
        if parser is not None and request.tools and request.tool_choice != "none":
            found = parser(self.ctx.tokenizer(sample.agent).tok, request.tools).extract_tool_calls(sample.text, request)
            if found.tools_called:
                return ChatMessage(role="assistant", content=found.content, tool_calls=found.tool_calls), "tool_calls"
        return ChatMessage(role="assistant", content=sample.text), self._finish(sample, ids, sampling)

    def _finish(self, sample: Any, ids: list[int], sampling: dict) -> str:
        """"length" when the turn used its whole max_tokens without ending, else "stop"."""
        cap = sampling.get("max_tokens") or self.ctx.agents[sample.agent].max_tokens
        eos = getattr(self.ctx.tokenizers.get(sample.agent), "eos_token_id", None)
        return "length" if len(ids) >= cap and ids[-1:] != [eos] else "stop"

    def _chat_logprobs(self, agent: str, ids: list[int], logprobs: list[float]) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionLogProbs,
            ChatCompletionLogProbsContent,
        )

        tokens = self._tokens(agent, ids)
        return ChatCompletionLogProbs(content=[
            ChatCompletionLogProbsContent(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in zip(tokens, logprobs)])

    def _text_logprobs(self, agent: str, ids: list[int], logprobs: list[float]) -> Any:
        from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs

        tokens = self._tokens(agent, ids)
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
        return CompletionLogProbs(text_offset=offsets, token_logprobs=list(logprobs), tokens=tokens,
                                  top_logprobs=[None] * len(tokens))

    def _tokens(self, agent: str, ids: list[int]) -> list[str]:
        tok = self.ctx.tokenizer(agent)
        return [tok.decode([i]) for i in ids]


def _context(sample: Any) -> list[int]:
    """The ids the sample's last turn was generated from: the prompt, every earlier turn
    and what was appended between turns."""
    turn, _ = sample.last_turn
    output = sample.output_ids
    return sample.prompt_ids.tolist() + output[:len(output) - len(turn)].tolist()


def _open(sample: Any) -> bool:
    """A sample can take another turn until it has a reward (or its group ended)."""
    return sample.reward is None and sample.status == PENDING


def _usage(prompt_tokens: int, completion_tokens: int) -> Any:
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


