"""Expert load: how much of a mixture of experts' routed weights a step
really reads, from the router's statistics of a warm-up batch (ATSInfer's
expert load).

``expert_load`` maps a routed expert weight's name (one part of a layer's
stacked experts: ``layers.3.experts.gate_up.1``, or the whole stack) to the
share of tokens its router sends to each of its experts (``p_e``: the
fraction of the warm-up's tokens with ``e`` among their top-k, so a layer's
shares sum to ``top_k``).  A step of ``n`` tokens reads expert ``e``'s rows
with probability ``1 - (1 - p_e)^n`` (tokens routed independently), and a
grouped GEMM reads only the experts that got rows: the kernel's time
beyond its launch is scaled by the expected share of its weight's bytes read
(:func:`read_fraction`) on every device.  A streamed part is copied whole
whatever the routing, so streaming a cold part costs its full bytes while
computing it on the CPU costs its expected bytes: the planner keeps hot
parts resident and leaves cold ones to the CPU.  Pure Python; no torch.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import PlanError


def check_load(load: Mapping | None) -> dict[str, tuple[float, ...]]:
    """``expert_load`` as ``{name: (p_e, ...)}``, every share in [0, 1]."""
    if not load:
        return {}
    try:
        out = {str(n): tuple(float(p) for p in ps) for n, ps in dict(load).items()}
    except (TypeError, ValueError):
        raise PlanError("expert_load maps weight names to lists of per-expert token shares") from None
    bad = [n for n, ps in out.items() if not ps or any(not 0.0 <= p <= 1.0 for p in ps)]
    if bad:
        raise PlanError(f"expert_load: shares must be in [0, 1], one per expert; bad for {bad[:3]}")
    return out


def step_tokens(graph: KernelGraph) -> int:
    """Tokens one step of ``graph`` routes: the elements of its ``input_ids`` input (1 if none)."""
    for b in graph.buffers.values():
        if b.role == "input" and b.name == "input_ids" and b.shape:
            return max(1, math.prod(b.shape))
    return 1


def read_fraction(shares: Sequence[float], tokens: int) -> float:
    """Expected share of a part's experts that get rows in a step of ``tokens`` tokens."""
    return sum(1.0 - (1.0 - p) ** tokens for p in shares) / len(shares)


def apply_load(times: list[list[float]], graph: KernelGraph, launch: Sequence[float],
               load: Mapping[str, Sequence[float]]) -> None:
    """Scale, in place, the time beyond ``launch[d]`` of every kernel that
    reads a weight of ``load`` by the bytes-weighted :func:`read_fraction`
    of those weights at the graph's :func:`step_tokens`."""
    if not load:
        return
    n = step_tokens(graph)
    for k in graph.kernels:
        hit = [(graph.buffers[a.buffer].nbytes, load[graph.buffers[a.buffer].name]) for a in k.accesses
               if graph.buffers[a.buffer].role == "weight" and graph.buffers[a.buffer].name in load]
        if not hit:
            continue
        total = sum(nb for nb, _ in hit)
        f = sum(nb * read_fraction(ps, n) for nb, ps in hit) / max(total, 1)
        times[k.id] = [lo + f * max(t - lo, 0.0) for t, lo in zip(times[k.id], launch)]


__all__ = ["apply_load", "check_load", "read_fraction", "step_tokens"]
