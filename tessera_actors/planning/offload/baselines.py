"""Baselines of offload planning, from the same rates and the same step
model as :func:`~tessera_actors.planning.offload.choose.choose_homes`: GPU-only (None
when it does not fit), layer offload (the first N layers resident, the rest
on the CPU, as llama.cpp ``-ngl``), weight streaming (every non-resident
weight over PCIe per step, as accelerate / FlexGen), expert offload (a
mixture of experts' routed experts on the CPU, the rest resident: llama.cpp
and KTransformers ``-ot exps=CPU``) and :func:`ideal`, a
relaxed bound (fractional residency and CPU/PCIe split, no staging, no
links, no slot limits).  Pure Python."""
from __future__ import annotations

import re
from typing import Sequence

from tessera_actors.planning.offload.model import Offload, Placement, StepTime, fastest


def gpu_only(o: Offload) -> tuple[Placement, StepTime] | None:
    p = o.placement({u: "R" for u in o.units}, 0)
    return (p, o.simulate(p)) if o.gpu_bytes(p) <= o.budget else None


def layer_offload(o: Offload) -> tuple[Placement, StepTime] | None:
    """The first N layers resident (N as large as fits), every other heavy
    unit on the CPU (llama.cpp ``-ngl N``)."""
    layer = {u: min(o.graph.kernels[k].layer for k in ks) for u, ks in o.kernels.items()}
    layers = sorted({l for l in layer.values() if l >= 0})
    best = None
    for n in range(len(layers) + 1):
        keep = set(layers[:n])
        choice = {u: "R" if layer[u] in keep else "C" for u in o.units}
        p = o.placement(choice, 0)
        if o.gpu_bytes(p) > o.budget:
            break
        best = (p, o.simulate(p))
    return best


# a routed expert's weights (``layers.3.experts.gate_up``; not the router, which every token runs)
ROUTED_EXPERT = re.compile(r"(^|\.)experts\.(?!router\b)")


def routed_experts(o: Offload) -> set[int]:
    """The heavy units whose weights are a mixture of experts' routed experts."""
    return {u for u, bs in o.units.items() if any(ROUTED_EXPERT.search(o.graph.buffers[b].name or "") for b in bs)}


def expert_offload(o: Offload) -> tuple[Placement, StepTime] | None:
    """Every routed expert on the CPU, every other heavy unit (attention,
    router, embeddings, head) resident; None for a model without routed
    experts or when the rest does not fit the budget."""
    experts = routed_experts(o)
    if not experts:
        return None
    p = o.placement({u: "C" if u in experts else "R" for u in o.units}, 0)
    return (p, o.simulate(p)) if o.gpu_bytes(p) <= o.budget else None


def streaming(o: Offload, slot_options: Sequence[int] = (2, 3, 4, 6, 8)) -> tuple[Placement, StepTime] | None:
    """Residents as Tessera picks them, every other weight streamed per step
    (what cannot be streamed runs on the CPU)."""
    def run(slots: int, limit: int):
        def choose(resident: set[int]) -> dict[int, str]:
            return {u: "R" if u in resident else ("S" if u in o.streamable and o.size[u] <= limit else "C")
                    for u in o.units}
        # weights too big for a slot are made resident first
        order = sorted(o.units, key=lambda u: (o.size[u] <= limit or u not in o.streamable, u))
        return o.fit(choose, slots, slots * limit, order)
    sizes = sorted({o.size[u] for u in o.streamable}, reverse=True)[:3] or [0]
    return fastest(run(s, b) for s in slot_options for b in sizes)


def ideal(o: Offload) -> float:
    """Relaxed bound on the step time: a unit faster on the CPU runs there;
    the others fill the budget left by the KV cache, activations and light
    weights fractionally (no staging) by time saved per
    byte, and the rest is split fractionally between CPU and streaming so
    that ``max(gpu + cpu compute, pcie)`` is least; light kernels on their
    faster device; no links, no slots."""
    gpu, cpu = o.gpu, o.cpu
    inf = float("inf")
    a = sum(min(o.costs.times[k]) for k in range(len(o.graph.kernels)) if k not in o.unit_of)
    # the GPU holds the KV cache, activations and light weights of a plan that streams every unit
    cap = float(o.budget - o.gpu_bytes(Placement([gpu] * len(o.graph.kernels),
                                                 sorted(b for bs in o.units.values() for b in bs), 0, 0)))
    rows = []
    for u in o.units:
        g, c, s = o.t(u, gpu), o.t(u, cpu), (o.stream_s(u) if u in o.streamable else inf)
        if c <= g:
            a += c
        else:
            rows.append((g, c, s, o.size[u]))
    rows.sort(key=lambda r: -(min(r[1], max(r[0], r[2])) - r[0]) / max(r[3], 1))
    rest = []
    for g, c, s, nb in rows:
        f = min(1.0, max(cap, 0.0) / max(nb, 1))
        cap -= f * nb
        a += f * g
        if f < 1.0:
            if s == inf:
                a += c * (1 - f)
            else:
                rest.append((g * (1 - f), c * (1 - f), s * (1 - f)))
    a += sum(g for g, _, _ in rest)   # everything streamed, then moved to the cpu by ratio
    p = sum(s for _, _, s in rest)
    for g, c, s in sorted(rest, key=lambda r: r[1] / max(r[2], 1e-15)):
        if a >= p:
            break
        if a + (c - g) >= p - s:
            return a + (p - a) / (c - g + s) * (c - g)
        a += c - g
        p -= s
    return max(a, p)
