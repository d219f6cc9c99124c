"""The OpenAI wire format of ``tessera serve``: request parsing and validation,
response and stream-chunk shapes, and OpenAI-style errors.

Pure functions over bytes and dicts (no aiohttp, no engine): the server reads
the body, calls :func:`parse_chat` / :func:`parse_completion`, and turns an
:class:`ApiError` into ``{"error": {"message", "type", "param", "code"}}`` with
its HTTP status.  Everything a client can get wrong is caught here, before
the engine sees the request and before any byte of a reply is sent.

Supported fields: ``model``, ``messages`` (chat) / ``prompt`` (completions),
``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``,
``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options``
(``include_usage``; and vLLM's ``continuous_usage_stats``: usage in every
chunk), ``n`` (1 only), a token-id ``prompt``, and the vLLM extensions ``top_k`` and ``ignore_eos``.
Fields that change nothing at their neutral value (``user``,
``presence_penalty: 0``, ``logprobs: false`` ...) are accepted; anything else
is refused with 400 naming the field, rather than silently ignored.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

MAX_STOP = 4                       # OpenAI's limit on stop sequences
MAX_SEED = 2 ** 63 - 1
ROLES = {"system", "user", "assistant", "developer"}

# fields accepted only at the value that makes them a no-op here
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (False,), "echo": (False,),
            "top_logprobs": (0,), "logit_bias": ({},), "best_of": (1,), "parallel_tool_calls": (True, False),
            "suffix": ("",)}
_IGNORED = {"user", "metadata", "store", "service_tier"}


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
    out (the server then fills in what the context allows)."""
    kind: str                                   # "chat" | "completion"
    model: str
    prompt: str | list[dict] | list[int]
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    ignore_eos: bool = False


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
    return v


def _check_fields(data: dict, known: set[str]) -> None:
    for name, value in data.items():
        if name in known or name in _IGNORED:
            continue
        if name in _NEUTRAL:
            if value is not None and value not in _NEUTRAL[name]:
                raise bad(f"'{name}'={value!r} is not supported by this server", name, "unsupported_parameter")
            continue
        raise bad(f"unrecognized request argument supplied: {name}", name, "unrecognized_argument")


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
           "ignore_eos"}


def _common(data: dict, kind: str, prompt: str | list[dict], max_tokens: int | None) -> ApiRequest:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string", "model")
    _int(data, "n", 1, 1)                      # one choice per request
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
    return ApiRequest(kind=kind, model=model, prompt=prompt, max_tokens=max_tokens,
                      temperature=_number(data, "temperature", 1.0, 0.0, 2.0),
                      top_p=_number(data, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                      top_k=_int(data, "top_k", 0) or 0,
                      seed=_int(data, "seed", -MAX_SEED - 1, MAX_SEED),
                      stop=_stop(data), stream=stream,
                      include_usage=_bool(opts, "include_usage") or _bool(opts, "continuous_usage_stats"),
                      continuous_usage=_bool(opts, "continuous_usage_stats"),
                      ignore_eos=_bool(data, "ignore_eos"))


def _content(v: Any, where: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):            # content parts: text only
        out = []
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are supported",
                          "messages")
            out.append(part["text"])
        return "".join(out)
    raise bad(f"{where}: 'content' must be a string or an array of text parts, got {_json_type(v)}", "messages")


def parse_chat(data: dict) -> ApiRequest:
    """Validate a ``/v1/chat/completions`` body (already a dict)."""
    _check_fields(data, _COMMON | {"messages", "max_completion_tokens"})
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
    return _common(data, "chat", prompt, n)


def is_token_ids(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def parse_completion(data: dict) -> ApiRequest:
    """Validate a ``/v1/completions`` body. ``prompt`` is a string or an
    array of token ids (or an array holding one of those); batches of
    several prompts are refused."""
    _check_fields(data, _COMMON | {"prompt"})
    p = data.get("prompt")
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or is_token_ids(p[0])):
        p = p[0]
    if isinstance(p, list) and not is_token_ids(p):
        raise bad("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt")
    if not isinstance(p, (str, list)):
        raise bad("'prompt' is required and must be a string or an array of token ids", "prompt")
    if not p:
        raise bad("'prompt' must not be empty", "prompt")
    return _common(data, "completion", p, _int(data, "max_tokens", 1) or 16)


# ---------------------------------------------------------------- replies

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def reply(req: ApiRequest, rid: str, created: int, text: str, finish: str | None, use: dict) -> dict:
    """The whole (non-streamed) reply object."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice], "usage": use}


def chunk(req: ApiRequest, rid: str, created: int, text: str | None, finish: str | None,
          use: dict | None = None, first: bool = False) -> dict:
    """One stream chunk. ``text=None`` gives a chunk with no choices (the
    closing usage chunk of ``include_usage``)."""
    if req.kind == "chat":
        obj = "chat.completion.chunk"
        delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        obj = "text_completion"
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
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
