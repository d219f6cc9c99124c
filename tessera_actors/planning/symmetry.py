"""Device-type symmetry: identical devices planned as one, then expanded.

Devices are *identical* when their kernel times, budgets and links to
every other device are equal (eight GPUs of one type on one board).
:func:`device_types` groups them; :func:`type_table` is the cost table of
one representative per type, which :func:`.milp.solve` plans with each
type's device count as its multiplicity (compute, links and budget scale
by it), a relaxation of planning every device: its lower bound is a lower
bound of the full problem over the same classes.

:func:`expand` turns the type of every kernel into a device: a type's
kernels, in program order, are cut into as many contiguous runs as it has
devices, each run within the device's budget, the longest as short as
legal cuts allow (a state group, an indirect kernel and its neighbours stay
in one run).  Repeated layers make this near exact: a run is a stretch of
identical layers' share of the type.  Pure Python + numpy.
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import numpy as np

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import PlanError
from tessera_actors.planning.costs import CostTable

T = TypeVar("T")


def device_types(costs: CostTable) -> list[list[int]]:
    """Devices grouped into types of identical ones, in order of first device."""
    times = np.asarray(costs.times, dtype=float).reshape(len(costs.times), costs.ndev)
    types: list[list[int]] = []
    for d in range(costs.ndev):
        for t in types:
            e = t[0]
            if (np.array_equal(times[:, d], times[:, e]) and costs.mem[d] == costs.mem[e]
                    and all(costs.latency[d][f] == costs.latency[e][f] and costs.bandwidth[d][f] == costs.bandwidth[e][f]
                            and costs.latency[f][d] == costs.latency[f][e] and costs.bandwidth[f][d] == costs.bandwidth[f][e]
                            for f in range(costs.ndev) if f not in (d, e))):
                t.append(d)
                break
        else:
            types.append([d])
    return types


def type_table(costs: CostTable, types: Sequence[Sequence[int]]) -> CostTable:
    """The cost table of each type's first device (links between types)."""
    rep = [t[0] for t in types]
    return CostTable([costs.devices[d] for d in rep], [[row[d] for d in rep] for row in costs.times],
                     [[costs.latency[a][b] for b in rep] for a in rep],
                     [[costs.bandwidth[a][b] for b in rep] for a in rep],
                     [costs.mem[d] for d in rep], costs.source)


def _cuttable(graph: KernelGraph, ks: Sequence[int]) -> np.ndarray:
    """``ok[j]``: the run ``ks`` (program order) may be cut before ``ks[j]``."""
    pos = {k: j for j, k in enumerate(ks)}
    ok = np.ones(len(ks) + 1, dtype=bool)
    ok[0] = ok[-1] = True
    for group in graph.state_groups():
        js = [pos[k] for k in group if k in pos]
        if js:
            ok[min(js) + 1:max(js) + 1] = False
    for k in graph.kernels:
        if k.indirect and k.id in pos:
            for n in (k.id - 1, k.id + 1):
                if n in pos:
                    ok[max(pos[n], pos[k.id])] = False
    return ok


def _runs(graph: KernelGraph, ks: Sequence[int], loads: np.ndarray, parts: int,
          cap: int | None) -> list[int] | None:
    """Start index of every run (``parts`` runs, contiguous, legal cuts) whose
    buffers fit ``cap`` bytes, with the least largest load of a run in any
    column of ``loads`` [kernel, resource]; None if no cut fits."""
    ok = _cuttable(graph, ks)
    cum = np.vstack([np.zeros(loads.shape[1]), np.cumsum(loads, axis=0)])
    legal = np.nonzero(ok)[0]

    def held(a: int, b: int) -> int:
        return _held(graph, ks[a:b])

    def fill(limit: float) -> list[int] | None:
        starts, a = [], 0
        for _ in range(parts):
            if a >= len(ks):
                break
            starts.append(a)
            reach = legal[(legal > a) & ((cum[legal] - cum[a]) <= limit).all(axis=1)]
            if not len(reach):
                return None
            b = int(reach[-1])
            while cap is not None and b > a + 1 and held(a, b) > cap:
                smaller = legal[(legal > a) & (legal < b)]
                if not len(smaller):
                    break
                b = int(smaller[-1])
            if cap is not None and held(a, b) > cap:
                return None
            a = b
        return starts if a >= len(ks) else None

    return least_limit(fill, float(cum[-1].max()), 40)


