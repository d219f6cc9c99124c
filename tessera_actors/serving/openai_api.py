"""The OpenAI wire format of ``tessera serve``: request parsing and validation,
response and stream-chunk shapes, and OpenAI-style errors.

Pure functions over bytes and dicts (no aiohttp, no engine): the server reads
the body, calls :func:`parse_chat` / :func:`parse_completion`, and turns an
:class:`ApiError` into ``{"error": {"message", "type", "param", "code"}}`` with
its HTTP status.  Everything a client can get wrong is caught here, before
the engine sees the request and before any byte of a reply is sent.

Supported fields: ``model``, ``messages`` (chat) / ``prompt`` (completions:
a string, token ids, or a list of either - one choice each), ``max_tokens``
(chat also ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``,
``stop``, ``stream``, ``stream_options`` (``include_usage``; and vLLM's
``continuous_usage_stats``: usage in every chunk), ``n`` (choices per
prompt), ``logprobs`` / ``top_logprobs``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``response_format`` (``text`` or
``json_object``: constrained sampling), and the vLLM extensions ``top_k``,
``repetition_penalty`` and ``ignore_eos``.  What this server cannot do as
asked (``echo``, a ``suffix``, ``tools``, ``best_of`` above ``n``, a JSON
schema) is refused with 400 naming the field; a field it does not know is
accepted and ignored, as vLLM does, and named in ``ApiRequest.ignored``
(the server answers with a ``Warning`` header and counts it).
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tessera_actors.serving.params import INT64_MAX, SamplingParams, surrogate_at

MAX_STOP = 4                       # OpenAI's limit on stop sequences
MAX_SEED = INT64_MAX               # seeds and top_k reach the devices as int64
ROLES = {"system", "user", "assistant", "developer"}

MAX_N = 16                         # choices per prompt
MAX_PROMPTS = 32                   # prompts in one /v1/completions request

# fields accepted only at the value that makes them a no-op here
_NEUTRAL = {"echo": (False,), "parallel_tool_calls": (True, False), "suffix": ("",), "tools": ([],),
            "tool_choice": ("none",), "functions": ([],), "function_call": ("none",)}
_IGNORED = {"user", "metadata", "store", "service_tier"}   # known to change nothing here: no warning


class ApiError(Exception):
    """An error reply: HTTP ``status`` and the OpenAI error object."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or self.TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass
class ApiRequest:
    """A validated request. ``prompt`` is a str or a list of token ids
    (completions: raw text) or a list of ``{"role", "content"}`` dicts (chat:
    rendered with the model's template by the engine). ``max_tokens`` is None when the client left it
    out (the server then fills in what the context allows). ``sampling``: the
    engine's parameters as the request gave them (OpenAI's defaults otherwise);
    the server sets their ``max_tokens`` per prompt and their seed per choice."""
    kind: str                                   # "chat" | "completion"
    model: str
    prompt: str | list[dict] | list[int]
    max_tokens: int | None
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    n: int = 1
    prompts: list = field(default_factory=list)   # completions: every prompt (``prompt`` is the first)
    logprobs: bool = False                         # report each token's log probability
    ignored: list = field(default_factory=list)    # unknown fields, accepted and ignored


