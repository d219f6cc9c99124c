"""A placement from the MILP's LP relaxation: round every class to the
device holding most of it, then move single classes while that lowers the
MILP's own objective (:mod:`.milp`).  The result is the warm start of a
solve: when it lies within the requested gap of the relaxation's value no
branch and bound is needed; otherwise the solver's incumbent has to beat it.

:class:`Objective` evaluates a class -> device choice exactly as the MILP's
rows would (compute, egress, ingress and pipeline-depth rows of the
throughput plan, or the latency plan's path), per device divided by the
number of identical devices it stands for (``mult``, see
:func:`.milp.solve`).  Pure numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera_actors.planning.coarsen import Problem


@dataclass
class Objective:
    """The MILP objective of an assignment; seconds x 1e6 like the MILP's
    columns (``cost``, ``out_c``, ``in_c`` are [class|group, device])."""

    prob: Problem
    cost: np.ndarray
    out_c: np.ndarray
    in_c: np.ndarray
    mult: np.ndarray
    caps: list[float | None]
    throughput: bool
    inflight: int

    def __post_init__(self) -> None:
        D = self.cost.shape[1]
        self.devs = np.arange(D)
        self.prod = np.array([g.producer for g in self.prob.comm], dtype=np.int64)
        self.cons, self.cmask = _padded([sorted(g.consumers) for g in self.prob.comm])
        self.mems, self.mmask = _padded([sorted(m.classes) for m in self.prob.mem_groups])
        self.gbytes = np.array([m.nbytes for m in self.prob.mem_groups], dtype=float)
        self.capped = np.array([c is not None for c in self.caps])
        self.cap = np.array([(c or 1.0) for c in self.caps], dtype=float) * self.mult

    def _present(self, a: np.ndarray, idx: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """[row, device]: some class of the row (a padded index list) is on the device."""
        if not len(idx):
            return np.zeros((0, len(self.devs)), dtype=bool)
        return ((a[idx][..., None] == self.devs) & mask[..., None]).any(axis=1)

    def overflow(self, a: np.ndarray) -> float:
        """Bytes over the budgets, summed over devices, each relative to its budget."""
        held = np.bincount(a, weights=self.prob.class_mem, minlength=len(self.devs)).astype(float)
        held += self.gbytes @ self._present(a, self.mems, self.mmask)
        return float(np.maximum(held / self.cap - 1.0, 0.0)[self.capped].sum())

    def value(self, a: np.ndarray) -> tuple[float, float, float]:
        """``(overflow, objective, communication)`` of ``a``: lexicographic, the
        MILP's objective includes its 1e-3 weight on communication."""
        own = self.cost[np.arange(len(a)), a]
        if len(self.prod):
            recv = self._present(a, self.cons, self.cmask) & (a[self.prod][:, None] != self.devs)
            send = np.zeros_like(recv)
            send[np.arange(len(self.prod)), a[self.prod]] = recv.any(axis=1)
            eg, ing = (self.out_c * send).sum(axis=0), (self.in_c * recv).sum(axis=0)
        else:
            eg = ing = np.zeros(len(self.devs))
        comm = float(eg.sum() + ing.sum())
        if not self.throughput:
            return self.overflow(a), float(own.sum() + ing.sum()), 0.0
        load = np.bincount(a, weights=own, minlength=len(self.devs)) / self.mult
        t = max(float(load.max()), float((eg / self.mult).max()), float((ing / self.mult).max()),
                float(own.sum() + ing.sum()) / self.inflight)
        return self.overflow(a), t + 1e-3 * comm, comm


def _padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Index lists as one array padded with 0, and the mask of real entries."""
    width = max((len(r) for r in rows), default=0)
    idx = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=bool)
    for i, r in enumerate(rows):
        idx[i, :len(r)] = r
        mask[i, :len(r)] = True
    return idx, mask


def improve(obj: Objective, a: np.ndarray, passes: int = 20) -> np.ndarray:
    """Single-class moves, each kept when it lowers the objective (first
    improvement), until a pass over every class and device finds none."""
    a = a.copy()
    best = obj.value(a)
    C, D = obj.cost.shape
    for _ in range(passes):
        moved = False
        for c in range(C):
            keep = a[c]
            for d in range(D):
                if d == keep:
                    continue
                a[c] = d
                v = obj.value(a)
                if v[0] < best[0] - 1e-12 or (v[0] <= best[0] + 1e-12 and v[1] < best[1] * (1 - 1e-9)):
                    best, keep, moved = v, d, True
                a[c] = keep
        if not moved:
            break
    return a


def round_relaxation(obj: Objective, x: np.ndarray, passes: int = 20) -> np.ndarray:
    """The relaxation's ``x`` [class, device] rounded to its largest share,
    then :func:`improve`."""
    return improve(obj, np.asarray(np.argmax(x, axis=1), dtype=np.int64), passes)
