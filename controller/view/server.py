"""The web view's HTTP side: the page, its static files and a JSON API over a `RunWatch`.

    GET /                       the page (static/index.html; its scripts and styles under /static/)
    GET /api/run                the run's header: agents, mode, steps, status, how much of the log is read
    GET /api/agents             each agent's curves (metrics.jsonl), from row `train` / `eval` on
    GET /api/workers            each worker's busy and idle seconds, utilization, restarts
    GET /api/timeline           the busy grid: a row per worker, `columns` stretches from `t0` to `t1`
    GET /api/happenings         syncs, swaps, moves, deaths, restarts, ...: `kind`, `offset`, `limit`
    GET /api/syncs              every weight sync's agent, version, seconds and bytes, from row `since` on
    GET /api/samples            the samples that pass the filters, a page at a time
    GET /api/episode?name=E     one episode: its groups, their branches and members (texts where recorded)
    GET /api/config             the resolved config (config.toml)

Routes are Starlette's, served by uvicorn in the caller's event loop (the controller's, or
`flexmarl view`'s). Every list is paged or bounded, so a run of a million samples is never
sent whole. A follower task reads the run as it grows (`RunWatch.refresh`, a slice at a
time between requests): always in `flexmarl view`; in a running controller only while a
page has asked in the last `WATCHED_S` seconds, so an unwatched run pays nothing.

Loopback by default; another address only with a key (`view.key_env`), as the OpenAI
endpoint: a browser opens `URL/?key=KEY` once and a cookie keeps it, a script sends
`Authorization: Bearer KEY`; anything else is refused (401). Where a key is set it is
required on loopback too.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import secrets
import socket
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgspec

from flexmarl.runtime.config import ConfigError, ViewConfig
from flexmarl.runtime.transport import listen_key

from ..serving.openai_api import embedded_server
from .cluster import HAPPENINGS
from .episodes import STATUSES
from .watch import RunWatch

log = logging.getLogger("flexmarl.view")

STATIC = Path(__file__).parent / "static"
WATCHED_S = 30.0  # a controller's view keeps reading this long after a page last asked
# Of the event log, what the follower reads between requests: `flexmarl view` has its
# process to itself; a controller's view shares the controller's event loop, so it reads
# in small slices (a few tens of milliseconds each) and the controller's loop goes on between them.
SLICE_BYTES = {True: 512 * 1024, False: 256 * 1024}
# ... and how long it then leaves the loop to the rest: a controller's view takes at most
# about half of it while it catches up with a long log. Requests go first either way: while
# one is under way (it takes several turns of the loop), the follower waits.
PAUSE_S = {True: 0.0, False: 0.05}
POLL_S = 1.0  # how often a caught-up follower looks for more
MAX_PAGE = 500  # rows of a list per request
COOKIE = "flexmarl_view"


class BadRequest(Exception):
    """A query parameter the API cannot use: 400 with the message."""


class ViewServer:
    def __init__(self, run_dir: str | Path, cfg: ViewConfig, *, always: bool = True) -> None:
        self.cfg = cfg
        self.watch = RunWatch(run_dir)
        self.key = listen_key(cfg.host, cfg.key_env, "view")
        self._cookie = hashlib.sha256(f"flexmarl-view:{self.key}".encode()).hexdigest() if self.key else ""
        self.always = always  # follow the run all the time (`flexmarl view`), or while watched (a controller)
        self.url = ""
        self.task: asyncio.Task | None = None
        self._follower: asyncio.Task | None = None
        self._asked_at = -math.inf
        self._asked = asyncio.Event()
        self._in_flight = 0  # HTTP requests being answered
        self._server: Any = None

    # ------------------------------------------------------------ lifetime

    async def start(self) -> str:
        """Binds, serves and follows the run in this event loop; returns the page's URL.
        Following all the time, the first slice of the run is read first: the first page
        shows something."""
        if self.always:
            self.watch.refresh(SLICE_BYTES[True])
        sock = socket.socket(socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.cfg.host, self.cfg.port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"the web view cannot listen on {self.cfg.host}:{self.cfg.port}: {exc.strerror or exc}; "
                              "choose another view.port (0: a free one)") from exc
        host, port = sock.getsockname()[:2]
        self._server = embedded_server(self.app())
        self.task = asyncio.create_task(self._serve(sock), name="view")
        while not self._server.started:
            if self.task.done():
                self.task.result()  # its failure, as is
                raise RuntimeError("the web view stopped while starting")
            await asyncio.sleep(0.01)
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
        return self.url

    async def _serve(self, sock: socket.socket) -> None:
        """Serves until stopped; the follower runs beside it and a failure of either ends both."""
        self._follower = asyncio.create_task(self.follow(), name="view-follower")
        server = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        try:
            done, _ = await asyncio.wait([server, self._follower], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in (server, self._follower):
                task.cancel()
            await asyncio.gather(server, self._follower, return_exceptions=True)

    async def stop(self, timeout: float = 5.0) -> None:
        """Asks the server to finish (the follower stops with it); past `timeout`, cancels it."""
        if self.task is None:
            return
        if not self.task.done():
            self._server.should_exit = True
            done, _ = await asyncio.wait([self.task], timeout=timeout)
            if not done:
                self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def follow(self) -> None:
        """Reads the run as it grows: a slice of the log, then whatever requests wait, then
        the next; once caught up, looks again every POLL_S seconds (or when a page asks)."""
        while True:
            watched = self.always or time.monotonic() - self._asked_at < WATCHED_S
            if watched and self.watch.refresh(SLICE_BYTES[self.always]):
                await asyncio.sleep(PAUSE_S[self.always])
                while self._in_flight:
                    await asyncio.sleep(0.002)
                continue
            self._asked.clear()
            try:
                await asyncio.wait_for(self._asked.wait(), POLL_S if watched else None)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------ routes

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.middleware.gzip import GZipMiddleware
        from starlette.responses import FileResponse, PlainTextResponse, Response
        from starlette.routing import Mount, Route
        from starlette.staticfiles import StaticFiles

        def api(handler: Callable[[Any], Any], media_type: str = "application/json") -> Callable[[Any], Awaitable[Any]]:
            async def route(request: Any) -> Any:
                self._asked_at = time.monotonic()
                self._asked.set()
                try:
                    body = handler(request.query_params)
                except BadRequest as exc:
                    return PlainTextResponse(str(exc), status_code=400)
                except LookupError as exc:
                    return PlainTextResponse(str(exc.args[0]) if exc.args else "not found", status_code=404)
                if media_type != "application/json":
                    return Response(body, media_type=media_type)
                return Response(msgspec.json.encode(body), media_type=media_type,
                                headers={"cache-control": "no-store"})
            return route

        async def page(request: Any) -> Any:
            return FileResponse(STATIC / "index.html", headers={"cache-control": "no-store"})

        routes = [Route("/", page),
                  Route("/api/run", api(lambda q: self.watch.header())),
                  Route("/api/agents", api(self._agents)),
                  Route("/api/workers", api(lambda q: self.watch.cluster.workers())),
                  Route("/api/timeline", api(self._timeline)),
                  Route("/api/happenings", api(self._happenings)),
                  Route("/api/syncs", api(self._syncs)),
                  Route("/api/samples", api(self._samples)),
                  Route("/api/episode", api(self._episode)),
                  Route("/api/config", api(lambda q: self.watch.config_text, "text/plain")),
                  Mount("/static", StaticFiles(directory=STATIC), name="static")]
        return Starlette(routes=routes, middleware=[Middleware(Counted, server=self),
                                                    Middleware(KeyCheck, key=self.key, cookie=self._cookie),
                                                    Middleware(GZipMiddleware, minimum_size=2048)])

    def _agents(self, q: Any) -> dict[str, Any]:
        watch = self.watch
        start = _int(q, "epoch", -1) != watch.epoch
        body = watch.curves.since(0 if start else _int(q, "train", 0), 0 if start else _int(q, "eval", 0))
        return {"epoch": watch.epoch, "from_start": start, "latest": watch.curves.latest(), **body}

    def _timeline(self, q: Any) -> dict[str, Any]:
        return self.watch.cluster.grid(_float(q, "t0"), _float(q, "t1"), _int(q, "columns", 200))

    def _happenings(self, q: Any) -> dict[str, Any]:
        kind = q.get("kind") or None
        if kind is not None and kind not in HAPPENINGS:
            raise BadRequest(f"kind must be one of {', '.join(HAPPENINGS)}, got {kind!r}")
        rows = self.watch.cluster.happenings
        chosen = [r for r in rows if r["kind"] == kind] if kind else rows
        if q.get("order") == "newest":
            chosen = chosen[::-1]
        offset, limit = _page(q)
        return {"total": len(chosen), "rows": chosen[offset:offset + limit],
                "counts": {k: sum(1 for r in rows if r["kind"] == k) for k in HAPPENINGS}}

    def _syncs(self, q: Any) -> dict[str, Any]:
        cluster, since = self.watch.cluster, _int(q, "since", 0)
        return {"agents": cluster.sync_agents, "rows": len(cluster.syncs["version"]),
                **{k: v[since:] for k, v in cluster.syncs.items()}}

    def _samples(self, q: Any) -> dict[str, Any]:
        status = q.get("status") or None
        if status is not None and status not in STATUSES:
            raise BadRequest(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        order = q.get("order") or "step"
        if order not in ("step", "reward", "-reward"):
            raise BadRequest(f"order must be step, reward or -reward, got {order!r}")
        index = self.watch.episodes
        chosen = index.select(agent=q.get("agent") or None,
                              steps=(_int(q, "step_from", None), _int(q, "step_to", None)),
                              rewards=(_float(q, "reward_min"), _float(q, "reward_max")),
                              status=status, with_text=q.get("text") in ("1", "true"), order=order)
        offset, limit = _page(q)
        return {"total": len(chosen), "rows": index.rows(chosen[offset:offset + limit])}

    def _episode(self, q: Any) -> dict[str, Any]:
        name = q.get("name", "")
        found = self.watch.episodes.episode(name)
        if found is None:
            raise LookupError(f"no episode {name!r} in the log read so far")
        return found


class Counted:
    """ASGI middleware: counts the requests being answered (the follower lets them go first)."""

    def __init__(self, app: Any, server: ViewServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.server._in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.server._in_flight -= 1


class KeyCheck:
    """ASGI middleware: with a key, a request passes with `Authorization: Bearer KEY` or the
    cookie `?key=KEY` set; `?key=KEY` itself sets it and redirects to the page without it."""

    def __init__(self, app: Any, key: str, cookie: str) -> None:
        self.app, self.key, self.cookie = app, key, cookie

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.key:
            await self.app(scope, receive, send)
            return
        from starlette.requests import Request
        from starlette.responses import PlainTextResponse, RedirectResponse

        request = Request(scope)
        given = request.query_params.get("key")
        if given is not None and _same(given, self.key):
            response: Any = RedirectResponse(str(request.url.remove_query_params("key")), status_code=303)
            response.set_cookie(COOKIE, self.cookie, httponly=True, samesite="strict")
        elif _same(request.headers.get("authorization", ""), f"Bearer {self.key}") or \
                _same(request.cookies.get(COOKIE, ""), self.cookie):
            await self.app(scope, receive, send)
            return
        else:
            response = PlainTextResponse("this view needs its key: open the page once as URL/?key=KEY (the key in "
                                         "the view's key_env variable), or send Authorization: Bearer KEY",
                                         status_code=401)
        await response(scope, receive, send)


def _same(given: str, expected: str) -> bool:
    return secrets.compare_digest(given.encode(), expected.encode())


def _int(q: Any, name: str, default: Any) -> Any:
    text = q.get(name)
    if text in (None, ""):
        return default
    try:
        return int(text)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {text!r}") from None


def _float(q: Any, name: str) -> float | None:
    text = q.get(name)
    if text in (None, ""):
        return None
    try:
        value = float(text)
    except ValueError:
        raise BadRequest(f"{name} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number, got {text!r}")
    return value


def _page(q: Any) -> tuple[int, int]:
    offset, limit = _int(q, "offset", 0), _int(q, "limit", 50)
    if offset < 0 or not 1 <= limit <= MAX_PAGE:
        raise BadRequest(f"offset must be >= 0 and limit in [1, {MAX_PAGE}]")
    return offset, limit
