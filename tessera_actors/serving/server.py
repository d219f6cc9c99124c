"""``tessera serve``: an OpenAI-compatible HTTP server over :class:`AsyncEngine`.

    tessera serve --model smollm2 [--devices cpu,cpu | --nodes 'cpu;cpu?threads=1']
                  [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--trace DIR]

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or
server-sent events; :mod:`.completions`), ``POST /v1/embeddings``, ``GET /v1/models``, ``POST /tokenize`` (prompt token
count, as vLLM's), ``GET /v1/tessera/stats`` (placement, engine stats and
server counters: what the chat page at ``/`` shows), ``GET /health`` (503
while a node is lost and not yet re-placed), ``GET /metrics`` (Prometheus).

Contracts:
- Every error is JSON ``{"error": {"message", "type", "param", "code"}}`` with
  400/401/404/405/413/429/503 (500 only for a bug).  A request is validated
  and its first output awaited *before* the response starts, so a bad
  request or a busy engine is an HTTP error, never an error inside a 200.
  An engine failure after streaming began is sent as an ``error`` event,
  then ``[DONE]``.
- A client that disconnects aborts its request (``engine.abort``): the
  handler is cancelled (``handler_cancellation``), which closes the engine's
  generator and frees the KV slot, whether the reply was streamed or not.
- ``--api-key`` guards ``/v1/*`` and ``/tokenize`` with ``Authorization:
  Bearer KEY``; the page, ``/health`` and ``/metrics`` stay open.
- aiohttp because the project is asyncio end to end (actors, engine) and
  already uses it: one event loop, no ASGI layer or second server process
  between the HTTP handler and the engine's generator.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import hmac
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from tessera_actors.serving import completions as completions_
from tessera_actors.serving import openai_api as oa
from tessera_actors.serving.flags import (DEFAULT_MAX_BODY, chosen_deployment, devices_line, engine_kwargs,
                                          weights_line)
from tessera_actors.serving.metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("tessera.serve")
STATIC = Path(__file__).with_name("static")


@dataclass(frozen=True)
class ServeConfig:
    """HTTP side of ``tessera serve``; ``engine`` holds the AsyncEngine keyword arguments."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY          # bytes; larger bodies get 413
    served_model_name: str | None = None     # default: the engine's model name
    engine: dict = dataclasses.field(default_factory=dict)


class ServerState:
    """What the handlers share: the engine, the metrics and the in-flight requests."""

    def __init__(self, engine: Any, api_key: str | None, model_name: str | None, max_body: int) -> None:
        self.engine, self.max_body = engine, max_body
        self.api_key = api_key
        self.model_name = model_name or engine.model_name
        self.created = oa.now()
        self.metrics = ServerMetrics(engine.stats, engine.health)
        self.inflight: set[str] = set()
        self.warned_fields: set[str] = set()   # unknown request fields already logged once
        self.generated_tokens = 0
        self.requests = 0


STATE = web.AppKey("state", ServerState)


