"""What a request asks for and what it gets back (torch-free).

``SamplingParams`` is validated by :meth:`SamplingParams.validate` at the
engine's edge, before any device work; an invalid value raises
:class:`InvalidRequest` naming the parameter.  ``RequestOutput`` is one
streamed piece of a reply: the text and ids that are new since the last
piece, and on the last piece a ``finish_reason``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


class EngineError(RuntimeError):
    """Base of the serving errors."""


class InvalidRequest(EngineError, ValueError):
    """The request cannot be served as asked (HTTP 400); ``param`` names the
    offending field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineBusy(EngineError):
    """The bounded waiting queue is full (HTTP 429): retry later."""


class EngineDead(EngineError):
    """The engine stopped or lost every device (HTTP 503)."""


@dataclass
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_k`` 0 keeps every token; ``seed``
    None draws a fresh seed per request; ``stop``: strings that end the
    reply (not included in it); ``ignore_eos`` keeps generating past the
    end-of-sequence token (benchmarks that need exact output lengths)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
        def bad(param: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{param}: {why}", param)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", f"must be an integer or null, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > 16:
            raise bad("stop", f"at most 16 stop strings, got {len(self.stop)}")
        return self


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestOutput:
    """``text``: new text since the last output (whole characters only);
    ``token_ids``: new ids; ``finish_reason``: None until the last output,
    then "stop" (end of sequence or a stop string), "length" (max_tokens or
    the context) or "abort"; ``usage`` so far; ``logprobs``: the log
    probability of each new id (computed where the logits are)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    logprobs: list[float] = field(default_factory=list)
