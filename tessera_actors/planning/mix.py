"""Mixes: a plan per micro-batch slot.

A single kernel-level plan pays for every cut edge; Request Distribution
pays for none but cannot move a kernel to the device that suits it.  A
*mix* gives each of the executor's micro-batch slots its own plan, so
Request Distribution is the mix of one-device plans, and kernel-level plans
mix with replicas.  ``best_mix`` searches slot counts and returns the mix
with the highest predicted throughput that fits the memory budgets.

Prediction: slots are independent request streams (they share weights and
devices, nothing else), so each runs at its own rate ``r_m``, at most once
per its own latency (its critical path, transfers included), and together
they may not keep any device busier than all the time:
``max sum r_m  s.t.  r_m <= 1 / latency_m,  sum_m r_m * busy_m[d] <= 1``.
A mix of one replica per device is then exactly Request Distribution.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan, PlanError, build_plan
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.simulate import segment_times, simulate


@dataclass
class Mix:
    plans: list[Plan]
    rates: list[float]     # predicted executions per second of every slot
    throughput: float      # their sum
    label: str = ""
    meta: dict = field(default_factory=dict)


def device_busy(plan: Plan, costs: CostTable) -> list[float]:
    """Compute seconds one execution of ``plan`` puts on each device."""
    busy = [0.0] * len(plan.devices)
    for s, t in zip(plan.segments, segment_times(plan, costs)):
        busy[s.device] += t
    return busy


def _slot_facts(plans: Sequence[Plan], costs: CostTable) -> tuple[list[float], list[list[float]]]:
    return ([simulate(p, costs, inflight=1).step_s for p in plans], [device_busy(p, costs) for p in plans])


def _rates(lat: Sequence[float], busy: Sequence[Sequence[float]]) -> tuple[list[float], float]:
    import numpy as np
    from scipy.optimize import linprog
    a = np.array(busy, dtype=float).T                                  # device x slot
    bounds = [(0.0, 1.0 / t if t > 0 else None) for t in lat]
    res = linprog(-np.ones(len(lat)), A_ub=a, b_ub=np.ones(a.shape[0]), bounds=bounds, method="highs")
    if res.status != 0:
        raise PlanError(f"mix prediction failed: {res.message}")
    rates = [float(r) for r in res.x]
    return rates, sum(rates)


def predict_mix(plans: Sequence[Plan], costs: CostTable) -> tuple[list[float], float]:
    """(rate of every slot, total executions per second) of ``plans``."""
    if not plans:
        raise PlanError("an empty mix")
    return _rates(*_slot_facts(plans, costs))


def mix_memory(graph: KernelGraph, plans: Sequence[Plan]) -> list[int]:
    """Bytes each device holds for a mix: weights once, the rest per slot."""
    out = []
    for d in range(len(plans[0].devices)):
        weights = {b for p in plans for b in p.resident[d] if graph.buffers[b].role == "weight"}
        rest = sum(graph.buffers[b].nbytes for p in plans for b in p.resident[d]
                   if graph.buffers[b].role != "weight")
        out.append(sum(graph.buffers[b].nbytes for b in weights) + rest)
    return out


def offload_family(graph: KernelGraph, devices: Sequence[str], costs: CostTable,
                   scales: Sequence[float] = (0.5, 0.75, 1.5, 2.0)) -> list[Plan]:
    """Kernel-level plans from mostly-on-one-device to mostly-on-another:
    throughput plans solved with one device's kernel times scaled, so the
    split moves.  Mixed with replicas, they let kernels run where they are
    relatively fast while every device stays busy."""
    from tessera_actors.planning.planner import MilpPlanner, PlannerConfig
    plans: list[Plan] = []
    seen: set[tuple[int, ...]] = set()
    for d in range(len(devices)):
        for a in scales:
            times = [[t * a if j == d else t for j, t in enumerate(row)] for row in costs.times]
            scaled = CostTable(list(costs.devices), times, costs.latency, costs.bandwidth, list(costs.mem), costs.source)
            try:
                p = MilpPlanner(scaled, PlannerConfig(fallback=False, max_inflight=2)).plan(graph, devices, "throughput")
            except PlanError:
                continue
            key = tuple(p.assignment)
            if len(set(key)) > 1 and key not in seen:
                seen.add(key)
                p.name = f"offload[{devices[d]} x{a:g}]"
                plans.append(p)
    return plans


def best_mix(graph: KernelGraph, devices: Sequence[str], costs: CostTable, kernel_plan: Plan | None = None,
             max_slots: int = 8, family: bool | None = None, score: str = "schedule",
             horizon: int = 12, extra: Sequence[Plan] = ()) -> Mix:
    """The best mix of up to ``max_slots`` slots drawn from one-device plans
    (replicas), ``kernel_plan`` (e.g. the MILP throughput plan) and, on up to
    four devices (``family``), the offload family.

    ``score="schedule"`` (default) rates a mix by the list schedule its
    slots would be queued in on shared device streams (``horizon`` steps per
    slot; see :mod:`.schedule`): a kernel-level plan's many hops wait in the
    device queues there, which the rate LP ignores.  A local search (add,
    drop or swap one slot) starts from Request Distribution.  ``"lp"``: an
    LP over all candidates picks the two most useful kernel-level plans and
    slot counts are searched exactly under the rate LP (an upper bound).
    ``extra``: more kernel-level candidates (e.g. the AF and layer-split
    plans)."""
    if score not in ("schedule", "lp"):
        raise ValueError(f"score must be 'schedule' or 'lp', not {score!r}")
    ndev = len(devices)
    replicas = [build_plan(graph, devices, [d] * len(graph.kernels), name=f"homo[{devices[d]}]")
                for d in range(ndev)]
    kernel_level = [kernel_plan] if kernel_plan is not None else []
    kernel_level += [p for p in extra if len(set(p.assignment)) > 1]
    if family if family is not None else ndev <= 4:
        kernel_level += offload_family(graph, devices, costs)

    def fits(plans: Sequence[Plan]) -> bool:
        return all(m is None or h <= m for h, m in zip(mix_memory(graph, plans), costs.mem))
    replicas = [p for p in replicas if fits([p])]
    kernel_level = [p for p in kernel_level if fits([p])]
    if score == "schedule":
        return _search_schedule(graph, costs, replicas, kernel_level, max_slots, horizon)
    if len(kernel_level) > 2:
        import numpy as np
        from scipy.optimize import linprog
        lat, busy = _slot_facts(kernel_level + replicas, costs)
        a = np.vstack([np.array(busy, dtype=float).T, np.array(lat, dtype=float)[None, :]])
        b = np.r_[np.ones(ndev), float(max_slots)]
        res = linprog(-np.ones(len(lat)), A_ub=a, b_ub=b, bounds=[(0, None)] * len(lat), method="highs")
        weight = res.x[: len(kernel_level)] if res.status == 0 else np.zeros(len(kernel_level))
        order = sorted(range(len(kernel_level)), key=lambda j: -weight[j])
        kernel_level = [kernel_level[j] for j in order[:2]]
    choices = replicas + kernel_level
    if not choices:
        raise PlanError("no mix of up to %d slots fits the memory budgets" % max_slots)
    lat, busy = _slot_facts(choices, costs)
    best: Mix | None = None
    for counts in itertools.product(range(max_slots + 1), repeat=len(choices)):
        if not 1 <= sum(counts) <= max_slots:
            continue
        idx = [j for j, c in enumerate(counts) for _ in range(c)]
        plans = [choices[j] for j in idx]
        held = mix_memory(graph, plans)
        if any(m is not None and h > m for h, m in zip(held, costs.mem)):
            continue
        rates, thr = _rates([lat[j] for j in idx], [busy[j] for j in idx])
        if best is None or thr > best.throughput * (1 + 1e-9):   # ties: fewer slots
            label = " + ".join(f"{c}x {p.name}" for p, c in zip(choices, counts) if c)
            best = Mix(plans, rates, thr, label, {"counts": list(counts), "held_bytes": held,
                                                  "choices": [p.name for p in choices]})
    if best is None:
        raise PlanError("no mix of up to %d slots fits the memory budgets" % max_slots)
    return best


def _search_schedule(graph: KernelGraph, costs: CostTable, replicas: list[Plan], kernel_level: list[Plan],
                     max_slots: int, horizon: int, keep: int = 4) -> Mix:
    from tessera_actors.plan import split_long_segments
    from tessera_actors.planning.schedule import list_schedule
    # A replica is one long segment: on a stream its device shares, it would
    # hold up every kernel-level slot's short hop queued behind it; cut it
    # into pieces of a tenth of the fastest replica's step.
    if replicas:
        quantum = min(sum(costs.times[k][p.segments[0].device] for k in range(len(graph.kernels)))
                      for p in replicas) / 10
        replicas = [split_long_segments(graph, p, costs.times, quantum) for p in replicas]

    def mix_value(plans: list[Plan]) -> float:
        if not plans or any(m is not None and h > m for h, m in zip(mix_memory(graph, plans), costs.mem)):
            return -1.0
        return list_schedule(plans, costs, total_steps=horizon * len(plans)).throughput
    if len(kernel_level) > keep:   # keep the plans that do most for the replicas, k slots of each
        score_of = {id(p): max(mix_value(replicas + [p] * k) for k in range(1, min(4, max_slots) + 1))
                    for p in kernel_level}
        kernel_level = sorted(kernel_level, key=lambda p: -score_of[id(p)])[:keep]
    choices = replicas + kernel_level
    if not choices:
        raise PlanError("no mix of up to %d slots fits the memory budgets" % max_slots)
    seen: dict[tuple[int, ...], float] = {}

    def value(counts: tuple[int, ...]) -> float:
        if counts in seen:
            return seen[counts]
        seen[counts] = mix_value([choices[j] for j, c in enumerate(counts) for _ in range(c)])
        return seen[counts]
    n = len(choices)
    # every count vector of up to max_slots slots when there are few enough
    # (else Request Distribution and k slots of one plan), then add / drop /
    # swap moves from the best
    if math.comb(max_slots + n, n) <= 5000:
        for counts in _count_vectors(n, max_slots):
            value(counts)
    else:
        if replicas:
            value(tuple(1 if j < len(replicas) else 0 for j in range(n)))
        for j in range(n):
            for k in range(1, max_slots + 1):
                value(tuple(k if i == j else 0 for i in range(n)))
    best = max(seen, key=seen.get)
    while True:
        moves = []
        for j in range(n):
            if sum(best) < max_slots:
                moves.append(tuple(c + (i == j) for i, c in enumerate(best)))
            if best[j] and sum(best) > 1:
                moves.append(tuple(c - (i == j) for i, c in enumerate(best)))
                moves += [tuple(c - (i == j) + (i == k) for i, c in enumerate(best)) for k in range(n) if k != j]
        top = max(moves, key=value, default=best)
        if value(top) <= value(best) * (1 + 1e-6):
            break
        best = top
    if value(best) < 0:
        raise PlanError("no mix of up to %d slots fits the memory budgets" % max_slots)
    plans = [choices[j] for j, c in enumerate(best) for _ in range(c)]
    sched = list_schedule(plans, costs, total_steps=horizon * len(plans))
    rates = [k / sched.makespan_s for k in sched.steps]
    label = " + ".join(f"{c}x {p.name}" for p, c in zip(choices, best) if c)
    return Mix(plans, rates, sched.throughput, label,
               {"counts": list(best), "held_bytes": mix_memory(graph, plans), "choices": [p.name for p in choices],
                "score": "schedule", "schedule": sched, "mixes_scored": len(seen)})


def _count_vectors(n: int, most: int):
    """Every tuple of ``n`` counts >= 0 with a sum from 1 to ``most``."""
    def rec(i: int, left: int):
        if i == n:
            yield ()
            return
        for c in range(left + 1):
            for rest in rec(i + 1, left - c):
                yield (c,) + rest
    return (v for v in rec(0, most) if sum(v))
