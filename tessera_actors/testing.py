"""Public helpers for testing graphs and plans (used by the test-suite and
by anyone checking a captured graph of their own), and the greedy token loop
that checks compare models, programs and deployments with."""
from __future__ import annotations

import inspect
import random
from typing import Any, Callable

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


async def greedy_decode(step: Callable[[dict], Any], prompt: Any, max_new: int, prefill: bool = False,
                        start: Any = 0) -> tuple[list, list]:
    """The greedy token loop: feed ``prompt``, then ``max_new`` times take
    the argmax of the last position's logits and feed it back as the next
    decode step (``T + max_new - 1`` steps for a prompt of ``T`` tokens).

    ``step(inputs)`` runs one step on ``{"input_ids": [B, T], "positions"}``
    and returns the logits ``[B, T, V]`` (or ``[B, V]``), a list of outputs
    whose first is the logits, or an awaitable of either.  ``prompt``: one
    row's ids (a list), or int64 ``[B, T]`` rows; ``start``: the position of
    the prompt's first token (an int, or int64 ``[B]``).  ``prefill`` feeds
    the prompt in one step (positions ``[B, T]``), else token by token
    (positions ``[B]``, as decode steps).  Returns the new tokens (a list,
    or a list per row) and the logits each was taken from (``[V]``, or
    ``[B, V]``).  Grad mode is the caller's."""
    import torch
    one = not isinstance(prompt, torch.Tensor)
    if one and not prompt:
        raise ValueError("empty prompt")
    ids = torch.tensor([list(prompt)], dtype=torch.int64) if one else prompt
    pos = torch.as_tensor(start, device=ids.device).reshape(-1).expand(ids.shape[0])

    async def run(inputs: dict) -> torch.Tensor:
        out = step(inputs)
        if inspect.isawaitable(out):
            out = await out
        logits = out[0] if isinstance(out, (list, tuple)) else out
        return logits.reshape(ids.shape[0], -1, logits.shape[-1])[:, -1]

    T = ids.shape[1]
    if prefill:
        last = await run({"input_ids": ids, "positions": pos[:, None] + torch.arange(T, device=ids.device)})
    else:
        for t in range(T):
            last = await run({"input_ids": ids[:, t:t + 1].clone(), "positions": pos + t})
    new, seen = [], []
    for n in range(max_new):
        seen.append(last.clone())
        new.append(last.argmax(-1, keepdim=True).to(ids.device))
        if n + 1 < max_new:
            last = await run({"input_ids": new[-1], "positions": pos + T + n})
    rows = torch.cat(new, 1).tolist() if new else [[] for _ in range(ids.shape[0])]
    return (rows[0], [s[0] for s in seen]) if one else (rows, seen)
