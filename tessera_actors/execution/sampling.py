"""Token sampling on the device that holds the logits, batched.

``sample_rows(logits, rows)`` draws one token per entry of ``rows``, each
``[row, col, temperature, top_p, top_k, seed, index]``: the logits
``logits[row, col]`` (``[B, T, V]``, any device and float dtype) are read in
float32; ``temperature == 0`` is greedy (argmax, lowest id on ties);
otherwise the distribution is ``softmax(logits / temperature)`` restricted
to the ``top_k`` most likely ids (0: all) and to the smallest set whose
probability reaches ``top_p``, and the token is the inverse-CDF draw of one
uniform number.  That number depends only on ``(seed, index)`` - ``index``
is the token's position in the request's output - so a seeded request gets
the same tokens whatever else shares its batch and whichever device
samples.  :func:`sample_with_logprobs` also gives each drawn token's log
probability under the unmodified distribution (``log_softmax`` of the
logits), the number a client can compare bitwise across placements.  One
host read for the whole batch.  An entry may carry an eighth element, the
record of :mod:`tessera_actors.execution.sampling_extras` (penalties, logit bias, a token mask,
top log probabilities), applied to that row's logits before the draw.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tessera_actors.execution.inputs import to_device
from tessera_actors.execution.sampling_extras import apply_records, pack, top_count, top_logprobs, unpack

_MASK64 = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) from ``(seed, index)`` alone (splitmix64)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(index) + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def _draw(x: torch.Tensor, temperature: float, top_p: float, top_k: int, u: float) -> torch.Tensor:
    probs = torch.softmax(x / temperature, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    if 0 < top_k < sorted_p.numel():
        sorted_p = sorted_p[:top_k]
        order = order[:top_k]
    if top_p < 1.0:
        before = torch.cumsum(sorted_p, 0) - sorted_p   # mass of the more likely ids
        keep = before < top_p
        keep[0] = True   # the most likely id always: a top_p that rounds to 0 in float32 (1e-300) keeps it alone
        sorted_p = sorted_p[keep]
        order = order[keep]
    cdf = torch.cumsum(sorted_p, 0)
    target = torch.tensor([u], dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.numel() - 1)
    return order[pick[0]]


def sample_rows(logits: torch.Tensor, rows: Sequence[Sequence]) -> list[int]:
    """One token id per entry of ``rows`` (module docstring)."""
    return sample_with_logprobs(logits, rows)[0]


def sample_with_logprobs(logits: torch.Tensor, rows: Sequence[Sequence]) -> tuple[list[int], list[float]]:
    """(token ids, their log probabilities), one per entry of ``rows``."""
    if not rows:
        return [], []
    return to_host(*sample_on_device(logits, rows))[:2]


def to_host(ids: torch.Tensor, logprobs: torch.Tensor, top: torch.Tensor | None = None
            ) -> tuple[list[int], list[float], list]:
    """(token ids, their log probabilities, each entry's top log
    probabilities ``[[id, logprob], ...]`` or ``[]`` when none was asked)
    from the device tensors of :func:`sample_on_device`, in one host read."""
    return unpack(pack(ids, logprobs, top).cpu())


def sample_on_device(logits: torch.Tensor, rows: Sequence[Sequence]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(token ids [n] int64, their log probabilities [n] float32, the top
    log probabilities ``[n, 2, k]`` of :func:`tessera_actors.execution.sampling_extras.top_logprobs`
    or None) on the logits' device, one per entry of ``rows`` (non-empty);
    no host read."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {list(logits.shape)}")
    index = to_device(torch.tensor([[int(r[0]) for r in rows], [int(r[1]) for r in rows]], dtype=torch.int64),
                      logits.device)
    raw = logits[index[0], index[1]].float()                        # [n, V]
    x = apply_records(raw, rows)
    greedy = [float(r[2]) <= 0.0 for r in rows]
    if all(greedy):
        ids = x.argmax(dim=-1)
    else:
        best = x.argmax(dim=-1) if any(greedy) else None
        ids = torch.stack([best[i] if g else _draw(x[i], float(r[2]), float(r[3]), int(r[4]),
                                                   uniform(int(r[5]), int(r[6])))
                           for i, (g, r) in enumerate(zip(greedy, rows))])
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, ids.view(-1, 1)).view(-1)
    return ids, chosen, top_logprobs(logprobs, top_count(rows))