def least_limit(fill: Callable[[float], T | None], hi: float, halvings: int) -> T | None:
    """``fill(limit)`` at the least limit in ``(0, hi]`` it succeeds at (not
    None), found by ``halvings`` halvings of the interval, for a ``fill``
    that succeeds at every limit above one it succeeds at (a greedy fill
    under a bottleneck); None when it fails at ``hi``."""
    best = fill(hi)
    if best is None:
        return None
    lo = 0.0
    for _ in range(halvings):
        mid = (lo + hi) / 2
        got = fill(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


def _loads(graph: KernelGraph, costs: CostTable, types: Sequence[Sequence[int]],
           kernel_type: Sequence[int]) -> np.ndarray:
    """[kernel, (compute, egress, ingress)] seconds on its type's device: the
    transfers of its RAW edges to and from kernels of other types."""
    rep = [t[0] for t in types]
    out = np.zeros((len(graph.kernels), 3))
    out[:, 0] = [costs.times[k][rep[kernel_type[k]]] for k in range(len(graph.kernels))]
    seen: set[tuple[int, int, int]] = set()
    for e in graph.edges:
        a, b = kernel_type[e.src], kernel_type[e.dst]
        if e.kind != "RAW" or a == b or (e.src, e.buffer, b) in seen:
            continue
        seen.add((e.src, e.buffer, b))
        t = costs.comm_s(rep[a], rep[b], e.nbytes)
        out[e.src, 1] += t
        out[e.dst, 2] += t
    return out


def expand(graph: KernelGraph, costs: CostTable, types: Sequence[Sequence[int]],
           kernel_type: Sequence[int]) -> list[int]:
    """Kernel -> device from kernel -> type (see the module docstring).  When
    every type has the same number of devices the program is cut once for
    all of them (run ``i`` of every type covers the same stretch of layers,
    so the transfers between types stay between the devices of one stretch);
    otherwise each type's kernels are cut on their own.  Runs balance
    compute, egress and ingress together.  Raises :class:`PlanError` when a
    type's kernels cannot be cut into runs that fit its devices' budgets."""
    loads = _loads(graph, costs, types, kernel_type)
    n = len(graph.kernels)
    parts = {len(t) for t in types}
    if len(parts) == 1 and parts != {1}:
        cols = np.zeros((n, 3 * len(types)))
        for k in range(n):
            cols[k, 3 * kernel_type[k]:3 * kernel_type[k] + 3] = loads[k]
        starts = _runs(graph, list(range(n)), cols, parts.pop(), None)
        if starts is not None:
            out = _assign(list(range(n)), starts, lambda k, i: types[kernel_type[k]][i], n)
            if all(_held(graph, [k for k in range(n) if out[k] == d]) <= (costs.mem[d] or float("inf"))
                   for t in types for d in t):
                return out
    out = [0] * n
    for t, devs in enumerate(types):
        ks = [k for k in range(n) if kernel_type[k] == t]
        if not ks:
            continue
        starts = _runs(graph, ks, loads[ks], len(devs), costs.mem[devs[0]]) if len(devs) > 1 else [0]
        if starts is None:
            raise PlanError(f"the kernels placed on {costs.devices[devs[0]]}'s type do not fit its "
                            f"{len(devs)} devices' budgets")
        for k, d in enumerate(_assign(ks, starts, lambda k, i: devs[i], n)):
            if kernel_type[k] == t:
                out[k] = d
    return out


def _assign(ks: Sequence[int], starts: Sequence[int], device, n: int) -> list[int]:
    """Kernel -> ``device(kernel, run)`` for the runs of ``ks`` beginning at ``starts``."""
    out = [0] * n
    bounds = list(starts) + [len(ks)]
    for i in range(len(bounds) - 1):
        for k in ks[bounds[i]:bounds[i + 1]]:
            out[k] = device(k, i)
    return out


def _held(graph: KernelGraph, ks: Sequence[int]) -> int:
    """Bytes of the buffers kernels ``ks`` touch."""
    bufs = {acc.buffer for k in ks for acc in graph.kernels[k].accesses}
    return sum(graph.buffers[x].nbytes for x in bufs)
