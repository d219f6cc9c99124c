"""The sampler's per-row extension record: penalties, logit bias, a token
mask (JSON mode) and top log probabilities, applied on the device that
holds the logits, before the draw of :mod:`.sampling`.

A sampled entry (``SampleRow``) may carry a record, a dict of these keys
(each optional; an absent key is the neutral value):

* ``"pp"``, ``"fp"`` (floats): OpenAI's presence and frequency penalties:
  ``logit[t] -= fp * count[t] + pp * (count[t] > 0)`` over the ids in
  ``"out"`` (the tokens generated so far);
* ``"rp"`` (float > 0): the repetition penalty of CTRL / transformers /
  vLLM over the ids in ``"out"`` and ``"ctx"`` (the prompt's distinct ids):
  a positive logit is divided by it, a negative one multiplied;
* ``"bias"``: ``[[id, value], ...]`` added to the logits (OpenAI's
  ``logit_bias``; -100 bans an id, +100 forces it in practice);
* ``"allow"`` (bytes): a bitmask over the vocabulary (``numpy.packbits``
  order: id ``i`` is bit ``7 - i % 8`` of byte ``i // 8``); ids outside it
  cannot be drawn (constrained sampling: JSON mode);
* ``"top"`` (int): how many of the most likely ids to report with their log
  probabilities (OpenAI's ``top_logprobs``).

Log probabilities, the drawn token's and the top ones, are those of the
model's own distribution (``log_softmax`` of the raw logits), as vLLM
reports by default; the record changes which token is drawn, not them.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

KEYS = ("pp", "fp", "rp", "out", "ctx", "bias", "allow", "top")


def check_record(rec: dict, vocab: int) -> None:
    """``ValueError`` naming what is wrong with a record for a ``vocab``-wide row."""
    unknown = set(rec) - set(KEYS)
    if unknown:
        raise ValueError(f"unknown sampling record keys {sorted(unknown)}")
    for key in ("out", "ctx"):
        if any(not 0 <= int(t) < vocab for t in rec.get(key, ())):
            raise ValueError(f"sampling record {key!r}: token ids must be in [0, {vocab})")
    if any(not 0 <= int(t) < vocab for t, _ in rec.get("bias", ())):
        raise ValueError(f"sampling record 'bias': token ids must be in [0, {vocab})")
    allow = rec.get("allow")
    if allow is not None and len(allow) != (vocab + 7) // 8:
        raise ValueError(f"sampling record 'allow': {len(allow)} bytes for a vocabulary of {vocab}")


def _mask(allow: bytes, vocab: int, device: torch.device) -> torch.Tensor:
    bits = np.unpackbits(np.frombuffer(allow, dtype=np.uint8))[:vocab].astype(bool)
    return torch.from_numpy(bits).to(device)


def apply_records(x: torch.Tensor, records: dict[int, dict]) -> torch.Tensor:
    """The logits ``x`` ([n, V] float32, row i for entry i) with the record
    of each entry in ``records`` applied (a new tensor when any is not
    empty; ``x`` otherwise)."""
    if not any(records.values()):
        return x
    out = x.clone()
    vocab = x.shape[1]
    for i, rec in records.items():
        if rec:
            check_record(rec, vocab)
            out[i] = _apply(out[i], rec)
    return out


def _apply(v: torch.Tensor, rec: dict) -> torch.Tensor:
    dev = v.device
    gen = torch.tensor([int(t) for t in rec.get("out", ())], dtype=torch.int64, device=dev)
    rp = float(rec.get("rp", 1.0))
    if rp != 1.0:
        seen = torch.cat([gen, torch.tensor([int(t) for t in rec.get("ctx", ())], dtype=torch.int64, device=dev)])
        if seen.numel():
            ids = torch.unique(seen)
            vals = v[ids]
            v[ids] = torch.where(vals > 0, vals / rp, vals * rp)
    pp, fp = float(rec.get("pp", 0.0)), float(rec.get("fp", 0.0))
    if (pp or fp) and gen.numel():
        counts = torch.bincount(gen, minlength=v.numel()).to(v.dtype)
        v -= fp * counts + pp * (counts > 0).to(v.dtype)
    bias = rec.get("bias")
    if bias:
        ids = torch.tensor([int(t) for t, _ in bias], dtype=torch.int64, device=dev)
        v.index_add_(0, ids, torch.tensor([float(b) for _, b in bias], dtype=v.dtype, device=dev))
    allow = rec.get("allow")
    if allow is not None:
        v = v.masked_fill(~_mask(allow, v.numel(), dev), float("-inf"))
    return v


def top_logprobs(logprobs: torch.Tensor, k: int) -> torch.Tensor | None:
    """``[n, 2, k]``: the ``k`` most likely ids of each row (float64: ids in
    ``[:, 0]``, their log probabilities in ``[:, 1]``), None for ``k`` 0."""
    if k <= 0:
        return None
    vals, ids = torch.topk(logprobs, min(k, logprobs.shape[1]), dim=-1)
    return torch.stack([ids.to(torch.float64), vals.to(torch.float64)], dim=1)


def pack(ids: torch.Tensor, logprobs: torch.Tensor, top: torch.Tensor | None) -> torch.Tensor:
    """One float64 tensor ``[2 + 2k, n]`` of a step's sampling results (one host read)."""
    parts = [ids.to(torch.float64).view(1, -1), logprobs.to(torch.float64).view(1, -1)]
    if top is not None:
        parts += [top[:, 0].T, top[:, 1].T]
    return torch.cat(parts)


def unpack(host: torch.Tensor) -> tuple[list[int], list[float], list[Any]]:
    """(token ids, their log probabilities, per entry ``[[id, logprob], ...]``
    of the most likely ids, empty lists when none were asked) of :func:`pack`'s tensor."""
    rows = host.tolist()
    tokens, logprobs = list(map(int, rows[0])), rows[1]
    k = (len(rows) - 2) // 2
    if k == 0:
        return tokens, logprobs, []
    top = [[[int(rows[2 + j][i]), rows[2 + k + j][i]] for j in range(k)] for i in range(len(tokens))]
    return tokens, logprobs, top
