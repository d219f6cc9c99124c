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

Beyond four devices, identical devices are planned as one type
(:mod:`.symmetry`): the MILP over types with their multiplicities, every
repeated layer one pattern, then expanded into stretches of layers per
device; ``meta["solver"]`` then holds the expansion's objective on every
device against the type-level lower bound (``device_types`` says how many
types were planned).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan, PlanError, build_plan
from tessera_actors.planning.baselines import candidate_assignments
from tessera_actors.planning.coarsen import build_problem
from tessera_actors.planning.costs import CostTable, Roofline
from tessera_actors.planning.inflight import annotate, choose_inflight, default_inflight, fits, memory_inflight
from tessera_actors.planning.milp import Solution, objective_of, solve_or_explain
from tessera_actors.planning.simulate import Prediction, simulate
from tessera_actors.planning.symmetry import device_types, expand, type_table


@dataclass
class PlannerConfig:
    """Knobs of the MILP planner; ``None`` means chosen from the device count."""

    time_limit_s: float | None = None    # default 4.5 s for <= 4 devices, 45 s beyond
    mip_rel_gap: float = 0.01
    max_units: int = 300
    tie_layers: bool = True
    tie_blocks: int | None = None        # default: planner.tie_blocks(devices)
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


class MilpPlanner:
    """Latency and throughput plans from the MILP (see module docstring).

    ``costs`` is the cost table of the graph on the devices passed to
    :meth:`plan` (same order); without one, the :class:`~.costs.Roofline` estimate is used.
    """

    def __init__(self, costs: CostTable | None = None, config: PlannerConfig | None = None) -> None:
        self.costs = costs
        self.config = config or PlannerConfig()

    def _costs(self, graph: KernelGraph, devices: Sequence[str]) -> CostTable:
        costs = self.costs or Roofline().table(graph, devices)
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
        # beyond four devices identical ones are planned as one type (symmetry.py)
        types = device_types(costs) if ndev > 4 else [[d] for d in range(ndev)]
        table = type_table(costs, types) if len(types) < ndev else costs
        prob = build_problem(graph, table, cfg.max_units, cfg.tie_layers,
                             cfg.tie_blocks or tie_blocks(ndev, table is not costs))
        limit = cfg.time_limit_s or (4.5 if ndev <= 4 else 45.0)
        max_inflight = cfg.max_inflight or default_inflight(ndev)
        thr = mode == "throughput"

        seen: dict[tuple[int, ...], tuple[Prediction, float]] = {}

        def evaluate(p: Plan) -> tuple[Prediction, float]:
            # depths and baselines may give the same assignment: simulated once
            key = tuple(p.assignment)
            if key not in seen:
                if thr:
                    pred = choose_inflight(p, costs, memory_inflight(graph, p, costs, max_inflight))
                else:
                    pred = simulate(p, costs, inflight=1)
                seen[key] = (pred, pred.throughput if thr else -pred.step_s)
            return seen[key]

        # The MILP's pipeline-depth row (T >= latency / depth) is optimistic
        # against the simulated priority schedule, so on two devices, where
        # solves take milliseconds, shallower depths are solved too and the
        # simulation picks.
        depths = sorted({2, max(max_inflight // 2, 1), max_inflight}) if thr and ndev <= 2 else [max_inflight]
        best = best_pred = sol = None
        best_score, solve_total = -float("inf"), 0.0
        for depth in depths:
            with _progress(cfg.progress, limit, f"MILP {prob.ncls} classes x {len(types)} device types"):
                s = solve_or_explain(prob, table, mode, time_limit_s=limit, mip_rel_gap=cfg.mip_rel_gap,
                                     inflight=depth, verbose=cfg.solver_log, mult=[len(t) for t in types])
            kernels = prob.assignment(s.class_device)
            if table is not costs:
                kernels, s = _expand(graph, costs, types, kernels, mode, depth, s)
            p = build_plan(graph, devices, kernels, name=f"tessera-{mode}", mode=mode)
            pred, score = evaluate(p)
            solve_total += s.solve_s
            if score > best_score:
                best, best_pred, best_score, sol = p, pred, score, s
                sol_depth = depth
        source = "milp"
        if cfg.fallback:
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
                       "solve_total_s": solve_total, "device_types": len(types), **prob.stats},
            "plan_s": time.perf_counter() - t0,
            "costs": costs.source,
        })
        return best


def tie_blocks(ndev: int, by_type: bool = False) -> int:
    """Runs of repeated layers that get a placement pattern of their own:
    one per device on two devices; on more, four per device (at most 16), so
    a pipeline's stages can end between any two of them.  Planned by device
    type (``by_type``), every repeated layer gets the one pattern: the
    expansion cuts the program into stretches of layers, one per device of
    a type, and equal layers make equal stretches balance every type."""
    if by_type:
        return 1
    return ndev if ndev <= 2 else min(4 * ndev, 16)


def _expand(graph: KernelGraph, costs: CostTable, types: list[list[int]], kernel_type: list[int], mode: str,
            inflight: int, s: Solution) -> tuple[list[int], Solution]:
    """The type-level MILP solution ``s`` expanded to devices
    (:func:`.symmetry.expand`), and its solution: the MILP objective of the
    expansion over untied kernels on every device, against the type-level
    lower bound (a lower bound of the per-device problem over the same
    classes)."""
    kernels = expand(graph, costs, types, kernel_type)
    untied = build_problem(graph, costs, max_units=len(graph.kernels), tie_layers=False)
    lead: dict[int, int] = {}
    for (a, _), c in zip(untied.runs, untied.run_class):
        lead.setdefault(c, a)
    val = objective_of(untied, costs, [kernels[lead[c]] for c in range(untied.ncls)], mode, inflight)
    gap = max(val - s.bound_s, 0.0) / val if val else 0.0
    return kernels, dataclasses.replace(s, class_device=[], objective_s=val, gap=gap)
