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
from dataclasses import dataclass, field
from typing import Sequence

from ..graph import KernelGraph
from ..plan import Plan, PlanError, build_plan
from .costs import CostTable
from .simulate import segment_times, simulate


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


def predict_mix(plans: Sequence[Plan], costs: CostTable) -> tuple[list[float], float]:
    """(rate of every slot, total executions per second) of ``plans``."""
    import numpy as np
    from scipy.optimize import linprog
    if not plans:
        raise PlanError("an empty mix")
    lat = [simulate(p, costs, inflight=1).step_s for p in plans]
    busy = np.array([device_busy(p, costs) for p in plans]).T      # device x slot
    bounds = [(0.0, 1.0 / t if t > 0 else None) for t in lat]
    res = linprog(-np.ones(len(plans)), A_ub=busy, b_ub=np.ones(busy.shape[0]), bounds=bounds, method="highs")
    if res.status != 0:
        raise PlanError(f"mix prediction failed: {res.message}")
    rates = [float(r) for r in res.x]
    return rates, sum(rates)


def mix_memory(graph: KernelGraph, plans: Sequence[Plan]) -> list[int]:
    """Bytes each device holds for a mix: weights once, the rest per slot."""
    out = []
    for d in range(len(plans[0].devices)):
        weights = {b for p in plans for b in p.resident[d] if graph.buffers[b].role == "weight"}
        rest = sum(graph.buffers[b].nbytes for p in plans for b in p.resident[d]
                   if graph.buffers[b].role != "weight")
        out.append(sum(graph.buffers[b].nbytes for b in weights) + rest)
    return out


def best_mix(graph: KernelGraph, devices: Sequence[str], costs: CostTable, kernel_plan: Plan | None = None,
             max_slots: int = 8) -> Mix:
    """The best mix of up to ``max_slots`` slots drawn from one-device plans
    (replicas) and ``kernel_plan`` (e.g. the MILP throughput plan)."""
    ndev = len(devices)
    choices: list[tuple[str, Plan]] = [(f"homo[{devices[d]}]", build_plan(graph, devices, [d] * len(graph.kernels),
                                                                        name=f"replica[{devices[d]}]"))
                                       for d in range(ndev)]
    if kernel_plan is not None:
        choices.append((kernel_plan.name, kernel_plan))
    per_choice = max_slots if len(choices) <= 3 else 2
    best: Mix | None = None
    for counts in itertools.product(range(per_choice + 1), repeat=len(choices)):
        total = sum(counts)
        if not 1 <= total <= max_slots:
            continue
        plans = [p for (_, p), c in zip(choices, counts) for _ in range(c)]
        held = mix_memory(graph, plans)
        if any(m is not None and h > m for h, m in zip(held, costs.mem)):
            continue
        rates, thr = predict_mix(plans, costs)
        # prefer fewer slots on ties (less memory, lower latency)
        if best is None or thr > best.throughput * (1 + 1e-9):
            label = " + ".join(f"{c}x {name}" for (name, _), c in zip(choices, counts) if c)
            best = Mix(plans, rates, thr, label, {"counts": list(counts), "held_bytes": held})
    if best is None:
        raise PlanError("no mix of up to %d slots fits the memory budgets" % max_slots)
    return best
