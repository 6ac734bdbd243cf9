"""The run's OpenAI-compatible endpoint: agent code that speaks the OpenAI API trains as it is.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models

`model` names an agent; the API key names the episode (or, for `flexmarl serve`, the
server), so every call is a turn of that episode's agent (openai_turns.py maps calls to
turns). The routes are Starlette's, served by uvicorn inside the controller's own event
loop (no thread, no process: a call reaches the episode context as `ctx.chat` would);
requests and responses are vLLM's OpenAI protocol models, tool calls come from vLLM's tool
parsers. Nothing here is a hand-written HTTP server or schema. The client
`ctx.openai_client()` makes goes around the socket: its transport hands each request to the
same handler in the calling task (`transport`), which saves the HTTP work on both sides
(most of a call's cost to the controller); any other client comes over HTTP.

Loopback by default; another address only with a key (`openai.key_env`), as the ZeroMQ
side requires CURVE keys. An episode's key is the endpoint's key, a dash and the
episode's id; on loopback without a key the endpoint makes one of its own per run, so a
key from another run names nothing.

Every error is the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`: a key
of no live episode is 401, an unknown model 404 (naming the agents), a bad field 400
(naming it: `n` below 1 or above `openai.max_n`, an empty prompt, JSON nested too deep), a
body too large 413 (refused before it is read whole), a prompt longer than the agent's
context or `openai.max_request_tokens` 400; the call's own failure (a prompt the engine
refuses) is 400 and fails only that call; an agent with no instance serving right now is
503. A request is checked whole before any engine sees it, and nothing a request does
stops the run. No answer carries a file path or an exception's text: a failure of ours is
a 500 that says so, with the error in the server's log.

Nothing proportional to a request's size runs on the event loop, which the controller's
heartbeats share: a large body is parsed and validated in a thread, and a prompt's size is
checked against what the agent can take before it is rendered or tokenized (large text is
tokenized in a thread: episodes/tokens.py). `stream: true` is answered as server-sent
events: the reply arrives whole (the engines return whole turns), in one chunk per
choice, then `[DONE]`.

The endpoint holds no sample: it finds the session a key names and hands it the call.
Backpressure is its callers': each episode waits for its own calls, and the episodes
are bounded by `pipeline.max_concurrent_episodes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

from flexmarl.runtime.config import ConfigError, OpenAIConfig
from flexmarl.runtime.protocol import shorten as protocol_shorten
from flexmarl.runtime.transport import listen_key

from .openai_turns import CallError, OpenAITurns

if TYPE_CHECKING:
    import pydantic

log = logging.getLogger("flexmarl.openai")

BRANCH_HEADER = "x-flexmarl-branch"  # the calling task's place in its episode (workflow.BRANCH)
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 409: "ConflictError",
               413: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
# A body larger than this (bytes) is parsed and validated in a thread, off the event loop.
OFF_LOOP_BYTES = 64 * 1024


def endpoint_key(cfg: OpenAIConfig) -> str:
    """The endpoint's key: from `openai.key_env`; required off loopback."""
    return listen_key(cfg.host, cfg.key_env, "openai")


def import_protocol() -> None:
    """vLLM's OpenAI protocol models (vLLM and torch come with them)."""
    import vllm.entrypoints.openai.chat_completion.protocol  # noqa: F401
    import vllm.entrypoints.openai.completion.protocol  # noqa: F401


def tool_parsers(parsers: dict[str, str]) -> dict[str, type]:
    """agent -> vLLM's tool parser class named by `agents.*.tool_parser`."""
    wanted = {agent: name for agent, name in parsers.items() if name}
    if not wanted:
        return {}
    from vllm.tool_parsers import ToolParserManager

    known = sorted(ToolParserManager.list_registered())
    found = {}
    for agent, name in wanted.items():
        if name not in known:
            raise ConfigError(f"agents.{agent}.tool_parser = {name!r} is not one of vLLM's tool parsers "
                              f"({', '.join(known)})")
        found[agent] = ToolParserManager.get_tool_parser(name)
    return found


