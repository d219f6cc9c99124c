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
from typing import Sequence

import numpy as np
from scipy.optimize import Bounds, milp

from tessera_actors.plan import PlanError
from tessera_actors.planning.coarsen import Problem
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.rounding import Objective, round_relaxation
from tessera_actors.planning.sparse import SparseRows

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


def _columns(prob: Problem, costs: CostTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Class times and every group's egress and ingress cost per device, in
    microseconds (the MILP's units)."""
    lat_o, spb_o, lat_i, spb_i = _link_costs(costs)
    count = np.array([g.count for g in prob.comm], dtype=float)[:, None]
    nbytes = np.array([g.nbytes for g in prob.comm], dtype=float)[:, None]
    out_c = count * lat_o[None, :] + nbytes * spb_o[None, :]
    in_c = count * lat_i[None, :] + nbytes * spb_i[None, :]
    return prob.cost * _US, out_c * _US, in_c * _US


def objective_of(prob: Problem, costs: CostTable, class_device: Sequence[int], mode: str,
                 inflight: int) -> float:
    """The MILP's objective (seconds) of a class -> device choice, memory aside."""
    cost, out_c, in_c = _columns(prob, costs)
    obj = Objective(prob, cost, out_c, in_c, np.ones(prob.ndev), [None] * prob.ndev, mode == "throughput", inflight)
    return obj.value(np.asarray(class_device, dtype=np.int64))[1] / _US


@dataclass
class _Model:
    """The MILP's arrays (see the module docstring) and the column layout."""

    obj: np.ndarray
    rows: SparseRows
    nx: int                      # x columns come first, class-major
    ub: np.ndarray
    scale: float                 # objective -> seconds (or bytes with slack)
    cost: np.ndarray             # [class, device] x 1e6
    out_c: np.ndarray
    in_c: np.ndarray


def _build(prob: Problem, costs: CostTable, mode: str, inflight: int, slack: bool,
           mult: np.ndarray) -> _Model:
    """Rows and objective of the placement MILP; ``mult[d]`` identical devices
    stand behind column ``d`` (their time, links and budget scale by it)."""
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
    base_sl = base_y + M * len(capped)
    nvars = base_sl + (len(capped) if slack else 0)

    cost, out_c, in_c = _columns(prob, costs)

    obj = np.zeros(nvars)
    scale = 1 / _US
    rows = SparseRows()
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
            rows.add([ix(c, d) for c in range(C)] + [t_col], list(cost[:, d]) + [-mult[d]], -np.inf, 0.0)
            if G:
                rows.add([base_s + gi * D + d for gi in range(G)] + [t_col], list(out_c[:, d]) + [-mult[d]],
                         -np.inf, 0.0)
                rows.add([base_r + gi * D + d for gi in range(G)] + [t_col], list(in_c[:, d]) + [-mult[d]],
                         -np.inf, 0.0)
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
    _memory_rows(rows, obj, prob, costs, mult, capped, base_y, base_sl if slack else None)
    if slack:
        keep = obj[base_sl:].copy()
        obj[:] = 0.0
        obj[base_sl:] = keep / max(keep.max(), 1.0)   # minimise total bytes short
        scale = max(keep.max(), 1.0)
    ub = np.ones(nvars)
    ub[nx:base_s] = np.inf   # T
    ub[base_sl:] = np.inf    # slacks
    return _Model(obj, rows, nx, ub, scale, cost, out_c, in_c)


def _memory_rows(rows: SparseRows, obj: np.ndarray, prob: Problem, costs: CostTable, mult: np.ndarray,
                 capped: list[int], base_y: int, base_sl: int | None) -> None:
    """Per budgeted device: ``y[m,d] >= x[c,d]`` for the classes sharing
    buffers ``m``, and bytes held within the budget (``base_sl``: with a
    slack column per device, its cost in the objective)."""
    D, M = prob.ndev, len(prob.mem_groups)
    ycol = {d: j for j, d in enumerate(capped)}
    for m, grp in enumerate(prob.mem_groups):
        for d in capped:
            for c in grp.classes:
                rows.add([base_y + m * len(capped) + ycol[d], c * D + d], [1.0, -1.0], 0.0, np.inf)
    for d in capped:
        cols = [c * D + d for c in range(prob.ncls)] + [base_y + m * len(capped) + ycol[d] for m in range(M)]
        # Each memory row is scaled by its budget (right-hand side 1), so
        # kilobyte and terabyte budgets are equally well conditioned.
        cap = max(float(costs.mem[d]) * mult[d], 1.0)
        vals = list(prob.class_mem / cap) + [g.nbytes / cap for g in prob.mem_groups]
        if base_sl is not None:
            cols.append(base_sl + ycol[d])
            vals.append(-1.0)
            obj[base_sl + ycol[d]] = cap
        rows.add(cols, vals, -np.inf, 1.0)


def _run(model: _Model, integral: bool, time_limit_s: float, mip_rel_gap: float, verbose: bool,
         fixed: dict[int, int] | None = None):
    """HiGHS on the model: the MILP, or its LP relaxation; ``fixed`` maps
    classes to a device they are held on (a neighbourhood of the relaxation)."""
    nvars = len(model.obj)
    integrality = np.zeros(nvars)
    if integral:
        integrality[:model.nx] = 1
    lb, ub = np.zeros(nvars), model.ub.copy()
    ndev = model.cost.shape[1]
    for c, d in (fixed or {}).items():
        ub[c * ndev:(c + 1) * ndev] = 0.0
        lb[c * ndev + d] = ub[c * ndev + d] = 1.0
    return milp(model.obj, integrality=integrality, bounds=Bounds(lb, ub),
                constraints=model.rows.constraint(nvars),
                options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": verbose})


def _assignment(model: _Model, x: np.ndarray) -> np.ndarray:
    C, D = model.cost.shape
    return np.asarray(np.argmax(x[:model.nx].reshape(C, D), axis=1), dtype=np.int64)


def solve(prob: Problem, costs: CostTable, mode: str, *, time_limit_s: float = 30.0,
          mip_rel_gap: float = 0.005, inflight: int = 8, slack: bool = False,
          verbose: bool = False, mult: Sequence[int] | None = None) -> Solution:
    """Solve the placement MILP (see module docstring). With ``slack`` the
    memory rows get a per-device slack variable and the objective is the
    total slack (used to explain infeasibility); ``Solution.objective_s``
    then holds bytes.  ``mult[d]``: how many identical devices column ``d``
    stands for (default 1 each; see :func:`aggregate`).

    The LP relaxation is solved first and rounded (:mod:`.rounding`): when
    the rounded placement lies within ``mip_rel_gap`` of the relaxation's
    value it is returned without branch and bound; otherwise HiGHS' branch
    and bound runs and the better of its incumbent and the rounding is
    returned, with the better of the two lower bounds."""
    if mode not in ("latency", "throughput"):
        raise PlanError(f"unknown plan mode {mode!r} (expected 'latency' or 'throughput')")
    C, D = prob.ncls, prob.ndev
    mult_a = np.ones(D) if mult is None else np.asarray(mult, dtype=float)
    model = _build(prob, costs, mode, inflight, slack, mult_a)
    t0 = time.perf_counter()
    left = lambda: max(time_limit_s - (time.perf_counter() - t0), 0.1)  # noqa: E731
    best, lower = None, -np.inf            # (assignment, objective), a proven lower bound
    if not slack:
        lp = _run(model, False, time_limit_s, mip_rel_gap, False)
        if lp.status == 2:
            raise _Infeasible(lp.message)
        if lp.x is not None:
            lower = float(lp.fun)
            obj = Objective(prob, model.cost, model.out_c, model.in_c, mult_a, list(costs.mem),
                            mode == "throughput", inflight)
            xs = lp.x[:model.nx].reshape(C, D)
            for cand in _neighbourhood(model, obj, xs, left, mip_rel_gap, verbose):
                over, val, _ = obj.value(cand)
                if over <= 1e-9 and (best is None or val < best[1]):
                    best = (cand, val)
                if best is not None and best[1] - lower <= mip_rel_gap * best[1]:
                    return _solution(model, best, lower, "optimal", time.perf_counter() - t0)
    res = _run(model, True, left(), mip_rel_gap, verbose)
    dt = time.perf_counter() - t0
    if res.status == 2 or (res.x is None and best is None):
        if res.status in (1,) and res.x is None:
            raise PlanError(f"MILP found no placement within {time_limit_s:g} s ({C} classes x {D} devices)")
        raise _Infeasible(res.message)
    if res.status not in (0, 1) and best is None:
        raise PlanError(f"MILP solver failed: {res.message}")
    if slack:
        return Solution([int(d) for d in _assignment(model, res.x)], float(res.fun) * model.scale,
                        float(res.mip_dual_bound or res.fun) * model.scale, float(res.mip_gap or 0.0),
                        "optimal" if res.status == 0 else "time_limit", dt, len(model.obj), len(model.rows.lb))
    if res.mip_dual_bound is not None:
        lower = max(lower, float(res.mip_dual_bound))
    if res.x is not None and (best is None or float(res.fun) <= best[1]):
        best = (_assignment(model, res.x), float(res.fun))
    status = "optimal" if res.status == 0 or best[1] - lower <= mip_rel_gap * best[1] else "time_limit"
    return _solution(model, best, lower, status, dt)


def _neighbourhood(model: _Model, obj: Objective, xs: np.ndarray, left, mip_rel_gap: float, verbose: bool):
    """Placements near the relaxation ``xs``, cheapest first: rounded and
    improved by single moves, then the MILP over the classes the relaxation
    split, the others held where it put them whole (a relaxation-induced
    neighbourhood, a tenth of the time left at least 1 s)."""
    yield round_relaxation(obj, xs, passes=3)
    whole = {c: int(np.argmax(xs[c])) for c in range(len(xs)) if xs[c].max() >= 1 - 1e-3}
    if 0 < len(whole) < len(xs):
        sub = _run(model, True, min(max(left() / 10, 1.0), left()), mip_rel_gap, verbose, fixed=whole)
        if sub.x is not None:
            yield _assignment(model, sub.x)


def _solution(model: _Model, best: tuple[np.ndarray, float], lower: float, status: str, dt: float) -> Solution:
    a, val = best
    lower = min(lower, val)
    return Solution([int(d) for d in a], val * model.scale, lower * model.scale,
                    (val - lower) / val if val else 0.0, status, dt, len(model.obj), len(model.rows.lb))


class _Infeasible(Exception):
    pass


def memory_shortfall(prob: Problem, costs: CostTable, mult: Sequence[int] | None = None) -> PlanError:
    """The :class:`PlanError` explaining an infeasible memory budget: the
    least total number of bytes missing and, for that placement, how many
    bytes each device is short."""
    mult = list(mult or [1] * costs.ndev)
    caps = [None if c is None else c * m for c, m in zip(costs.mem, mult)]
    total = float(prob.class_mem.sum() + sum(g.nbytes for g in prob.mem_groups))
    if all(c is not None for c in caps) and total > sum(caps):
        short = total - sum(caps)
        return PlanError(f"the model needs at least {total:.0f} bytes but the devices hold "
                         f"{sum(caps):.0f} together: short by {short:.0f} bytes")
    sol = solve(prob, costs, "latency", slack=True, time_limit_s=20.0, mult=mult)
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
        raise memory_shortfall(prob, costs, kw.get("mult")) from None
