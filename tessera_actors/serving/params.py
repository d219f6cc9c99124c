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

INT64_MAX = 2 ** 63 - 1   # integers a request sends on to the devices: node deployments carry them as int64


def surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate in ``text`` (a code point a JSON
    ``\\ud800`` escape can make, which is no character and cannot be
    encoded or tokenized), None when there is none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


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
    end-of-sequence token (benchmarks that need exact output lengths).

    Applied to the logits on the device that samples, before the draw
    (``sampling_extras``): ``presence_penalty`` and ``frequency_penalty``
    (OpenAI's, in [-2, 2], over the tokens generated so far),
    ``repetition_penalty`` (> 0; 1 is none: CTRL's, over the prompt and
    the tokens so far), ``logit_bias`` (token id -> value in [-100, 100])
    and ``json`` (only ids that keep the reply a prefix of one JSON object:
    constrained sampling, ``json_mode``).  ``top_logprobs`` (0..20): the
    most likely ids with their log probabilities, reported for each token
    (``RequestOutput.top_logprobs``)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int = 0
    json: bool = False

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
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= INT64_MAX:
            raise bad("top_k", f"must be an integer in [0, 2**63 - 1], got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -INT64_MAX - 1 <= self.seed <= INT64_MAX):
            raise bad("seed", f"must be a 64-bit signed integer or null, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if any(surrogate_at(s) is not None for s in self.stop):
            raise bad("stop", "a stop string holds a lone surrogate (no character: it can never match)")
        if len(self.stop) > 16:
            raise bad("stop", f"at most 16 stop strings, got {len(self.stop)}")
        self._validate_logits_options(bad)
        return self

    def _validate_logits_options(self, bad) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise bad(name, f"must be a number in [-2, 2], got {v!r}")
        v = self.repetition_penalty
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise bad("repetition_penalty", f"must be a number > 0, got {v!r}")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > 300:
            raise bad("logit_bias", "must map at most 300 token ids to numbers")
        for k, b in self.logit_bias.items():
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= INT64_MAX:
                raise bad("logit_bias", f"keys must be token ids, got {k!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise bad("logit_bias", f"values must be numbers in [-100, 100], got {b!r}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) \
                or not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", f"must be an integer in [0, 20], got {self.top_logprobs!r}")
        if not isinstance(self.json, bool):
            raise bad("json", f"must be a boolean, got {self.json!r}")

    @property
    def shapes_logits(self) -> bool:
        """Whether a sampling record goes with each token (anything but the plain draw)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.top_logprobs or self.json)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestOutput:
    """One streamed piece, the caller's to keep (the engine makes one per
    token per request, so it is a plain slotted record: cheap to make).
    ``text``: new text since the last output (whole characters only);
    ``token_ids``: new ids; ``finish_reason``: None until the last output,
    then "stop" (end of sequence or a stop string), "length" (max_tokens or
    the context) or "abort"; ``usage`` so far; ``logprobs``: the log
    probability of each new id (computed where the logits are);
    ``top_logprobs``: per new id, ``[[id, logprob], ...]`` of the most
    likely ids when ``SamplingParams.top_logprobs`` asked for them."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
