"""Memory-aware MILP placement with scipy's HiGHS (``scipy.optimize.milp``).

Variables (over the classes of :mod:`.coarsen`): ``x[c,d]`` binary, class
``c`` on device ``d``; for every communication group ``g`` (a producer
class and its consumer classes) ``r[g,d] >= x[v,d] - x[p,d]`` ("``d``
receives g's bytes") and, for the throughput plan, ``s[g,d] >= x[p,d] -
x[v,d]`` ("``d`` sends them"); for every buffer shared by several classes
and every memory-limited device ``y[m,d] >= x[c,d]`` ("``d`` holds it").

*Throughput plan* (communication overlapped by pipelining): minimise ``T``
with, per device, compute ``sum_c cost[c,d] x[c,d] <= T``, egress
``sum_g out_d(g) s[g,d] <= T`` and ingress ``sum_g in_d(g) r[g,d] <= T``
(compute and each link direction are separate resources, as in the
simulator), and ``latency / inflight <= T`` (with ``inflight`` micro-batches
in flight a pipeline delivers at most inflight / latency, latency as in the
latency plan below); ``out_d(g) = count_g * latency + bytes_g / bandwidth`` using
the mean over ``d``'s links (exact for two devices).  A 1e-3 weight on
total communication breaks ties towards fewer transfers.  Identical devices
get ordered loads (symmetry breaking).

*Latency plan*: minimise ``sum cost[c,d] x[c,d] + sum_g in_d(g) r[g,d]``:
the step time when kernels run one after another and every cut edge's
transfer adds to the path.  This is exact for chains (a forward pass is
one, up to residual branches) and an upper bound otherwise; it has no
big-M terms, so it solves like a min-cut.

*Memory* (both plans), per device with a budget: ``sum_c mem[c] x[c,d] +
sum_m bytes_m y[m,d] <= cap_d``: every buffer a device touches is held there
once (weights only where used, state with its kernels, each temporary slot
once, received buffers on the receiver) - exactly :meth:`Plan.resident_bytes`,
for one micro-batch (the planner then limits micro-batches in flight to what
the budgets hold, see planner.fits).

An infeasible budget is re-solved with a slack per device; the
:class:`PlanError` names the smallest total shortfall and its split.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from tessera_actors.plan import PlanError
from tessera_actors.planning.coarsen import Problem
from tessera_actors.planning.costs import CostTable

_US = 1e6          # seconds -> microseconds (keeps HiGHS numerics sane)


@dataclass
class Solution:
    class_device: list[int]
    objective_s: float        # the model's objective (bottleneck or path), seconds
    bound_s: float            # dual bound, seconds
    gap: float                # HiGHS mip_gap (relative)
    status: str               # "optimal" | "time_limit"
    solve_s: float
    nvars: int
    nrows: int


class _Rows:
    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []

    def add(self, cols, vals, lb: float, ub: float) -> None:
        row = len(self.lb)
        self.r.extend([row] * len(cols))
        self.c.extend(cols)
        self.v.extend(vals)
        self.lb.append(lb)
        self.ub.append(ub)

    def constraint(self, nvars: int) -> LinearConstraint:
        a = coo_matrix((self.v, (self.r, self.c)), shape=(len(self.lb), nvars)).tocsr()
        return LinearConstraint(a, np.asarray(self.lb), np.asarray(self.ub))


def _link_costs(costs: CostTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per device: mean latency (s) and mean seconds/byte out of and into it."""
    n = costs.ndev
    lat_o, spb_o, lat_i, spb_i = (np.zeros(n) for _ in range(4))
    for d in range(n):
        others = [e for e in range(n) if e != d] or [d]
        lat_o[d] = np.mean([costs.latency[d][e] for e in others])
        spb_o[d] = np.mean([1.0 / costs.bandwidth[d][e] for e in others])
        lat_i[d] = np.mean([costs.latency[e][d] for e in others])
        spb_i[d] = np.mean([1.0 / costs.bandwidth[e][d] for e in others])
    return lat_o, spb_o, lat_i, spb_i


def _identical_pairs(costs: CostTable, prob: Problem) -> list[tuple[int, int]]:
    pairs = []
    for d in range(costs.ndev - 1):
        e = d + 1
        if (np.array_equal(prob.cost[:, d], prob.cost[:, e]) and costs.mem[d] == costs.mem[e]
                and costs.latency[d][e] == costs.latency[e][d]
                and all(costs.latency[d][f] == costs.latency[e][f] and costs.bandwidth[d][f] == costs.bandwidth[e][f]
                        for f in range(costs.ndev) if f not in (d, e))):
            pairs.append((d, e))
    return pairs


