"""The generation endpoints of ``tessera serve``: ``/v1/chat/completions``
and ``/v1/completions`` (``n`` choices for each prompt, several prompts in
one completions request, log probabilities, streamed or whole) and
``/v1/embeddings``.

Contracts:
- Every choice is one engine request (``request_id`` ``<reply id>-<index>``);
  they are all queued at once, and the first output of each is awaited
  before the reply starts, so any error is an HTTP error, never inside a 200.
- Streamed, the choices' pieces go out as they come, each chunk naming its
  choice ``index``; a client that goes away aborts every choice.
- Unknown request fields are ignored (as vLLM does): the reply carries a
  ``Warning`` header naming them and ``/metrics`` counts them.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import struct
import time
from typing import Any

from aiohttp import web

from tessera_actors.serving import openai_api as oa

log = logging.getLogger("tessera.serve")


def engine_errors():
    from tessera_actors.serving import EngineBusy, EngineDead, EngineError, InvalidRequest
    return InvalidRequest, EngineBusy, EngineDead, EngineError


def api_error(e: BaseException) -> oa.ApiError:
    """An engine exception as the HTTP error a client gets."""
    invalid, busy, dead, any_engine = engine_errors()
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


def sampling_params(req: oa.ApiRequest, max_tokens: int, choice: int = 0):
    """The engine's parameters for choice ``choice`` of ``req`` (a seeded
    request's choices draw with seeds ``seed``, ``seed + 1``, ...)."""
    s = req.sampling
    seed = None if s.seed is None else (s.seed + choice) % (oa.MAX_SEED + 1)
    return dataclasses.replace(s, max_tokens=max_tokens, seed=seed, stop=list(s.stop), logit_bias=dict(s.logit_bias))


def max_tokens_for(st, req: oa.ApiRequest, prompt) -> tuple[list[int], int]:
    """(the prompt's token ids, max_tokens) of one prompt: the model checked,
    the context respected (400 otherwise).  The prompt is tokenized here
    only: the engine is given the ids."""
    if req.model != st.model_name:
        raise oa.ApiError(404, f"the model '{req.model}' does not exist; this server serves '{st.model_name}'",
                          "model", "model_not_found")
    ctx = st.engine.max_model_len
    where = "messages" if req.kind == "chat" else "prompt"
    try:
        ids = list(prompt) if oa.is_token_ids(prompt) else st.engine.encode_prompt(prompt)
    except Exception as e:                   # noqa: BLE001 - e.g. a chat template that refuses the roles
        if isinstance(e, engine_errors()[3]):
            raise api_error(e) from None
        raise oa.bad(f"cannot tokenize the prompt: {e}", where) from None
    n_prompt = len(ids)
    if n_prompt >= ctx:
        raise oa.bad(f"the prompt has {n_prompt} tokens; this model's context is {ctx}", where,
                     "context_length_exceeded")
    max_tokens = req.max_tokens if req.max_tokens is not None else ctx - n_prompt
    if n_prompt + max_tokens > ctx:
        raise oa.bad(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = {n_prompt + max_tokens} "
                     f"exceeds this model's context of {ctx} tokens", "max_tokens", "context_length_exceeded")
    return ids, max_tokens


def token_text(engine, token: int) -> str:
    tok = getattr(engine, "tokenizer", None)
    if tok is None:
        return str(token)
    return tok.hf.decode([int(token)], skip_special_tokens=False)


@dataclasses.dataclass
class _Choice:
    index: int
    rid: str
    gen: Any
    out: Any = None                   # the latest output
    texts: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)   # TokenLogprob per token (when asked)
    finish: str | None = None
    ttft: float | None = None


def _logprobs_of(engine, req: oa.ApiRequest, out) -> list[oa.TokenLogprob]:
    if not req.logprobs:
        return []
    tops = out.top_logprobs or [[] for _ in out.token_ids]
    return [oa.TokenLogprob(token_text(engine, t), lp, [(token_text(engine, i), x) for i, x in top])
            for t, lp, top in zip(out.token_ids, out.logprobs, tops)]


async def generate(request: web.Request, st, parse) -> web.StreamResponse:
    """A chat or completions request (``st``: the server's state; ``parse``: its validator)."""
    req = parse(oa.load_object(await request.read()))
    headers = ignored_fields_header(st, req.ignored)
    rid, created, t0 = oa.new_id(req.kind), oa.now(), time.perf_counter()
    plans = []
    for p, prompt in enumerate(req.prompts):
        ids, max_tokens = max_tokens_for(st, req, prompt)
        plans += [(p * req.n + j, ids, sampling_params(req, max_tokens, j), len(ids)) for j in range(req.n)]
    choices = [_Choice(i, f"{rid}-{i}", st.engine.generate(prompt, params, request_id=f"{rid}-{i}"))
               for i, prompt, params, _ in plans]
    st.requests += 1
    st.inflight.update(c.rid for c in choices)
    resp = None
    try:
        await _first_outputs(choices, t0)
        if not req.stream:
            await asyncio.gather(*(_drain(st, req, c, t0) for c in choices))
            return web.json_response(_whole_reply(st, req, rid, created, choices, plans), headers=headers)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        await resp.prepare(request)
        await _stream(st, req, rid, created, choices, resp, t0)
        if req.include_usage:
            await resp.write(oa.sse(oa.chunk(req, rid, created, None, None, _usage(req, choices, plans))))
        await resp.write(oa.sse("[DONE]"))
        await resp.write_eof()
        return resp
    except asyncio.CancelledError:           # the client went away (handler cancellation): free the slots now
        await _abort(st, choices)
        raise
    except ConnectionResetError:             # ... or a write found the connection closed
        await _abort(st, choices)
        return resp
    finally:
        for c in choices:
            st.inflight.discard(c.rid)
            await c.gen.aclose()
            _observe(st, c, t0)


