"""Shrinking a kernel graph into a placement problem the MILP solves fast.

Contract of :func:`build_problem`: every kernel lies in exactly one *run*
(a contiguous run of kernels, program order) and every run in one *class*;
all kernels of a class get the same device.  So any class -> device choice
is a legal assignment:

* run boundaries never separate an indirect kernel from its neighbours;
* classes are merged (union-find) until every state group lies in one class;
* with ``tie_layers``, layers whose kernel signatures are equal in order
  (repeated transformer blocks) share classes position by position, so the
  MILP chooses one placement pattern for all of them.  A boundary is kept at
  every start and end of a tied layer so a run never spans two layers;
* long chains are coarsened: of the remaining boundaries, only the
  ``max_units - 1`` most valuable are kept.  A boundary is valuable when
  the kernels on its two sides are long and disagree about which device
  suits them (their normalised time vectors differ).

Communication is summarised in :class:`CommGroup` (one per producer class
and consumer-class set: the bytes one producer kernel's output sends to
other classes) and memory in per-class bytes plus :class:`MemGroup` (buffers
used by several classes: held once on each device running any of them).
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from tessera_actors.graph import KernelGraph, _merge
from tessera_actors.planning.costs import CostTable


@dataclass(frozen=True)
class CommGroup:
    producer: int                 # class
    consumers: frozenset[int]     # classes
    nbytes: float                 # total bytes over merged transfers
    count: int                    # transfers (each pays the link latency)


@dataclass(frozen=True)
class MemGroup:
    classes: frozenset[int]
    nbytes: int


@dataclass
class Problem:
    ndev: int
    runs: list[tuple[int, int]]            # [start, end) kernel ranges
    run_class: list[int]
    cost: np.ndarray                       # [class, device] seconds
    comm: list[CommGroup]
    class_mem: np.ndarray                  # [class] bytes held only by that class
    mem_groups: list[MemGroup]
    stats: dict = field(default_factory=dict)

    @property
    def ncls(self) -> int:
        return self.cost.shape[0]

    def assignment(self, class_device: list[int]) -> list[int]:
        """Kernel -> device for a class -> device choice."""
        out: list[int] = []
        for (a, b), c in zip(self.runs, self.run_class):
            out.extend([class_device[c]] * (b - a))
        return out


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, a: int) -> int:
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


_LAYER_IN_SCOPE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")


def layer_of(kernel) -> int:
    """``kernel.layer``, or the index in a module path like ``layers.3.mlp``
    (also ``h.3``, ``blocks.3``) when the capture left it at -1."""
    if kernel.layer >= 0:
        return kernel.layer
    m = _LAYER_IN_SCOPE.search(kernel.scope)
    return int(m.group(1)) if m else -1


def tied_positions(graph: KernelGraph, blocks: int = 1) -> list[tuple[int, int] | None]:
    """Per kernel ``(pattern, position)`` when it lies in a layer whose
    signature sequence occurs in at least two layers, else ``None``.
    Layers come from :func:`layer_of`; a kernel without a signature is
    compared by name (inductor reuses one kernel for every layer).  The
    layers of one signature sequence are split into ``blocks`` runs of
    consecutive layers; each run is its own pattern (so the MILP can still
    give different layer ranges different patterns, e.g. a layer split)."""
    layers: dict[int, list[int]] = defaultdict(list)
    for k in graph.kernels:
        lay = layer_of(k)
        if lay >= 0:
            layers[lay].append(k.id)
    patterns: dict[tuple, list[int]] = defaultdict(list)
    for lay, ks in layers.items():
        sig = tuple(graph.kernels[k].signature or graph.kernels[k].name for k in ks)
        contiguous = ks[-1] - ks[0] == len(ks) - 1
        if contiguous and all(sig):
            patterns[sig].append(lay)
    out: list[tuple[int, int] | None] = [None] * len(graph.kernels)
    pid = 0
    for sig, lays in sorted(patterns.items(), key=lambda kv: min(kv[1])):
        lays = sorted(lays)
        nb = max(1, min(blocks, len(lays) // 2))
        for b in range(nb):
            run = lays[b * len(lays) // nb:(b + 1) * len(lays) // nb]
            for lay in run:
                for j, k in enumerate(layers[lay]):
                    out[k] = (pid, j)
            pid += 1
    return out


def _comm_groups(graph: KernelGraph, kclass: np.ndarray) -> list[CommGroup]:
    """Communication: per producer kernel and buffer, the consumer classes;
    the bytes each (producer class, consumer classes) group may move."""
    need: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    cons: dict[tuple[int, int], set[int]] = defaultdict(set)
    for e in graph.edges:
        if e.kind != "RAW":
            continue
        p, c = int(kclass[e.src]), int(kclass[e.dst])
        if p == c:
            continue
        need[(e.src, e.buffer)].extend(e.ranges)
        cons[(e.src, e.buffer)].add(c)
    comm_acc: dict[tuple[int, frozenset], list[float]] = {}
    for key, ranges in need.items():
        nb = sum(b - a for a, b in _merge(ranges))
        gk = (int(kclass[key[0]]), frozenset(cons[key]))
        acc = comm_acc.setdefault(gk, [0.0, 0])
        acc[0] += nb
        acc[1] += 1
    comm = [CommGroup(p, cs, v[0], int(v[1])) for (p, cs), v in sorted(
        comm_acc.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1])))]
    return comm


def _memory(graph: KernelGraph, kclass: np.ndarray, ncls: int) -> tuple[np.ndarray, list[MemGroup]]:
    """Memory: each buffer is held once on every device running a class
    using it; (bytes of the buffers one class alone uses, the shared ones)."""
    users: dict[int, set[int]] = defaultdict(set)
    for k in graph.kernels:
        for a in k.accesses:
            users[a.buffer].add(int(kclass[k.id]))
    class_mem = np.zeros(ncls)
    mem_acc: dict[frozenset, int] = defaultdict(int)
    for b, cs in users.items():
        nb = graph.buffers[b].nbytes
        if len(cs) == 1:
            class_mem[next(iter(cs))] += nb
        else:
            mem_acc[frozenset(cs)] += nb
    mem_groups = [MemGroup(cs, nb) for cs, nb in sorted(mem_acc.items(), key=lambda kv: sorted(kv[0]))]
    return class_mem, mem_groups


def build_problem(graph: KernelGraph, costs: CostTable, max_units: int = 300,
                  tie_layers: bool = True, tie_blocks: int | None = None) -> Problem:
    """See the module docstring. ``max_units`` bounds the number of distinct
    boundary decisions (hence, roughly, the number of classes);
    ``tie_blocks`` (default: the number of devices) is how many runs of
    consecutive repeated layers get their own pattern."""
    costs.check_graph(graph)
    n, ndev = len(graph.kernels), costs.ndev
    times = np.asarray(costs.times, dtype=float).reshape(n, ndev)
    tie = tied_positions(graph, tie_blocks or ndev) if tie_layers else [None] * n
    forced = set()                      # boundaries that must be removed
    for k in graph.kernels:
        if k.indirect:
            forced.update(i for i in (k.id, k.id + 1) if 0 < i < n)
    kept_always: set[int] = set()
    keyed: dict[tuple, list[int]] = defaultdict(list)
    tmin = times.min(axis=1) if n else np.zeros(0)
    norm = times / np.maximum(times.sum(axis=1, keepdims=True), 1e-30)
    score: dict[tuple, float] = {}
    for i in range(1, n):
        if i in forced:
            continue
        a, b = tie[i - 1], tie[i]
        same_layer = a is not None and b is not None and a[0] == b[0] and b[1] == a[1] + 1 \
            and layer_of(graph.kernels[i - 1]) == layer_of(graph.kernels[i])
        if (a is not None or b is not None) and not same_layer:
            kept_always.add(i)
            continue
        key = ("t", a[0], b[1]) if same_layer else ("u", i)
        keyed[key].append(i)
        s = (tmin[i - 1] + tmin[i]) * (1.0 + 10.0 * float(np.abs(norm[i - 1] - norm[i]).sum()))
        score[key] = max(score.get(key, 0.0), s)
    budget = max(max_units - 1, 0)
    ranked = sorted(score, key=lambda key: (-score[key], key))
    kept = set(kept_always)
    for key in ranked[:budget]:
        kept.update(keyed[key])
    bounds = [0] + sorted(kept) + [n]
    runs = [(bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1) if bounds[j + 1] > bounds[j]]

    # Classes: tied runs share a class with the same run of other layers.
    class_key: dict[tuple, int] = {}
    run_class: list[int] = []
    for a, b in runs:
        t0, t1 = tie[a], tie[b - 1]
        if t0 is not None and t1 is not None and layer_of(graph.kernels[a]) == layer_of(graph.kernels[b - 1]):
            key = ("t", t0[0], t0[1], t1[1])
        else:
            key = ("u", a)
        run_class.append(class_key.setdefault(key, len(class_key)))
    run_of = np.empty(n, dtype=np.int64)
    for j, (a, b) in enumerate(runs):
        run_of[a:b] = j
    uf = _UnionFind(len(class_key))
    for group in graph.state_groups():
        cls = [run_class[run_of[k]] for k in group]
        for c in cls[1:]:
            uf.union(cls[0], c)
    roots = sorted({uf.find(c) for c in range(len(class_key))})
    renum = {r: i for i, r in enumerate(roots)}
    run_class = [renum[uf.find(c)] for c in run_class]
    ncls = len(roots)
    kclass = np.asarray([run_class[run_of[k]] for k in range(n)], dtype=np.int64)

    cost = np.zeros((ncls, ndev))
    np.add.at(cost, kclass, times)

    comm = _comm_groups(graph, kclass)
    class_mem, mem_groups = _memory(graph, kclass, ncls)
    stats = {"kernels": n, "runs": len(runs), "classes": ncls, "comm_groups": len(comm),
             "mem_groups": len(mem_groups), "tied_kernels": sum(t is not None for t in tie)}
    return Problem(ndev, runs, run_class, cost, comm, class_mem, mem_groups, stats)
