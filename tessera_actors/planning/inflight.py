"""Micro-batches in flight: how many a plan runs at once and whether they
fit the memory budgets, shared by the MILP planner and the baselines.

Contract: with ``m`` micro-batches in flight every device holds its
weights once and one copy of everything else it touches (state,
temporaries, inputs, outputs) per micro-batch (:func:`fits`);
:func:`choose_inflight` picks ``m`` by simulation, :func:`annotate`
records a prediction on a plan, and :func:`prompt_inflight` is how many
prompt-chunk steps the serving engine keeps in flight on a plan (what
``tessera advise`` predicts it with).  Pure Python.
"""
from __future__ import annotations

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.simulate import Prediction, Simulation


def default_inflight(ndev: int) -> int:
    """Micro-batches in flight the planner allows by default: enough for a
    pipeline through every device twice, at least 8, at most 32."""
    return min(max(8, 2 * ndev), 32)


def prompt_inflight(plan: Plan) -> int:
    """Prompt-chunk steps the serving engine keeps in flight on ``plan``,
    and ``tessera advise`` predicts it with: the plan's micro-batches (at
    least 1), each a chunk of a different request, pipelined over the
    plan's devices (``AsyncEngine``'s prompt steps)."""
    return max(1, plan.microbatches)


def choose_inflight(plan: Plan, costs: CostTable, max_inflight: int, tol: float = 0.01) -> Prediction:
    """Simulate 1, 2, 4, ... micro-batches in flight (up to ``max_inflight``)
    and return the smallest count whose throughput is within ``tol`` of the
    next doubling (more in flight costs activation memory and latency)."""
    sim = Simulation(plan, costs)
    best = sim.predict(1)
    m = 2
    while m <= max_inflight:
        p = sim.predict(m)
        if p.throughput <= best.throughput * (1 + tol):
            break
        best = p
        m *= 2
    return best


# The pipelined runtime gives every micro-batch its own activations, inputs,
# outputs and state (a separate request stream); only weights are shared.
_SHARED_ROLES = ("weight",)


def fits(graph: KernelGraph, plan: Plan, costs: CostTable, inflight: int = 1) -> list[int]:
    """Bytes by which each device exceeds its budget under ``plan`` with
    ``inflight`` micro-batches in flight (0: fits).  Weights are held once;
    state, temporaries, inputs and outputs once per micro-batch."""
    out = []
    for d, bufs in enumerate(plan.resident):
        cap = costs.mem[d]
        if cap is None:
            out.append(0)
            continue
        once = sum(graph.buffers[b].nbytes for b in bufs if graph.buffers[b].role in _SHARED_ROLES)
        each = sum(graph.buffers[b].nbytes for b in bufs if graph.buffers[b].role not in _SHARED_ROLES)
        out.append(max(0, once + inflight * each - cap))
    return out


def memory_inflight(graph: KernelGraph, plan: Plan, costs: CostTable, limit: int) -> int:
    """The most micro-batches in flight (<= ``limit``, >= 1) whose per
    micro-batch buffers fit every device's budget."""
    m = max(limit, 1)
    while m > 1 and any(fits(graph, plan, costs, m)):
        m -= 1
    return m


def annotate(plan: Plan, pred: Prediction, microbatches: int | None = None) -> Plan:
    plan.microbatches = microbatches or pred.inflight
    plan.predicted_step_s = pred.step_s
    plan.meta["predicted"] = {"step_s": pred.step_s, "throughput": pred.throughput,
                              "item_latency_s": pred.item_latency_s, "busy": pred.busy,
                              "inflight": pred.inflight}
    return plan