def load_object(body: bytes) -> dict:
    """The JSON object in ``body``: strict UTF-8, no NaN/Infinity, an object at the top."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"request body is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise bad("request body is empty; expected a JSON object")

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")
    try:
        data = json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        raise bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad(f"request body must be a JSON object, got {_json_type(data)}")
    return data


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number")


def _int(data: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = data.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer, got {_json_type(v)}", name)
    if lo is not None and v < lo:
        raise bad(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def _number(data: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = data.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"'{name}' must be a number, got {_json_type(v)}", name)
    if v < lo or (lo_open and v == lo) or v > hi:
        raise bad(f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", name)
    return float(v)


def _bool(data: dict, name: str) -> bool:
    v = data.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {_json_type(v)}", name)
    return v


def _stop(data: dict) -> list[str]:
    v = data.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop' must be a string or an array of strings", "stop")
    if len(v) > MAX_STOP:
        raise bad(f"'stop' takes at most {MAX_STOP} sequences, got {len(v)}", "stop")
    if any(not s for s in v):
        raise bad("'stop' sequences must not be empty", "stop")
    for s in v:
        _text(s, "'stop'", "stop")
    return v


def _text(v: str, where: str, param: str) -> str:
    """``v``, unless it holds a lone surrogate (a ``\\ud800`` escape: no character, it cannot be tokenized)."""
    at = surrogate_at(v)
    if at is not None:
        raise bad(f"{where} holds a lone surrogate at character {at} ({v[at]!r}), which is not text; send the "
                  f"character itself or a valid surrogate pair", param)
    return v


def _check_fields(data: dict, known: set[str]) -> list[str]:
    """The unknown fields of ``data`` (accepted, ignored); 400 for a known
    one this server cannot honour at the value given."""
    unknown = []
    for name, value in data.items():
        if name in known or name in _IGNORED:
            continue
        if name in _NEUTRAL:
            if value is not None and value not in _NEUTRAL[name]:
                raise bad(f"'{name}'={value!r} is not supported by this server", name, "unsupported_parameter")
            continue
        unknown.append(name)
    return unknown


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
           "ignore_eos", "best_of", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "logit_bias", "response_format"}


def _common(data: dict, kind: str, prompt: str | list[dict], max_tokens: int | None) -> ApiRequest:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string", "model")
    n = _int(data, "n", 1, MAX_N) or 1
    best_of = _int(data, "best_of", 1)
    if best_of is not None and best_of != n:
        raise bad(f"'best_of'={best_of} is not supported: this server returns every sequence it draws (n={n})",
                  "best_of", "unsupported_parameter")
    opts = data.get("stream_options")
    stream = _bool(data, "stream")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise bad(f"unknown stream_options field: {sorted(unknown)[0]}", "stream_options")
    opts = opts or {}
    logits = _logits_options(data, kind)
    logprobs = logits.pop("logprobs")
    sampling = SamplingParams(temperature=_number(data, "temperature", 1.0, 0.0, 2.0),
                              top_p=_number(data, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                              top_k=_int(data, "top_k", 0, INT64_MAX) or 0,
                              seed=_int(data, "seed", -MAX_SEED - 1, MAX_SEED),
                              stop=_stop(data), ignore_eos=_bool(data, "ignore_eos"), **logits)
    return ApiRequest(kind=kind, model=model, prompt=prompt, max_tokens=max_tokens, sampling=sampling,
                      stream=stream,
                      include_usage=_bool(opts, "include_usage") or _bool(opts, "continuous_usage_stats"),
                      continuous_usage=_bool(opts, "continuous_usage_stats"), n=n, logprobs=logprobs)


def _logits_options(data: dict, kind: str) -> dict:
    """The fields that shape the logits or report log probabilities
    (``logprobs`` for the request, the rest for its ``SamplingParams``)."""
    out: dict[str, Any] = {
        "presence_penalty": _number(data, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(data, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _number(data, "repetition_penalty", 1.0, 0.0, 100.0, lo_open=True)}
    if kind == "chat":               # logprobs: a boolean; top_logprobs 0..20 with it
        out["logprobs"] = _bool(data, "logprobs")
        out["top_logprobs"] = _int(data, "top_logprobs", 0, 20) or 0
        if out["top_logprobs"] and not out["logprobs"]:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:                            # logprobs: how many of the most likely tokens to report (0..20)
        k = _int(data, "logprobs", 0, 20)
        out["logprobs"], out["top_logprobs"] = k is not None, k or 0
    bias = data.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > 300:
            raise bad("'logit_bias' must be an object of at most 300 token ids", "logit_bias")
        parsed = {}
        for raw, value in bias.items():
            key = str(raw)
            if not (key.isascii() and key.isdigit() and len(key) <= 19 and int(key) <= INT64_MAX):
                raise bad(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise bad(f"'logit_bias' values must be numbers in [-100, 100], got {value!r}", "logit_bias")
            parsed[int(key)] = float(value)
        out["logit_bias"] = parsed
    fmt = data.get("response_format")
    if fmt is not None:
        kind_of = fmt.get("type") if isinstance(fmt, dict) else None
        if kind_of not in ("text", "json_object"):
            raise bad("'response_format' must be {'type': 'text'} or {'type': 'json_object'} (JSON schemas are "
                      "not supported)", "response_format", "unsupported_parameter")
        out["json"] = kind_of == "json_object"
    return out


def _content(v: Any, where: str) -> str:
    if isinstance(v, str):
        return _text(v, f"{where}: 'content'", "messages")
    if isinstance(v, list):            # content parts: text only
        out = []
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are supported",
                          "messages")
            out.append(_text(part["text"], f"{where}: a text part", "messages"))
        return "".join(out)
    raise bad(f"{where}: 'content' must be a string or an array of text parts, got {_json_type(v)}", "messages")


def parse_chat(data: dict) -> ApiRequest:
    """Validate a ``/v1/chat/completions`` body (already a dict)."""
    ignored = _check_fields(data, _COMMON | {"messages", "max_completion_tokens"})
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array of {'role', 'content'} objects", "messages")
    prompt = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object, got {_json_type(m)}", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}: 'role' must be one of {sorted(ROLES)}, got {role!r}", "messages")
        if "tool_calls" in m or "function_call" in m:
            raise bad(f"{where}: tool calls are not supported", "messages")
        prompt.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), where)})
    n = _int(data, "max_completion_tokens", 1)
    if n is None:
        n = _int(data, "max_tokens", 1)
    req = _common(data, "chat", prompt, n)
    req.prompts, req.ignored = [prompt], ignored
    return req


def is_token_ids(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def _texts_or_ids(data: dict, name: str) -> list:
    """Field ``name`` as a list: a string or an array of token ids is one
    item, an array of those is several (400 otherwise)."""
    x = data.get(name)
    if isinstance(x, str) or is_token_ids(x):
        return [x]
    if isinstance(x, list) and x and all(isinstance(i, str) or is_token_ids(i) for i in x):
        return list(x)
    raise bad(f"'{name}' is required: a string, an array of token ids, or an array of those", name)


def parse_completion(data: dict) -> ApiRequest:
    """Validate a ``/v1/completions`` body. ``prompt`` is a string, an array
    of token ids, or an array of strings or of token-id arrays (a batch:
    ``n`` choices for each, indexed prompt by prompt)."""
    ignored = _check_fields(data, _COMMON | {"prompt"})
    prompts = _texts_or_ids(data, "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"'prompt' holds at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt")
    if any(not x for x in prompts):
        raise bad("'prompt' must not be empty", "prompt")
    for i, x in enumerate(prompts):
        if isinstance(x, str):
            _text(x, "'prompt'" if len(prompts) == 1 else f"'prompt'[{i}]", "prompt")
    req = _common(data, "completion", prompts[0], _int(data, "max_tokens", 1) or 16)
    req.prompts, req.ignored = prompts, ignored
    return req


@dataclass
class EmbeddingRequest:
    model: str
    inputs: list                       # strings or token-id lists
    encoding_format: str = "float"     # float | base64 (little-endian float32)
    ignored: list = field(default_factory=list)


def parse_embeddings(data: dict) -> EmbeddingRequest:
    """Validate a ``/v1/embeddings`` body: ``input`` a string, token ids, or
    an array of either (one embedding each)."""
    ignored = _check_fields(data, {"model", "input", "encoding_format", "dimensions"})
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string", "model")
    inputs = _texts_or_ids(data, "input")
    if len(inputs) > MAX_PROMPTS or any(not i for i in inputs):
        raise bad(f"'input' holds 1 to {MAX_PROMPTS} non-empty inputs", "input")
    fmt = data.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    if data.get("dimensions") is not None:
        raise bad("'dimensions' is not supported: embeddings have the model's hidden size", "dimensions",
                  "unsupported_parameter")
    return EmbeddingRequest(model, inputs, fmt, ignored)


# ---------------------------------------------------------------- replies

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class TokenLogprob:
    """One generated token for a ``logprobs`` reply: its text, its log
    probability, and the most likely alternatives ``[(text, logprob)]``."""
    text: str
    logprob: float
    top: list = field(default_factory=list)


def logprobs_payload(req: ApiRequest, tokens: list[TokenLogprob], offset: int = 0) -> dict | None:
    """A choice's ``logprobs`` object in the request's shape (chat:
    ``{"content": [...]}``; completions: tokens, token_logprobs,
    top_logprobs, text_offset from ``offset``); None unless asked."""
    if not req.logprobs:
        return None
    if req.kind == "chat":
        def one(text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        return {"content": [dict(one(t.text, t.logprob), top_logprobs=[one(x, y) for x, y in t.top])
                            for t in tokens]}
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [dict(t.top) for t in tokens] if req.sampling.top_logprobs else None, "text_offset": offsets}


@dataclass
class Choice:
    index: int
    text: str
    finish: str | None
    logprobs: dict | None = None


def reply(req: ApiRequest, rid: str, created: int, choices: list[Choice], use: dict) -> dict:
    """The whole (non-streamed) reply object."""
    if req.kind == "chat":
        body = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": c.logprobs,
                 "finish_reason": c.finish} for c in choices]
        obj = "chat.completion"
    else:
        body = [{"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish}
                for c in choices]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": body, "usage": use}


def chunk(req: ApiRequest, rid: str, created: int, text: str | None, finish: str | None,
          use: dict | None = None, first: bool = False, index: int = 0, logprobs: dict | None = None) -> dict:
    """One stream chunk of choice ``index``. ``text=None`` gives a chunk with
    no choices (the closing usage chunk of ``include_usage``)."""
    if req.kind == "chat":
        obj = "chat.completion.chunk"
        delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    else:
        obj = "text_completion"
        choices = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
    out = {"id": rid, "object": obj, "created": created, "model": req.model,
           "choices": [] if text is None and finish is None and not first else choices}
    if use is not None:
        out["usage"] = use
    return out


def sse(obj: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)).encode() + b"\n\n"


def models_list(name: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "tessera",
                                        "max_model_len": max_model_len}]}


def now() -> int:
    return int(time.time())
