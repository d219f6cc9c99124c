"""``tessera serve``: an OpenAI-compatible HTTP server over :class:`AsyncEngine`.

    tessera serve --model smollm2 [--devices cpu,cpu | --nodes 'cpu;cpu?threads=1']
                  [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--trace DIR]

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or
server-sent events), ``GET /v1/models``, ``POST /tokenize`` (prompt token
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
import hmac
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from . import openai_api as oa
from .flags import DEFAULT_MAX_BODY, engine_kwargs
from .metrics import CONTENT_TYPE, ServerMetrics

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
        self.generated_tokens = 0
        self.requests = 0


STATE = web.AppKey("state", ServerState)


def _engine_errors():
    from . import EngineBusy, EngineDead, EngineError, InvalidRequest
    return InvalidRequest, EngineBusy, EngineDead, EngineError


def _api_error(e: BaseException) -> oa.ApiError:
    """An engine exception as the HTTP error a client gets."""
    invalid, busy, dead, any_engine = _engine_errors()
    if isinstance(e, oa.ApiError):
        return e
    if isinstance(e, invalid):
        return oa.ApiError(400, str(e), getattr(e, "param", None))
    if isinstance(e, busy):
        return oa.ApiError(429, str(e) or "the engine's queue is full; retry later", code="engine_busy")
    if isinstance(e, dead):
        return oa.ApiError(503, str(e) or "the engine has stopped", code="engine_dead")
    if isinstance(e, any_engine):
        return oa.ApiError(500, str(e), code="engine_error")
    return oa.ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


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
        resp = _json_error(_api_error(e))
    st.metrics.http.labels(endpoint, str(resp.status)).inc()
    return resp


def _sampling_params(req: oa.ApiRequest, max_tokens: int):
    from . import SamplingParams
    kw = dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
              seed=req.seed, stop=list(req.stop))
    if req.ignore_eos and "ignore_eos" in {f.name for f in dataclasses.fields(SamplingParams)}:
        kw["ignore_eos"] = True
    return SamplingParams(**kw)


def _prepare(st: ServerState, req: oa.ApiRequest):
    """Check the model and the context; the SamplingParams to run with."""
    if req.model != st.model_name:
        raise oa.ApiError(404, f"the model '{req.model}' does not exist; this server serves '{st.model_name}'",
                          "model", "model_not_found")
    eng = st.engine
    ctx = eng.max_model_len
    where = "messages" if req.kind == "chat" else "prompt"
    try:
        n_prompt = len(req.prompt) if oa.is_token_ids(req.prompt) else eng.count_tokens(req.prompt)
    except Exception as e:                   # noqa: BLE001 - e.g. a chat template that refuses the roles
        if isinstance(e, _engine_errors()[3]):
            raise _api_error(e) from None
        raise oa.bad(f"cannot tokenize the prompt: {e}", where) from None
    if n_prompt >= ctx:
        raise oa.bad(f"the prompt has {n_prompt} tokens; this model's context is {ctx}", where,
                     "context_length_exceeded")
    max_tokens = req.max_tokens if req.max_tokens is not None else ctx - n_prompt
    if n_prompt + max_tokens > ctx:
        raise oa.bad(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = {n_prompt + max_tokens} "
                     f"exceeds this model's context of {ctx} tokens", "max_tokens", "context_length_exceeded")
    return _sampling_params(req, max_tokens)      # the engine validates it again at its edge


async def _generate(request: web.Request, parse) -> web.StreamResponse:
    st = request.app[STATE]
    req = parse(oa.load_object(await request.read()))
    params = _prepare(st, req)
    rid, created, t0 = oa.new_id(req.kind), oa.now(), time.perf_counter()
    gen = st.engine.generate(req.prompt, params, request_id=rid)
    st.inflight.add(rid)
    st.requests += 1
    last, ttft, finish, resp = None, None, "rejected", None
    try:
        try:
            out = await gen.__anext__()      # errors before any byte goes out
        except StopAsyncIteration:
            raise oa.ApiError(500, "the engine ended the request without output", code="engine_error") from None
        except (oa.ApiError, asyncio.CancelledError):
            raise
        except Exception as e:               # noqa: BLE001
            raise _api_error(e) from None
        texts: list[str] = []
        if req.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            await resp.prepare(request)
        first = True
        while True:
            last = out
            if out.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            st.generated_tokens += len(out.token_ids)
            if resp is not None:
                use = oa.usage(out.usage.prompt_tokens, out.usage.completion_tokens) if req.continuous_usage else None
                if out.text or out.finish_reason or first:
                    await resp.write(oa.sse(oa.chunk(req, rid, created, out.text, out.finish_reason, use, first)))
                first = False
            else:
                texts.append(out.text)
            if out.finish_reason is not None:
                finish = out.finish_reason
                break
            try:
                out = await gen.__anext__()
            except StopAsyncIteration:
                finish = "stop"
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:           # noqa: BLE001 - after the headers: an error event
                err = _api_error(e)
                if resp is None:
                    raise err from None
                await resp.write(oa.sse(err.body()))
                finish = "error"
                break
        use = oa.usage(last.usage.prompt_tokens, last.usage.completion_tokens)
        if resp is None:
            return web.json_response(oa.reply(req, rid, created, "".join(texts), finish, use))
        if req.include_usage:
            await resp.write(oa.sse(oa.chunk(req, rid, created, None, None, use)))
        await resp.write(oa.sse("[DONE]"))
        await resp.write_eof()
        return resp
    except asyncio.CancelledError:           # the client went away (handler cancellation): free its slot now
        finish = "abort"
        await st.engine.abort(rid)
        raise
    except ConnectionResetError:             # ... or a write found the connection closed
        finish = "abort"
        await st.engine.abort(rid)
        return resp
    finally:
        st.inflight.discard(rid)
        await gen.aclose()
        if last is not None:
            st.metrics.observe_request(last.usage.prompt_tokens, last.usage.completion_tokens, finish, ttft,
                                       time.perf_counter() - t0)
        else:
            st.metrics.finished.labels(finish).inc()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, oa.parse_chat)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, oa.parse_completion)


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
    h = request.app[STATE].engine.health()
    ok = bool(h.get("ok"))
    return web.json_response({"status": "ok" if ok else "unhealthy", "lost": list(h.get("lost") or [])},
                             status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


def make_app(engine: Any, *, api_key: str | None = None, served_model_name: str | None = None,
             max_body: int = DEFAULT_MAX_BODY) -> web.Application:
    """The aiohttp application over a started engine (the caller owns the engine)."""
    app = web.Application(middlewares=[_errors_and_auth], client_max_size=max_body)
    app[STATE] = ServerState(engine, api_key, served_model_name, max_body)
    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_get("/v1/models", models)
    r.add_post("/tokenize", tokenize)
    r.add_get("/v1/tessera/stats", stats)
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    r.add_get("/", index)
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
    from . import AsyncEngine
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncEngine(**cfg.engine) as eng:
        app = make_app(eng, api_key=cfg.api_key, served_model_name=cfg.served_model_name, max_body=cfg.max_body)
        runner, port = await start_site(app, cfg.host, cfg.port)
        print(f"tessera serve: ready http://{cfg.host}:{port} model {app[STATE].model_name} "
              f"(chat page at /, OpenAI API at /v1)", flush=True)
        try:
            await stop.wait()
        finally:
            for rid in list(app[STATE].inflight):
                await eng.abort(rid)
            await runner.cleanup()


def run_command(a: argparse.Namespace) -> int:
    """Run ``tessera serve`` with parsed flags until SIGINT/SIGTERM; 0 on an orderly stop."""
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {a.port}")
    cfg = ServeConfig(host=a.host, port=a.port, api_key=a.api_key, max_body=a.max_body,
                      served_model_name=a.served_model_name, engine=engine_kwargs(a, a.trace))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(cfg))
    else:
        uvloop.run(serve(cfg))
    return 0