def solve(prob: Problem, costs: CostTable, mode: str, *, time_limit_s: float = 30.0,
          mip_rel_gap: float = 0.005, inflight: int = 8, slack: bool = False,
          verbose: bool = False) -> Solution:
    """Solve the placement MILP (see module docstring). With ``slack`` the
    memory rows get a per-device slack variable and the objective is the
    total slack (used to explain infeasibility); ``Solution.objective_s``
    then holds bytes."""
    if mode not in ("latency", "throughput"):
        raise PlanError(f"unknown plan mode {mode!r} (expected 'latency' or 'throughput')")
    C, D, G = prob.ncls, prob.ndev, len(prob.comm)
    thr = mode == "throughput"
    capped = [d for d in range(D) if costs.mem[d] is not None]
    ix = lambda c, d: c * D + d  # noqa: E731
    nx = C * D
    t_col = nx
    base_s = nx + (1 if thr else 0)
    base_r = base_s + (G * D if thr else 0)
    base_y = base_r + G * D
    M = len(prob.mem_groups)
    ycol = {d: j for j, d in enumerate(capped)}
    base_sl = base_y + M * len(capped)
    nvars = base_sl + (len(capped) if slack else 0)

    lat_o, spb_o, lat_i, spb_i = _link_costs(costs)
    out_c = np.array([[g.count * lat_o[d] + g.nbytes * spb_o[d] for d in range(D)] for g in prob.comm]).reshape(G, D) * _US
    in_c = np.array([[g.count * lat_i[d] + g.nbytes * spb_i[d] for d in range(D)] for g in prob.comm]).reshape(G, D) * _US
    cost = prob.cost * _US

    obj = np.zeros(nvars)
    slack_scale = 1.0
    rows = _Rows()
    for c in range(C):
        rows.add([ix(c, d) for d in range(D)], [1.0] * D, 1.0, 1.0)
    for gi, g in enumerate(prob.comm):
        for v in g.consumers:
            for d in range(D):
                # r[g,d] - x[v,d] + x[p,d] >= 0
                rows.add([base_r + gi * D + d, ix(v, d), ix(g.producer, d)], [1.0, -1.0, 1.0], 0.0, np.inf)
                if thr:
                    rows.add([base_s + gi * D + d, ix(g.producer, d), ix(v, d)], [1.0, -1.0, 1.0], 0.0, np.inf)
    if thr:
        obj[t_col] = 1.0
        for d in range(D):
            rows.add([ix(c, d) for c in range(C)] + [t_col], list(cost[:, d]) + [-1.0], -np.inf, 0.0)
            if G:
                rows.add([base_s + gi * D + d for gi in range(G)] + [t_col], list(out_c[:, d]) + [-1.0], -np.inf, 0.0)
                rows.add([base_r + gi * D + d for gi in range(G)] + [t_col], list(in_c[:, d]) + [-1.0], -np.inf, 0.0)
        for gi in range(G):
            for d in range(D):
                obj[base_s + gi * D + d] = 1e-3 * out_c[gi, d]
                obj[base_r + gi * D + d] = 1e-3 * in_c[gi, d]
        # Pipeline depth: with ``inflight`` micro-batches in flight the
        # throughput is at most inflight / latency, so T >= latency / inflight
        # (latency as in the latency plan: serial compute plus transfers).
        lat_cols = [ix(c, d) for c in range(C) for d in range(D)] + \
            [base_r + gi * D + d for gi in range(G) for d in range(D)]
        lat_vals = [cost[c, d] / inflight for c in range(C) for d in range(D)] + \
            [in_c[gi, d] / inflight for gi in range(G) for d in range(D)]
        rows.add(lat_cols + [t_col], lat_vals + [-1.0], -np.inf, 0.0)
        for d, e in _identical_pairs(costs, prob):
            w = cost[:, d]
            rows.add([ix(c, d) for c in range(C)] + [ix(c, e) for c in range(C)], list(w) + list(-w), 0.0, np.inf)
    else:
        for c in range(C):
            for d in range(D):
                obj[ix(c, d)] = cost[c, d]
        for gi in range(G):
            for d in range(D):
                obj[base_r + gi * D + d] = in_c[gi, d]
    for m, grp in enumerate(prob.mem_groups):
        for d in capped:
            for c in grp.classes:
                rows.add([base_y + m * len(capped) + ycol[d], ix(c, d)], [1.0, -1.0], 0.0, np.inf)
    for d in capped:
        cols = [ix(c, d) for c in range(C)] + [base_y + m * len(capped) + ycol[d] for m in range(M)]
        # Each memory row is scaled by its budget (right-hand side 1), so
        # kilobyte and terabyte budgets are equally well conditioned.
        cap = max(float(costs.mem[d]), 1.0)
        vals = list(prob.class_mem / cap) + [g.nbytes / cap for g in prob.mem_groups]
        if slack:
            cols.append(base_sl + ycol[d])
            vals.append(-1.0)
            obj[base_sl + ycol[d]] = cap
        rows.add(cols, vals, -np.inf, 1.0)
    if slack:
        keep = obj[base_sl:].copy()
        obj[:] = 0.0
        obj[base_sl:] = keep / max(keep.max(), 1.0)   # minimise total bytes short
        slack_scale = max(keep.max(), 1.0)
    integrality = np.zeros(nvars)
    integrality[:nx] = 1
    lb, ub = np.zeros(nvars), np.ones(nvars)
    ub[nx:base_s] = np.inf   # T
    ub[base_sl:] = np.inf    # slacks
    t0 = time.perf_counter()
    res = milp(obj, integrality=integrality, bounds=Bounds(lb, ub), constraints=rows.constraint(nvars),
               options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": verbose})
    dt = time.perf_counter() - t0
    if res.status == 2 or res.x is None:
        if res.status in (1,) and res.x is None:
            raise PlanError(f"MILP found no placement within {time_limit_s:g} s ({C} classes x {D} devices)")
        raise _Infeasible(res.message)
    if res.status not in (0, 1):
        raise PlanError(f"MILP solver failed: {res.message}")
    xs = res.x[:nx].reshape(C, D)
    class_device = [int(np.argmax(xs[c])) for c in range(C)]
    scale = slack_scale if slack else 1 / _US
    return Solution(class_device, float(res.fun) * scale,
                    float(res.mip_dual_bound if res.mip_dual_bound is not None else res.fun) * scale,
                    float(res.mip_gap or 0.0), "optimal" if res.status == 0 else "time_limit",
                    dt, nvars, len(rows.lb))


class _Infeasible(Exception):
    pass


def memory_shortfall(prob: Problem, costs: CostTable) -> PlanError:
    """The :class:`PlanError` explaining an infeasible memory budget: the
    least total number of bytes missing and, for that placement, how many
    bytes each device is short."""
    caps = costs.mem
    total = float(prob.class_mem.sum() + sum(g.nbytes for g in prob.mem_groups))
    if all(c is not None for c in caps) and total > sum(caps):
        short = total - sum(caps)
        return PlanError(f"the model needs at least {total:.0f} bytes but the devices hold "
                         f"{sum(caps):.0f} together: short by {short:.0f} bytes")
    sol = solve(prob, costs, "latency", slack=True, time_limit_s=20.0)
    # Recompute per-device need for the slack solution.
    need = _resident_per_device(prob, sol.class_device, costs.ndev)
    parts = [f"{costs.devices[d]} needs {need[d]:.0f} of {caps[d]} bytes (short by {need[d] - caps[d]:.0f})"
             for d in range(costs.ndev) if caps[d] is not None and need[d] > caps[d]]
    return PlanError(f"memory budgets too small: short by {sol.objective_s:.0f} bytes in total; "
                     f"best placement: " + "; ".join(parts))


def _resident_per_device(prob: Problem, class_device: list[int], ndev: int) -> list[float]:
    need = [0.0] * ndev
    for c, d in enumerate(class_device):
        need[d] += prob.class_mem[c]
    for g in prob.mem_groups:
        for d in {class_device[c] for c in g.classes}:
            need[d] += g.nbytes
    return need


def solve_or_explain(prob: Problem, costs: CostTable, mode: str, **kw) -> Solution:
    """:func:`solve`, turning infeasibility into a :class:`PlanError` with the
    memory shortfall."""
    try:
        return solve(prob, costs, mode, **kw)
    except _Infeasible:
        raise memory_shortfall(prob, costs) from None
