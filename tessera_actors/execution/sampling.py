"""Token sampling on the device that holds the logits, batched.

A step's sampled entries are a :class:`SampleBatch`: for each entry its
logits ``logits[row, col]`` (``[B, T, V]``, any device and float dtype,
read in float32), its temperature, ``top_p``, ``top_k``, seed and
``index`` (the token's position in the request's output), as tensors on
the logits' device made once (a decode plan keeps its batch from step to
step: :mod:`.rows`).  ``temperature == 0`` is greedy (argmax, lowest id on
ties); otherwise the distribution is ``softmax(logits / temperature)``
restricted to the ``top_k`` most likely ids (0: all) and to the smallest
set whose probability reaches ``top_p`` (the most likely id always), and
the token is the inverse-CDF draw of one uniform number, drawn for every
such entry at once.  That number depends only on ``(seed, index)``
(:func:`uniform`), so a seeded request gets the same tokens whatever else
shares its batch and whichever device samples.  Each drawn token's log
probability is that of the unmodified distribution (``log_softmax`` of the
logits), the number a client can compare bitwise across placements.  An
entry may carry a record of :mod:`.sampling_extras` (penalties, logit bias,
a token mask, top log probabilities), applied to its logits before the
draw.  Where the step's graph computed the logits' argmax and log-sum-exp
itself (a GPU deployment's buckets: ``serving.gpu_capture.GreedyHead``), a
greedy batch that asks for no top log probabilities and changes no logits
takes its tokens and their log probabilities from those.  No host read:
the results stay on the device
(:func:`.sampling_extras.pack` puts them in one tensor for one copy,
:func:`~.sampling_extras.unpack` reads it).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from tessera_actors.execution.inputs import to_device
from tessera_actors.execution.sampling_extras import apply_records, top_logprobs
from tessera_actors.runtime.messages import SampleRow

_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)

# (values, dtype) -> the same values in a tensor on the logits' device (through pinned memory on a GPU)
Upload = Callable[[Sequence, torch.dtype], torch.Tensor]


def uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) from ``(seed, index)`` alone (splitmix64)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(index) + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def uniforms(seeds: np.ndarray, index: np.ndarray) -> np.ndarray:
    """:func:`uniform` of each ``(seeds[i], index[i])`` (``uint64`` arrays), at once."""
    with np.errstate(over="ignore"):
        z = seeds * _GOLDEN + index + np.uint64(1)
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def as_sample_row(entry: Any) -> SampleRow:
    """A :class:`SampleRow` from itself or a ``[row, col, temperature, top_p,
    top_k, seed, index(, record)]`` list."""
    if isinstance(entry, SampleRow):
        return entry
    rec = entry[7] if len(entry) > 7 and entry[7] else {}
    return SampleRow(int(entry[0]), int(entry[1]), float(entry[2]), float(entry[3]), int(entry[4]), int(entry[5]),
                     int(entry[6]), rec)


def _upload(device: torch.device) -> Upload:
    return lambda values, dtype: to_device(torch.tensor(values, dtype=dtype), device)


class SampleBatch:
    """The sampled entries of a step on the logits' device (module
    docstring).  ``index`` (host, one per entry) is where each entry's next
    token stands in its request's output: :meth:`advance` moves every entry
    on by one, for a step that samples the same rows again."""

    def __init__(self, entries: Sequence[SampleRow], device: torch.device, upload: Upload | None = None,
                 index: np.ndarray | None = None) -> None:
        """``index``: each entry's index (else ``SampleRow.index``); ``upload``
        puts host values on ``device`` (else a copy through pinned memory)."""
        self.n = len(entries)
        if not self.n:
            raise ValueError("a sample batch needs at least one entry")
        self.upload = upload or _upload(device)
        rows, cols = [e.row for e in entries], [e.col for e in entries]
        # rows 0..n-1 of column 0, in order (a decode step's usual rows): a view of the logits, no gather
        self.first = self.n if rows == list(range(self.n)) and not any(cols) else 0
        self.where = self.upload(rows + cols, torch.int64).view(2, self.n) if not self.first else None
        self.index = np.array([e.index for e in entries], dtype=np.uint64) if index is None else index
        self.records = {i: dict(e.record) for i, e in enumerate(entries) if e.record}
        drawn = [i for i, e in enumerate(entries) if e.temperature > 0.0]
        self.drawn = np.array(drawn, dtype=np.int64)
        self.all_drawn = len(drawn) == self.n
        if drawn:
            picked = [entries[i] for i in drawn]
            self.seeds = np.array([e.seed & _MASK64 for e in picked], dtype=np.uint64)
            floats = self.upload([e.temperature for e in picked] + [e.top_p for e in picked], torch.float32)
            self.temperature, self.top_p = floats.view(2, len(drawn)).unbind(0)
            # 1 + (filtered by top_p) + 2 x (top_k): whether top_p applies decided on the host's float
            flags = [int(e.top_p < 1.0) for e in picked] + [e.top_k for e in picked] + drawn
            ints = self.upload(flags, torch.int64).view(3, len(drawn))
            self.filtered, self.top_k, self.drawn_at = ints[0].bool(), ints[1], ints[2]

    def advance(self) -> None:
        self.index += np.uint64(1)

    def sample(self, logits: torch.Tensor, changing: Sequence[Sequence] = (),
               greedy: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(token ids [n] int64, their log probabilities [n] float32, the top
        log probabilities ``[n, 2, k]`` of :func:`.sampling_extras.top_logprobs`
        or None) on the logits' device; ``changing``: ``[[entry, record]]``
        merged over the entries' own records for this step; ``greedy``: the
        logits' argmax and log-sum-exp ``[B, T]`` (float32) where the step
        computed them, used when every entry is greedy, no record changes its
        logits and none asks for top log probabilities.  No host read."""
        if logits.dim() != 3:
            raise ValueError(f"logits must be [B, T, V], got shape {list(logits.shape)}")
        records = self.records
        if changing:
            records = dict(records)
            for i, rec in changing:
                records[int(i)] = {**records.get(int(i), {}), **rec}
        shaping = {i: r for i, r in records.items() if any(key != "top" for key in r)}   # "top" alone: no change
        tops = max((int(r.get("top", 0)) for r in records.values()), default=0)
        pick = (lambda t: t[:self.first, 0]) if self.first else (lambda t: t[self.where[0], self.where[1]])
        if greedy is not None and not shaping and not tops and not len(self.drawn):
            ids = pick(greedy[0])
            if self.first:   # a view of the step's output, which the next step's kernels rewrite: a copy
                ids = ids.clone()
            chosen = pick(logits).gather(1, ids.view(-1, 1)).view(-1).float() - pick(greedy[1])
            return ids, chosen, None
        raw = pick(logits).float()   # [n, V]
        x = apply_records(raw, shaping) if shaping else raw
        ids = x.argmax(dim=-1)
        if len(self.drawn):
            u = self.upload(uniforms(self.seeds, self.index[self.drawn]), torch.float32)
            sub = x if self.all_drawn else x.index_select(0, self.drawn_at)
            picked = draw(sub, self.temperature, self.top_p, self.filtered, self.top_k, u)
            ids = picked if self.all_drawn else ids.index_copy(0, self.drawn_at, picked)
        logprobs = torch.log_softmax(raw, dim=-1)
        chosen = logprobs.gather(1, ids.view(-1, 1)).view(-1)
        return ids, chosen, top_logprobs(logprobs, tops)


def draw(x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, filtered: torch.Tensor,
         top_k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw of each row of ``x`` ([m, V] float32) with its
    own temperature, ``top_p`` (applied where ``filtered``), ``top_k`` (0:
    all) and uniform number ``u``, all rows at once: an id left out of a
    row is a zero of its CDF, so each row draws what it draws alone."""
    vocab = x.shape[1]
    probs = torch.softmax(x / temperature[:, None], dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    pos = torch.arange(vocab, device=x.device)
    keep = pos[None, :] < torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None]
    in_k = sorted_p.masked_fill(~keep, 0.0)
    before = torch.cumsum(in_k, dim=-1) - in_k                          # mass of the more likely ids
    keep &= ~filtered[:, None] | (before < top_p[:, None])
    keep[:, 0] = True                                                   # the most likely id, whatever top_p
    cdf = torch.cumsum(sorted_p.masked_fill(~keep, 0.0), dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    last = torch.where(keep, pos[None, :], -1).amax(dim=-1, keepdim=True)   # past the end: the last id kept
    return order.gather(1, torch.minimum(pick, last)).view(-1)
