"""The MILP planner: a :class:`~tessera_actors.plan.Planner` that returns
the latency or the throughput plan of a graph on a set of devices.

Contract of :meth:`MilpPlanner.plan`: the returned plan is legal (state
groups and indirect neighbourhoods kept, every device within its memory
budget), has ``predicted_step_s`` (one micro-batch alone) and
``microbatches`` set from the simulation, and ``meta`` holding
``solver`` (objective, dual bound, ``mip_gap``, status, solve seconds,
problem size), ``predicted`` (step_s, throughput, item_latency_s, busy) and
``source`` (``milp`` or the baseline it fell back to).  Micro-batches in
flight (throughput plan) are chosen by simulation up to
``PlannerConfig.max_inflight`` and as far as every device's budget holds
one copy of everything but the weights (state, temporaries, inputs,
outputs) per micro-batch, as the pipelined runtime allocates them; the
MILP's memory rows count one micro-batch.  Because the MILP
works on a coarsened, linearised model, the planner also simulates the
single-plan baselines that fit in memory (Homo on each device, layer split,
AF) and returns the best by the simulated objective (throughput, or step
time for the latency plan), so the result is never predicted worse than
them.  Raises :class:`PlanError` when no placement fits the memory budgets,
naming the shortfall in bytes.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan, PlanError, build_plan
from tessera_actors.planning.coarsen import build_problem
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.milp import solve_or_explain
from tessera_actors.planning.simulate import Prediction, simulate


@dataclass
class PlannerConfig:
    """Knobs of the MILP planner; ``None`` means chosen from the device count."""

    time_limit_s: float | None = None    # default 4.5 s for <= 4 devices, 45 s beyond
    mip_rel_gap: float = 0.01
    max_units: int = 300
    tie_layers: bool = True
    tie_blocks: int | None = None        # default: one per device, at most 8
    max_inflight: int | None = None      # micro-batches in flight at most; default max(8, 2 x devices) <= 32
    fallback: bool = True                # compare with the single-plan baselines
    progress: bool = False               # a tqdm bar (stderr) while the MILP solves
    solver_log: bool = False             # HiGHS log lines on stdout

    def __post_init__(self) -> None:
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            raise PlanError(f"time_limit_s must be positive, got {self.time_limit_s}")
        if not 0 <= self.mip_rel_gap < 1:
            raise PlanError(f"mip_rel_gap must be in [0, 1), got {self.mip_rel_gap}")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise PlanError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.max_units < 1:
            raise PlanError(f"max_units must be >= 1, got {self.max_units}")


@contextmanager
def _progress(enabled: bool, limit_s: float, desc: str) -> Iterator[None]:
    """A tqdm bar of elapsed seconds against the time limit, ticking from a
    thread while the (blocking) solve runs; nothing when disabled."""
    if not enabled:
        yield
        return
    from tqdm import tqdm
    stop = threading.Event()
    bar = tqdm(total=round(limit_s, 1), desc=desc, unit="s", leave=False,
               bar_format="{desc}: {n:.1f}/{total} s (time limit) {bar}")

    def tick() -> None:
        t0 = time.perf_counter()
        while not stop.wait(0.2):
            bar.n = min(round(time.perf_counter() - t0, 1), bar.total)
            bar.refresh()

    th = threading.Thread(target=tick, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()
        bar.close()


def default_inflight(ndev: int) -> int:
    """Micro-batches in flight the planner allows by default: enough for a
    pipeline through every device twice, at least 8, at most 32."""
    return min(max(8, 2 * ndev), 32)


def choose_inflight(plan: Plan, costs: CostTable, max_inflight: int, tol: float = 0.01) -> Prediction:
    """Simulate 1, 2, 4, ... micro-batches in flight (up to ``max_inflight``)
    and return the smallest count whose throughput is within ``tol`` of the
    next doubling (more in flight costs activation memory and latency)."""
    best = simulate(plan, costs, inflight=1)
    m = 2
    while m <= max_inflight:
        p = simulate(plan, costs, inflight=m)
        if p.throughput <= best.throughput * (1 + tol):
            break
        best = p
        m *= 2
    return best


# The pipelined runtime (tessera_actors/pipeline.py) gives every micro-batch
# its own activations, inputs, outputs and state (a separate request stream);
# only weights are shared.
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


class MilpPlanner:
    """Latency and throughput plans from the MILP (see module docstring).

    ``costs`` is the cost table of the graph on the devices passed to
    :meth:`plan` (same order); without one, :meth:`CostTable.estimate` is used.
    """

    def __init__(self, costs: CostTable | None = None, config: PlannerConfig | None = None) -> None:
        self.costs = costs
        self.config = config or PlannerConfig()

    def _costs(self, graph: KernelGraph, devices: Sequence[str]) -> CostTable:
        costs = self.costs or CostTable.estimate(graph, devices)
        if len(costs.devices) != len(devices):
            raise PlanError(f"cost table is for {len(costs.devices)} devices, asked to plan on {len(devices)}")
        costs.check_graph(graph)
        return costs

    def plan(self, graph: KernelGraph, devices: Sequence[str], mode: str = "latency") -> Plan:
        if mode not in ("latency", "throughput"):
            raise PlanError(f"unknown plan mode {mode!r} (expected 'latency' or 'throughput')")
        if not graph.kernels:
            raise PlanError("cannot plan an empty graph")
        cfg, costs = self.config, self._costs(graph, devices)
        ndev = len(devices)
        t0 = time.perf_counter()
        prob = build_problem(graph, costs, cfg.max_units, cfg.tie_layers,
                             cfg.tie_blocks or min(ndev, 8))
        limit = cfg.time_limit_s or (4.5 if ndev <= 4 else 45.0)
        max_inflight = cfg.max_inflight or default_inflight(ndev)
        thr = mode == "throughput"

        def evaluate(p: Plan) -> tuple[Prediction, float]:
            if thr:
                pred = choose_inflight(p, costs, memory_inflight(graph, p, costs, max_inflight))
            else:
                pred = simulate(p, costs, inflight=1)
            return pred, (pred.throughput if thr else -pred.step_s)

        # The MILP's pipeline-depth row (T >= latency / depth) is optimistic
        # against the simulated priority schedule, so on two devices, where
        # solves take milliseconds, shallower depths are solved too and the
        # simulation picks.
        depths = sorted({2, max(max_inflight // 2, 1), max_inflight}) if thr and ndev <= 2 else [max_inflight]
        best = best_pred = sol = None
        best_score, solve_total = -float("inf"), 0.0
        for depth in depths:
            with _progress(cfg.progress, limit, f"MILP {prob.ncls} classes x {ndev} devices"):
                s = solve_or_explain(prob, costs, mode, time_limit_s=limit, mip_rel_gap=cfg.mip_rel_gap,
                                     inflight=depth, verbose=cfg.solver_log)
            p = build_plan(graph, devices, prob.assignment(s.class_device), name=f"tessera-{mode}", mode=mode)
            pred, score = evaluate(p)
            solve_total += s.solve_s
            if score > best_score:
                best, best_pred, best_score, sol = p, pred, score, s
                sol_depth = depth
        source = "milp"
        if cfg.fallback:
            from tessera_actors.planning.baselines import candidate_assignments
            for name, cand in candidate_assignments(graph, costs):
                p = build_plan(graph, devices, cand, name=f"tessera-{mode}", mode=mode)
                if any(fits(graph, p, costs)):
                    continue
                pred, score = evaluate(p)
                better = score > best_score * (1 + 1e-9) if thr else score > best_score + 1e-12
                if better:
                    best, best_pred, best_score, source = p, pred, score, name
        annotate(best, best_pred, best_pred.inflight if thr else 1)
        best.meta.update({
            "source": source,
            "solver": {"objective_s": sol.objective_s, "bound_s": sol.bound_s, "mip_gap": sol.gap,
                       "status": sol.status, "solve_s": sol.solve_s, "variables": sol.nvars,
                       "rows": sol.nrows, "depth": sol_depth, "solves": len(depths),
                       "solve_total_s": solve_total, **prob.stats},
            "plan_s": time.perf_counter() - t0,
            "costs": costs.source,
        })
        return best


def plan_both(graph: KernelGraph, devices: Sequence[str], costs: CostTable | None = None,
              config: PlannerConfig | None = None) -> dict[str, Plan]:
    """The latency and the throughput plan, as the monitor switches between them."""
    planner = MilpPlanner(costs, config)
    return {m: planner.plan(graph, devices, m) for m in ("latency", "throughput")}