def embedded_server(app: Any) -> Any:
    """uvicorn's server for `app`, minus its signal handlers: the controller's own handling
    of Ctrl-C and SIGTERM stays in charge."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", log_level="warning"))


class OpenAIEndpoint:
    def __init__(self, cfg: OpenAIConfig, agents: dict[str, str], parsers: dict[str, str] | None = None,
                 serving: Callable[[], OpenAITurns] | None = None) -> None:
        self.cfg = cfg
        self.agents = agents  # agent -> where its model is (for the log: never in an answer)
        configured = endpoint_key(cfg)
        self.key = configured or f"fx{secrets.token_hex(12)}"
        # `flexmarl serve`: a fresh session per call, for the endpoint's key alone (or any
        # key on loopback without one); else the episodes' sessions, by key.
        self.serving = serving
        self.key_required = bool(configured)
        import_protocol()  # seconds: done now, before any worker heartbeats to this loop
        # The episodes' clients run in this process: one log line per call would flood its log.
        logging.getLogger("httpx2").setLevel(logging.WARNING)
        self.tool_parsers = tool_parsers(parsers or {})
        self.sessions: dict[str, OpenAITurns] = {}
        self.base_url = ""
        self.task: asyncio.Task | None = None
        self._server: Any = None

    # ------------------------------------------------------------ sessions

    def open_session(self, ctx: Any) -> OpenAITurns:
        key = f"{self.key}-{ctx.episode_id}"
        self.sessions[key] = OpenAITurns(ctx, self, key)
        return self.sessions[key]

    def forget(self, key: str) -> None:
        self.sessions.pop(key, None)

    def _session(self, authorization: str | None) -> Any:
        key = (authorization or "").removeprefix("Bearer ").strip()
        if self.serving is not None and (key == self.key or not self.key_required):
            return self.serving()
        if self.serving is not None:
            raise CallError(401, f"this API key is not the server's: use the key in the environment variable "
                                 f"{self.cfg.key_env} (openai.key_env) that the server was started with")
        session = self.sessions.get(key)
        if session is None:
            raise CallError(401, "no live episode has this API key: use the episode's ctx.openai_api_key (or "
                                 "ctx.openai_client()); a key names its episode only while the episode runs")
        return session

    @staticmethod
    async def mark_branch(request: Any) -> None:
        """An httpx request hook, run in the calling task: its place in the episode goes
        with the call, so the call opens the group `ctx.chat` there would."""
        from ..episodes.workflow import BRANCH

        request.headers[BRANCH_HEADER] = ".".join(map(str, BRANCH.get()))

    # ------------------------------------------------------------ lifetime

    async def start(self) -> str:
        """Binds and serves in this event loop; returns the base URL (…/v1)."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.cfg.host, self.cfg.port))
        host, port = sock.getsockname()[:2]
        self._server = embedded_server(self.app())
        self.task = asyncio.create_task(self._server.serve(sockets=[sock]), name="openai-endpoint")
        while not self._server.started:
            if self.task.done():
                self.task.result()  # its failure, as is
                raise RuntimeError("the OpenAI endpoint stopped while starting")
            await asyncio.sleep(0.01)
        self.base_url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        log.info("OpenAI endpoint at %s (model: one of %s)", self.base_url, ", ".join(self.agents))
        return self.base_url

    async def stop(self, timeout: float = 5.0) -> None:
        if self.task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        except Exception:  # late, or it failed: it stops all the same
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    # ------------------------------------------------------------ routes

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        async def route(request: Any) -> Any:
            raw = await self._read(request)
            reply = _error(raw) if isinstance(raw, CallError) else \
                await self.handle(request.method, request.url.path, request.headers, raw)
            return Response(reply.content, status_code=reply.status, media_type=reply.media_type)

        return Starlette(routes=[Route(path, route, methods=[method]) for path, (method, _) in self.routes.items()])

    async def _read(self, request: Any) -> bytes | CallError:
        """The body, or the 413 of one larger than `max_request_bytes`, refused as soon as
        its declared length or the bytes read so far say so (never read whole)."""
        cap = self.cfg.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            return _too_large(f"the request body ({declared} bytes)", cap)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > cap:
                return _too_large("the request body", cap)
        return bytes(body)

    def transport(self) -> Any:
        """An HTTP transport that hands each request to `handle` in the calling task: the
        episode's own client skips the socket, the HTTP parsing on both sides and the ASGI
        layers, and gets the same answers (`ctx.openai_client()` uses it)."""
        import httpx2

        endpoint = self

        class InProcess(httpx2.AsyncBaseTransport):
            async def handle_async_request(self, request: Any) -> Any:
                reply = await endpoint.handle(request.method, request.url.path, request.headers, await request.aread())
                return httpx2.Response(reply.status, content=reply.content,
                                       headers={"content-type": reply.media_type}, request=request)

        return InProcess()

    @property
    def routes(self) -> dict[str, tuple[str, Callable[..., Any]]]:
        return {"/v1/chat/completions": ("POST", self._chat), "/v1/completions": ("POST", self._complete),
                "/v1/models": ("GET", self._models)}

    async def handle(self, method: str, path: str, headers: Any, raw: bytes) -> Reply:
        """One HTTP call, whichever way it came: its reply's status, body and media type."""
        found = self.routes.get(path)
        if found is None or found[0] != method:
            return _error(CallError(404, f"no route {method} {path}: the endpoint serves "
                                         f"{', '.join(f'{m} {p}' for p, (m, _) in self.routes.items())}"))
        return await found[1](headers, raw)

    async def _chat(self, headers: Any, raw: bytes) -> Reply:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return await self._call(headers, raw, ChatCompletionRequest, "chat")

    async def _complete(self, headers: Any, raw: bytes) -> Reply:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return await self._call(headers, raw, CompletionRequest, "complete")

    async def _models(self, headers: Any, raw: bytes) -> Reply:
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        try:
            self._session(headers.get("authorization"))
        except CallError as exc:
            return _error(exc)
        cards = [ModelCard(id=agent, owned_by="flexmarl") for agent in self.agents]
        return _json(ModelList(data=cards))

    async def _call(self, headers: Any, raw: bytes, model: type[pydantic.BaseModel], method: str) -> Reply:
        from ..episodes.workflow import BRANCH, PROMPT_CAP

        try:
            session = self._session(headers.get("authorization"))
            call = await self._request(model, raw)
            branch = headers.get(BRANCH_HEADER, "")
            BRANCH.set(tuple(int(i) for i in branch.split(".")) if branch.replace(".", "").isdigit() else ())
            cap = PROMPT_CAP.set(self.cfg.max_request_tokens)
            try:
                response = await getattr(session, method)(call)
            finally:
                PROMPT_CAP.reset(cap)
        except CallError as exc:
            log.info("refused a call to %s: %s", method, exc.message)
            return _error(exc)
        except Exception as exc:  # never the run's failure: this call's alone
            unavailable = _unavailable(exc)
            if unavailable is not None:
                log.warning("a call to %s found no instance: %s", method, exc)
                return _error(unavailable)
            log.error("a call to %s failed: %s", method, protocol_shorten(repr(exc)))
            log.debug("the failed call's traceback", exc_info=True)
            return _error(CallError(500, "the server failed to answer this call; its log says why"))
        if call.stream:
            return _stream(response, bool(call.stream_options and call.stream_options.include_usage))
        return _json(response)

    async def _request(self, model: type[pydantic.BaseModel], raw: bytes) -> Any:
        """The body parsed and validated as `model`: in a thread when it is large."""
        if len(raw) > self.cfg.max_request_bytes:
            raise _too_large("the request body", self.cfg.max_request_bytes)
        if len(raw) <= OFF_LOOP_BYTES:
            call = self._parse(model, raw)
        else:
            call = await asyncio.to_thread(self._parse, model, raw)
        self._check_n(call)
        return call

    def _parse(self, model: type[pydantic.BaseModel], raw: bytes) -> Any:
        import pydantic
        from vllm.exceptions import VLLMClientError

        try:
            body = json.loads(raw)
        except RecursionError:
            raise CallError(400, "the request body is nested too deeply") from None
        except ValueError as exc:
            raise CallError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise CallError(400, "the request body must be a JSON object")
        if not isinstance(body.get("model"), str) or body["model"] not in self.agents:
            named = (f"model {protocol_shorten(repr(body.get('model')), 80)} is not an agent of this run"
                     if "model" in body else "no model")
            status = 404 if isinstance(body.get("model"), str) else 400
            raise CallError(status, f"{named}: `model` names an agent, one of {', '.join(self.agents)}", "model")
        try:
            return model.model_validate(body)
        except pydantic.ValidationError as exc:
            raise _field_error(exc) from None
        except RecursionError:
            raise CallError(400, "the request body is nested too deeply") from None
        except (ValueError, VLLMClientError) as exc:  # a check of vLLM's request model (an empty prompt, say)
            raise CallError(400, protocol_shorten(str(exc), 300), getattr(exc, "parameter", None)) from None

    def _check_n(self, call: Any) -> None:
        if "n" not in call.model_fields_set or call.n is None:
            return
        if call.n < 1:
            raise CallError(400, f"n must be at least 1 (got {call.n})", "n")
        if call.n > self.cfg.max_n:
            raise CallError(400, f"n = {call.n} is more samples than one call may ask for here (openai.max_n = "
                                 f"{self.cfg.max_n})", "n")