async def _first_outputs(choices: list[_Choice], t0: float) -> None:
    """Every choice queued, and its first output (or its error) awaited."""
    async def first(c: _Choice) -> None:
        try:
            c.out = await c.gen.__anext__()
        except StopAsyncIteration:
            raise oa.ApiError(500, "the engine ended the request without output", code="engine_error") from None
        if c.out.token_ids:
            c.ttft = time.perf_counter() - t0
    results = await asyncio.gather(*(first(c) for c in choices), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for c in choices:
            await c.gen.aclose()
        if isinstance(errors[0], asyncio.CancelledError):
            raise errors[0]
        raise api_error(errors[0]) from None


async def _next(c: _Choice, t0: float) -> bool:
    """Take ``c``'s next output into ``c.out``; False once it ended."""
    if c.out is not None and c.out.finish_reason is not None:
        c.finish = c.out.finish_reason
        return False
    try:
        c.out = await c.gen.__anext__()
    except StopAsyncIteration:
        c.finish = c.finish or "stop"
        return False
    if c.ttft is None and c.out.token_ids:
        c.ttft = time.perf_counter() - t0
    return True


def _take(st, req: oa.ApiRequest, c: _Choice) -> None:
    out = c.out
    st.generated_tokens += len(out.token_ids)
    c.texts.append(out.text)
    c.tokens += _logprobs_of(st.engine, req, out)
    if out.finish_reason is not None:
        c.finish = out.finish_reason


async def _drain(st, req: oa.ApiRequest, c: _Choice, t0: float) -> None:
    _take(st, req, c)
    while await _next(c, t0):
        _take(st, req, c)


async def _stream(st, req: oa.ApiRequest, rid: str, created: int, choices: list[_Choice],
                  resp: web.StreamResponse, t0: float) -> None:
    """Write every choice's pieces as they come (an engine error after the
    headers: an ``error`` event)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice) -> None:
        try:
            queue.put_nowait((c, True))
            while await _next(c, t0):
                queue.put_nowait((c, False))
        except Exception as e:               # noqa: BLE001 - reported in the stream
            queue.put_nowait((c, e))
        finally:
            queue.put_nowait((c, None))
    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        live = len(choices)
        while live:
            c, item = await queue.get()
            if item is None:
                live -= 1
                continue
            if isinstance(item, BaseException):
                await resp.write(oa.sse(api_error(item).body()))
                c.finish = "error"
                continue
            first = item is True
            offset = sum(len(t) for t in c.texts)
            _take(st, req, c)
            out = c.out
            use = oa.usage(out.usage.prompt_tokens, out.usage.completion_tokens) if req.continuous_usage else None
            if out.text or out.finish_reason or first:
                lps = oa.logprobs_payload(req, _logprobs_of(st.engine, req, out), offset)
                await resp.write(oa.sse(oa.chunk(req, rid, created, out.text, out.finish_reason, use, first,
                                                 c.index, lps)))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(req: oa.ApiRequest, choices: list[_Choice], plans: list) -> dict:
    """Prompt tokens once per prompt; completion tokens over every choice."""
    prompt = sum(n for i, _, _, n in plans if i % req.n == 0)
    completion = sum(c.out.usage.completion_tokens if c.out is not None else 0 for c in choices)
    return oa.usage(prompt, completion)


def _whole_reply(st, req: oa.ApiRequest, rid: str, created: int, choices: list[_Choice], plans: list) -> dict:
    body = [oa.Choice(c.index, "".join(c.texts), c.finish, oa.logprobs_payload(req, c.tokens)) for c in choices]
    return oa.reply(req, rid, created, body, _usage(req, choices, plans))


async def _abort(st, choices: list[_Choice]) -> None:
    for c in choices:
        c.finish = "abort"
        await st.engine.abort(c.rid)


def _observe(st, c: _Choice, t0: float) -> None:
    if c.out is not None:
        st.metrics.observe_request(c.out.usage.prompt_tokens, c.out.usage.completion_tokens,
                                   c.finish or "abort", c.ttft, time.perf_counter() - t0)
    else:   # no output yet: refused, or aborted while waiting for its first token
        st.metrics.finished.labels(c.finish or "rejected").inc()


def ignored_fields_header(st, names: list[str]) -> dict:
    """A ``Warning`` header naming the request fields this server ignored
    (counted in ``/metrics``; each name logged once)."""
    if not names:
        return {}
    for name in names:
        st.metrics.ignored_fields.labels(name).inc()
        if name not in st.warned_fields:
            st.warned_fields.add(name)
            log.warning("ignoring unrecognized request field %r (accepted, as vLLM does)", name)
    return {"Warning": f'299 tessera "ignored unrecognized request fields: {", ".join(sorted(names))}"'}


async def embeddings(request: web.Request, st) -> web.Response:
    """``/v1/embeddings``: the mean-pooled final hidden state of each input."""
    req = oa.parse_embeddings(oa.load_object(await request.read()))
    headers = ignored_fields_header(st, req.ignored)
    if req.model != st.model_name:
        raise oa.ApiError(404, f"the model '{req.model}' does not exist; this server serves '{st.model_name}'",
                          "model", "model_not_found")
    try:
        got = await asyncio.gather(*(st.engine.embed(x) for x in req.inputs))
    except Exception as e:                   # noqa: BLE001
        raise api_error(e) from None
    data = []
    for i, (vec, _) in enumerate(got):
        emb: Any = vec if req.encoding_format == "float" else \
            base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = sum(n for _, n in got)
    return web.json_response({"object": "list", "data": data, "model": req.model,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, headers=headers)
