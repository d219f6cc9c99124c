"""Public helpers for testing graphs and plans (used by the test-suite and
by anyone checking a captured graph of their own)."""
from __future__ import annotations

import random
from typing import Sequence

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import legal_cuts


def random_topological_order(graph: KernelGraph, rng: random.Random) -> list[int]:
    """A uniformly-chosen-at-each-step topological order of all edges."""
    preds = graph.preds()
    indeg = [len(p) for p in preds]
    succs: list[list[int]] = [[] for _ in graph.kernels]
    for k, ps in enumerate(preds):
        for p in ps:
            succs[p].append(k)
    ready = [k for k, d in enumerate(indeg) if d == 0]
    order = []
    while ready:
        k = ready.pop(rng.randrange(len(ready)))
        order.append(k)
        for s in succs[k]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(order) != len(graph.kernels):
        raise ValueError("graph has a cycle")
    return order


def random_assignment(graph: KernelGraph, ndev: int, rng: random.Random, runs: int = 8) -> list[int]:
    """A random placement made of ~``runs`` contiguous pieces per device,
    legal for state groups and indirect kernels (cuts only where allowed)."""
    n = len(graph.kernels)
    ok = legal_cuts(graph)
    legal = [i for i in range(1, n) if ok[i]]
    cuts = sorted(rng.sample(legal, min(len(legal), runs * ndev))) if legal else []
    bounds = [0] + cuts + [n]
    assignment = [0] * n
    for j in range(len(bounds) - 1):
        d = rng.randrange(ndev)
        for k in range(bounds[j], bounds[j + 1]):
            assignment[k] = d
    return assignment


def program_order_is_topological(graph: KernelGraph, order: Sequence[int]) -> bool:
    pos = {k: i for i, k in enumerate(order)}
    return all(pos[e.src] < pos[e.dst] for e in graph.edges)