def _too_large(what: str, cap: int) -> CallError:
    return CallError(413, f"{what} is larger than openai.max_request_bytes ({cap})")


def _unavailable(exc: Exception) -> CallError | None:
    """The 503 of a call no instance could serve right now (its agent's instances died, or
    none is left), or None for any other failure."""
    from ..control.server import WorkerDied
    from ..rollout.router import NoInstance

    if isinstance(exc, (WorkerDied, NoInstance)):
        return CallError(503, "no instance of the agent could serve this call right now; try again later")
    return None


def _field_error(exc: Any) -> CallError:
    first = exc.errors()[0]
    error = (first.get("ctx") or {}).get("error")
    param = getattr(error, "parameter", None) or _param(first.get("loc", ()))
    message = protocol_shorten(str(error) if error is not None else first.get("msg", "invalid"), 300)
    return CallError(400, f"{param}: {message}" if param else message, param or None)


def _param(loc: tuple) -> str:
    """A validation error's location as a field path (`messages[0].content`), without the
    names of the union branches pydantic tried."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part and not part[0].isupper() and not any(c in part for c in "[]-"):
            path += f".{part}" if path else part
    return path


class Reply(NamedTuple):
    status: int
    content: bytes
    media_type: str


def _json(model: Any) -> Reply:
    return Reply(200, model.model_dump_json(exclude_none=True).encode(), "application/json")


def _error(exc: CallError) -> Reply:
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    body = ErrorResponse(error=ErrorInfo(message=exc.message, type=ERROR_TYPES.get(exc.status, "BadRequestError"),
                                         param=exc.param, code=exc.status))
    return Reply(exc.status, body.model_dump_json().encode(), "application/json")


def _stream(response: Any, usage: bool) -> Reply:
    """The whole response as server-sent events: a chunk per choice (then one with the
    usage, if asked), then [DONE]. The reply is whole when it is sent (the engines return
    whole turns), so the events go as one body."""
    events = [f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
              for chunk in _chunks(response)[:None if usage else -1]]
    return Reply(200, "".join(events + ["data: [DONE]\n\n"]).encode(), "text/event-stream")


def _chunks(response: Any) -> list[Any]:
    from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse

    if response.object == "text_completion":
        return [CompletionStreamResponse(id=response.id, created=response.created, model=response.model,
                                         choices=[CompletionResponseStreamChoice(
                                             index=c.index, text=c.text, logprobs=c.logprobs,
                                             finish_reason=c.finish_reason, token_ids=c.token_ids)])
                for c in response.choices] + [
            CompletionStreamResponse(id=response.id, created=response.created, model=response.model, choices=[],
                                     usage=response.usage)]
    chunks = []
    for c in response.choices:
        calls = [DeltaToolCall(index=i, id=t.id, type="function",
                               function=DeltaFunctionCall(name=t.function.name, arguments=t.function.arguments))
                 for i, t in enumerate(c.message.tool_calls)]
        delta = DeltaMessage(role="assistant", content=c.message.content, tool_calls=calls)
        chunks.append(ChatCompletionStreamResponse(
            id=response.id, created=response.created, model=response.model,
            choices=[ChatCompletionResponseStreamChoice(index=c.index, delta=delta, logprobs=c.logprobs,
                                                        finish_reason=c.finish_reason, token_ids=c.token_ids)]))
    chunks.append(ChatCompletionStreamResponse(id=response.id, created=response.created, model=response.model,
                                               choices=[], usage=response.usage))
    return chunks
