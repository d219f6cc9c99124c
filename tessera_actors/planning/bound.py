"""An upper bound on the throughput of any placement: the LP relaxation.

Work is a list of ``(graph, costs, executions)``: the graphs one unit of a
workload runs (a decode step at some batch, ``executions`` times per unit;
a prompt's prefill), each with its cost table on the same devices.  The LP
splits every kernel class (kernels that must share a device: a state group,
an indirect kernel's neighbourhood) *fractionally* over the devices -
``x[g,c,d] >= 0``, ``sum_d x[g,c,d] = 1``; a fraction is a share of the
requests, so replicas (Request Distribution), mixes and kernel-level plans
are all points of it - and minimises ``tau``, the seconds of one unit:

* compute: ``sum_g n_g sum_c cost[g,c,d] x[g,c,d] <= mult_d tau`` per device;
* links: a producer's bytes leave device ``d`` for at least the share it
  produces there that its consumers do not take there
  (``s >= x[p,d] - x[v,d]``), and arrive likewise (``r >= x[v,d] - x[p,d]``);
  egress and ingress of a device, at its fastest link's bandwidth, each
  ``<= mult_d tau`` (latencies are left out: a bound may only be optimistic);
* repeated layers whose kernels cost the same are tied (one class per
  position for all of them): the LP is convex, so averaging a split over
  identical layers loses nothing and the tied LP has the same optimum;
* memory: a device holds a weight or state buffer (by name: graphs of one
  model share them; the largest size) in the largest share of any class
  that touches it: ``y[b,d] >= x[g,c,d]``, ``sum_b bytes_b y[b,d] <=
  mult_d cap_d`` (temporaries are left out).

Every placement the planners make - each device running its classes one at
a time, links one transfer at a time per direction, within the budgets -
needs at least ``tau`` per unit, so ``1 / tau`` bounds every policy at these
graphs' batch sizes.  ``mult[d]`` devices stand behind column ``d`` (types
of identical devices, :mod:`.symmetry`): splitting a type's share evenly
over its devices makes that exact for the LP.  Pure numpy + scipy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import PlanError
from tessera_actors.planning.coarsen import build_problem, tied_positions
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.sparse import SparseRows


@dataclass(frozen=True)
class Bound:
    """``tau_s``: seconds of one unit of work at best; ``throughput``: units
    per second at most; ``busy``: each device's compute seconds per unit at
    the optimum, over ``tau_s``; ``share``: per graph, each device's share
    of its compute time."""

    tau_s: float
    throughput: float
    busy: tuple[float, ...]
    share: tuple[tuple[float, ...], ...]


def _key(graph: KernelGraph, gi: int, b: int) -> tuple:
    buf = graph.buffers[b]
    return ("name", buf.name) if buf.name else ("own", gi, b)


def placement_bound(work: Sequence[tuple[KernelGraph, CostTable, float]],
                    mult: Sequence[int] | None = None) -> Bound:
    """The LP bound of the module docstring.  Raises :class:`PlanError` when
    the budgets cannot hold the weights and state at all."""
    if not work:
        raise PlanError("a bound needs at least one graph")
    first = work[0][1]
    D = first.ndev
    mult_a = np.ones(D) if mult is None else np.asarray(mult, dtype=float)
    lp, eq_rows, eq_cols = SparseRows(), [], []
    tau = lp.var(1)
    comp = [([], []) for _ in range(D)]
    egress = [([], []) for _ in range(D)]
    ingress = [([], []) for _ in range(D)]
    held: dict[tuple, tuple[int, int]] = {}      # buffer key -> (bytes, first y column)
    xs = []
    for gi, (graph, costs, n_exec) in enumerate(work):
        if costs.ndev != D:
            raise PlanError(f"graph {gi}'s cost table has {costs.ndev} devices, the first one's {D}")
        prob = build_problem(graph, costs, max_units=len(graph.kernels), tie_layers=_layers_equal(graph, costs),
                             tie_blocks=1)
        x0 = lp.var(prob.ncls * D)
        xs.append((x0, prob))
        for c in range(prob.ncls):
            eq_rows.append(len(eq_rows))
            eq_cols.append([x0 + c * D + d for d in range(D)])
            for d in range(D):
                comp[d][0].append(x0 + c * D + d)
                comp[d][1].append(n_exec * prob.cost[c, d])
        fast_out = [max((costs.bandwidth[d][e] for e in range(D) if e != d), default=np.inf) for d in range(D)]
        fast_in = [max((costs.bandwidth[e][d] for e in range(D) if e != d), default=np.inf) for d in range(D)]
        for g in prob.comm:
            s0, r0 = lp.var(D), lp.var(D)
            for d in range(D):
                for v in g.consumers:
                    lp.add([x0 + g.producer * D + d, x0 + v * D + d, s0 + d], [1.0, -1.0, -1.0], -np.inf, 0.0)
                    lp.add([x0 + v * D + d, x0 + g.producer * D + d, r0 + d], [1.0, -1.0, -1.0], -np.inf, 0.0)
                egress[d][0].append(s0 + d)
                egress[d][1].append(n_exec * g.nbytes / fast_out[d])
                ingress[d][0].append(r0 + d)
                ingress[d][1].append(n_exec * g.nbytes / fast_in[d])
        _memory_rows(lp, graph, gi, prob, x0, D, held)
    for d in range(D):
        for cols, vals in (comp[d], egress[d], ingress[d]):
            if cols:
                lp.add(list(cols) + [tau], list(vals) + [-mult_a[d]], -np.inf, 0.0)
    for d, cap in enumerate(first.mem):
        if cap is not None and held:
            lp.add([y0 + d for _, y0 in held.values()], [nb / (cap * mult_a[d]) for nb, _ in held.values()],
                   -np.inf, 1.0)
    a_eq = coo_matrix(([1.0] * sum(len(c) for c in eq_cols),
                       ([r for r, cs in zip(eq_rows, eq_cols) for _ in cs], [c for cs in eq_cols for c in cs])),
                      shape=(len(eq_rows), lp.n)).tocsr()
    obj = np.zeros(lp.n)
    obj[tau] = 1.0
    bounds = np.zeros((lp.n, 2))
    bounds[:, 1] = 1.0
    bounds[tau, 1] = np.inf
    res = linprog(obj, A_ub=lp.matrix(), b_ub=np.asarray(lp.ub), A_eq=a_eq, b_eq=np.ones(len(eq_rows)),
                  bounds=bounds, method="highs")
    if res.status == 2:
        raise PlanError("the budgets cannot hold the weights and state even split fractionally")
    if res.status != 0:
        raise PlanError(f"bound LP failed: {res.message}")
    t = float(res.x[tau])
    busy = tuple(float(np.dot(vals, res.x[cols])) / t if t else 0.0 for cols, vals in comp)
    share = []
    for x0, prob in xs:
        x = res.x[x0:x0 + prob.ncls * D].reshape(prob.ncls, D)
        per = (x * prob.cost).sum(axis=0)
        share.append(tuple(float(v) for v in per / max(per.sum(), 1e-30)))
    return Bound(t, 1.0 / t if t > 0 else float("inf"), busy, tuple(share))


def _layers_equal(graph: KernelGraph, costs: CostTable) -> bool:
    """Repeated layers cost the same kernel by kernel, so classes may be tied
    across them: averaging any split over identical layers is a split of the
    same loads, transfers and memory, so the tied LP has the untied optimum."""
    times = np.asarray(costs.times, dtype=float).reshape(len(graph.kernels), costs.ndev)
    first: dict[tuple[int, int], int] = {}
    tied = False
    for k, pos in enumerate(tied_positions(graph, 1)):
        if pos is None:
            continue
        tied = True
        j = first.setdefault(pos, k)
        if not np.array_equal(times[j], times[k]):
            return False
    return tied


def _memory_rows(lp: SparseRows, graph: KernelGraph, gi: int, prob, x0: int, D: int,
                 held: dict[tuple, tuple[int, int]]) -> None:
    """``y[b,d] >= x[c,d]`` for every weight and state buffer ``b`` a class ``c`` touches."""
    kclass = np.empty(len(graph.kernels), dtype=np.int64)
    for (a, b), c in zip(prob.runs, prob.run_class):
        kclass[a:b] = c
    users: dict[tuple, set[int]] = {}
    for k in graph.kernels:
        for acc in k.accesses:
            buf = graph.buffers[acc.buffer]
            if buf.role in ("weight", "state"):
                users.setdefault(_key(graph, gi, acc.buffer), set()).add(int(kclass[k.id]))
                nb, y0 = held.get(_key(graph, gi, acc.buffer), (0, -1))
                if y0 < 0:
                    y0 = lp.var(D)
                held[_key(graph, gi, acc.buffer)] = (max(nb, buf.nbytes), y0)
    for key, classes in users.items():
        y0 = held[key][1]
        for c in classes:
            for d in range(D):
                lp.add([x0 + c * D + d, y0 + d], [1.0, -1.0], -np.inf, 0.0)