def _json_error(e: oa.ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


@web.middleware
async def _errors_and_auth(request: web.Request, handler) -> web.StreamResponse:
    st = request.app[STATE]
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "unmatched"
    try:
        if st.api_key and (request.path.startswith("/v1/") or request.path == "/tokenize"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {st.api_key}".encode()):
                raise oa.ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
        if request.method == "POST" and request.path in ENGINE_PATHS:
            _check_started(st.engine.health())
        resp = await handler(request)
    except oa.ApiError as e:
        resp = _json_error(e)
    except web.HTTPException as e:           # routing (404/405) and body size (413) from aiohttp
        if e.status == 413:
            msg = f"request body too large (limit {st.max_body} bytes)"
        elif e.status == 404:
            msg = f"no such endpoint: {request.method} {request.path}"
        else:
            msg = e.reason
        resp = _json_error(oa.ApiError(e.status, msg, code=str(e.status) if e.status >= 404 else None))
    except Exception as e:                   # noqa: BLE001 - answered as a JSON 500, and logged
        log.exception("unhandled error in %s", endpoint)
        resp = _json_error(completions_.api_error(e))
    st.metrics.http.labels(endpoint, str(resp.status)).inc()
    return resp


ENGINE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize")


def _check_started(h: dict) -> None:
    """503 (retry later) while the engine is still starting."""
    if h.get("status") == "starting":
        raise oa.ApiError(503, f"the server is starting ({h.get('phase')}: {h.get('buckets_placed', 0)} of "
                               f"{h.get('buckets', 0)} buckets placed); retry shortly", code="starting")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await completions_.generate(request, request.app[STATE], oa.parse_chat)


async def completions(request: web.Request) -> web.StreamResponse:
    return await completions_.generate(request, request.app[STATE], oa.parse_completion)


async def embeddings(request: web.Request) -> web.Response:
    return await completions_.embeddings(request, request.app[STATE])


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response(oa.models_list(st.model_name, st.created, st.engine.max_model_len))


async def tokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    data = oa.load_object(await request.read())
    data.setdefault("model", st.model_name)
    prompt_field = {"messages": data.pop("messages", None), "prompt": data.pop("prompt", None)}
    if (prompt_field["messages"] is None) == (prompt_field["prompt"] is None):
        raise oa.bad("give exactly one of 'prompt' or 'messages'")
    key = "messages" if prompt_field["messages"] is not None else "prompt"
    data[key] = prompt_field[key]
    req = (oa.parse_chat if key == "messages" else oa.parse_completion)(data)
    if req.model != st.model_name:
        raise oa.ApiError(404, f"the model '{req.model}' does not exist", "model", "model_not_found")
    try:
        n = st.engine.count_tokens(req.prompt)
    except Exception as e:                   # noqa: BLE001
        raise oa.bad(f"cannot tokenize: {e}", key) from None
    return web.json_response({"count": n, "max_model_len": st.engine.max_model_len})


async def stats(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response({"model": st.model_name, "engine": st.engine.stats(), "health": st.engine.health(),
                              "server": {"requests": st.requests, "in_flight": len(st.inflight),
                                         "generated_tokens": st.generated_tokens, "time": time.time()}})


async def health(request: web.Request) -> web.Response:
    """200 ``{"status": "ok"}`` while serving; 503 with ``"starting"`` (and
    the placement's progress) before, ``"unhealthy"`` while a node is lost."""
    h = request.app[STATE].engine.health()
    ok = bool(h.get("ok"))
    status = "ok" if ok else ("starting" if h.get("status") == "starting" else "unhealthy")
    body = {"status": status, "lost": list(h.get("lost") or [])}
    if "buckets" in h:
        body.update(phase=h.get("phase"), buckets_placed=h.get("buckets_placed", 0), buckets=h.get("buckets", 0))
    return web.json_response(body, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def favicon(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "favicon.svg", headers={"Content-Type": "image/svg+xml"})


def make_app(engine: Any, *, api_key: str | None = None, served_model_name: str | None = None,
             max_body: int = DEFAULT_MAX_BODY) -> web.Application:
    """The aiohttp application over a started engine (the caller owns the engine)."""
    app = web.Application(middlewares=[_errors_and_auth], client_max_size=max_body)
    app[STATE] = ServerState(engine, api_key, served_model_name, max_body)
    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/embeddings", embeddings)
    r.add_get("/v1/models", models)
    r.add_post("/tokenize", tokenize)
    r.add_get("/v1/tessera/stats", stats)
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    r.add_get("/", index)
    r.add_get("/favicon.ico", favicon)
    r.add_static("/static/", STATIC)
    return app


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Bind and start serving ``app``; the runner and the port bound (``port=0``: any free one)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]


async def serve(cfg: ServeConfig, stop: asyncio.Event | None = None) -> None:
    """Start the engine and the server; run until ``stop`` is set (or SIGINT/SIGTERM).

    Prints one line ``tessera serve: ready http://HOST:PORT ...`` on stdout once
    it accepts requests. On stop, in-flight requests are aborted, then the
    server and the engine shut down."""
    from tessera_actors.serving import AsyncEngine
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    eng = AsyncEngine(**cfg.engine)
    app = make_app(eng, api_key=cfg.api_key, served_model_name=cfg.served_model_name, max_body=cfg.max_body)
    runner, port = await start_site(app, cfg.host, cfg.port)   # /health answers "starting" from here on
    print(f"tessera serve: starting http://{cfg.host}:{port} model {app[STATE].model_name}", flush=True)
    bar = StartupProgress()
    starting = loop.create_task(eng.start(bar))
    frozen = None
    stopped = loop.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()   # a failed start raises here
            bar.ready()
            gc.freeze()
            frozen = loop.create_task(_freeze_when_placed(eng))
            print(f"tessera serve: ready http://{cfg.host}:{port} model {app[STATE].model_name} "
                  f"(chat page at /, OpenAI API at /v1)", flush=True)
            await stopped
    finally:
        stopped.cancel()
        starting.cancel()
        if frozen is not None:
            frozen.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        for rid in list(app[STATE].inflight):
            await eng.abort(rid)
        await runner.cleanup()
        await eng.stop()
        bar.close()


async def _freeze_when_placed(eng) -> None:
    """Once every bucket is placed, give back the engine's copy of the
    weights where the devices hold their own, and move what the start built (graphs,
    plans, installed programs: millions of objects) out of the cyclic
    garbage collector's sight (``gc.freeze``): a full collection over them
    takes tens of seconds on a busy CPU, during serving and at exit (that
    made SIGINT take 16 s)."""
    await eng.release_weights()   # waits for the placements; in-process devices hold their own copy
    gc.freeze()


class StartupProgress:
    """One tqdm bar on stderr for a server's start: the model load, then the
    buckets placed of all (the core ones before it serves, the rest in the
    background after), closed once every bucket is placed."""

    def __init__(self) -> None:
        from tqdm import tqdm
        self.bar = tqdm(total=1, desc="tessera serve: loading model", unit="bucket", file=sys.stderr,
                        dynamic_ncols=True, bar_format="{desc} {n_fmt}/{total_fmt} [{elapsed}]{postfix}")
        self.closed = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.closed or phase != "placing":
            return
        if self.bar.total != total:
            self.bar.reset(total=total)
            self.bar.set_description_str("tessera serve: placing buckets")
        self.bar.n = done
        self.bar.refresh()
        if done >= total:
            self.close()

    def ready(self) -> None:
        if not self.closed:
            self.bar.set_postfix_str("serving; the rest in the background")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.bar.close()


def run_command(a: argparse.Namespace) -> int:
    """Run ``tessera serve`` with parsed flags until SIGINT/SIGTERM; 0 on an orderly stop."""
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {a.port}")
    chosen = chosen_deployment(a)   # None where the flags name the devices: those are never overridden
    if chosen is not None:
        print(devices_line(chosen), flush=True)
    cfg = ServeConfig(host=a.host, port=a.port, api_key=a.api_key, max_body=a.max_body,
                      served_model_name=a.served_model_name, engine=engine_kwargs(a, a.trace, chosen))
    print(f"tessera serve: {weights_line(cfg.engine)}", flush=True)
    # warnings and errors only: the start shows as one progress bar, not a line per placed plan
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(cfg))
    else:
        uvloop.run(serve(cfg))
    gc.freeze()   # all closed: the exit skips a final garbage collection over millions of objects
    return 0

