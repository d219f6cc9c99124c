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
        self.cons = _Rows([g.consumers for g in self.prob.comm])
        self.mems = _Rows([m.classes for m in self.prob.mem_groups])
        self.gbytes = np.array([m.nbytes for m in self.prob.mem_groups], dtype=float)
        self.capped = np.array([c is not None for c in self.caps])
        self.cap = np.array([(c or 1.0) for c in self.caps], dtype=float) * self.mult
        self._of: list | None = None

    def _present(self, a: np.ndarray, rows: np.ndarray, classes: np.ndarray, n: int) -> np.ndarray:
        """[row, device]: some class of the row is on the device (entries
        ``(rows[i], classes[i])``, ``n`` rows)."""
        D = len(self.devs)
        out = np.zeros(n * D, dtype=bool)
        out[rows * D + a[classes]] = True
        return out.reshape(n, D)

    def _links(self, a: np.ndarray, prod: np.ndarray, rows: np.ndarray,
               classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(send, recv)`` [group, device] of communication groups with
        producers ``prod`` and consumer entries ``(rows, classes)``."""
        recv = self._present(a, rows, classes, len(prod)) & (a[prod][:, None] != self.devs)
        send = np.zeros_like(recv)
        send[np.arange(len(prod)), a[prod]] = recv.any(axis=1)
        return send, recv

    def _groups_of(self, c: int):
        """Class ``c``'s communication groups with their consumer entries, and
        its memory groups with theirs (rows numbered within the selection);
        built on first use (only :func:`improve` moves classes)."""
        if self._of is None:
            C = self.cost.shape[0]
            comm: list[set[int]] = [set() for _ in range(C)]
            for gi, g in enumerate(self.prob.comm):
                for k in {g.producer, *g.consumers}:
                    comm[k].add(gi)
            mem: list[set[int]] = [set() for _ in range(C)]
            for mi, m in enumerate(self.prob.mem_groups):
                for k in m.classes:
                    mem[k].add(mi)
            self._of = [(self.cons.select(sorted(comm[k])), self.mems.select(sorted(mem[k]))) for k in range(C)]
        return self._of[c]

    def state(self, a: np.ndarray) -> _State:
        """What the objective of ``a`` is made of (see :class:`_State`)."""
        own = self.cost[np.arange(len(a)), a]
        D = len(self.devs)
        if len(self.prod):
            send, recv = self._links(a, self.prod, self.cons.row, self.cons.cls)
            eg, ing = (self.out_c * send).sum(axis=0), (self.in_c * recv).sum(axis=0)
        else:
            send = recv = np.zeros((0, D), dtype=bool)
            eg = ing = np.zeros(D)
        mpres = self._present(a, self.mems.row, self.mems.cls, len(self.gbytes))
        held = np.bincount(a, weights=self.prob.class_mem, minlength=D).astype(float) + self.gbytes @ mpres
        return _State(float(own.sum()), np.bincount(a, weights=own, minlength=D), send, recv, eg, ing, mpres, held)

    def score(self, st: _State) -> tuple[float, float, float]:
        """``(overflow, objective, communication)``: lexicographic, the
        MILP's objective includes its 1e-3 weight on communication; overflow
        is the bytes over the budgets, summed over devices, each relative to
        its budget."""
        over = float(np.maximum(st.held / self.cap - 1.0, 0.0)[self.capped].sum())
        comm = float(st.eg.sum() + st.ing.sum())
        if not self.throughput:
            return over, st.own + float(st.ing.sum()), 0.0
        t = max(float((st.load / self.mult).max()), float((st.eg / self.mult).max()),
                float((st.ing / self.mult).max()), (st.own + float(st.ing.sum())) / self.inflight)
        return over, t + 1e-3 * comm, comm

    def overflow(self, a: np.ndarray) -> float:
        """Bytes over the budgets, summed over devices, each relative to its budget."""
        return self.score(self.state(a))[0]

    def value(self, a: np.ndarray) -> tuple[float, float, float]:
        """:meth:`score` of ``a``."""
        return self.score(self.state(a))

    def moved(self, a: np.ndarray, st: _State, c: int, d: int) -> _State:
        """The state of ``a`` (whose state is ``st``) with class ``c`` moved
        to device ``d``: only the groups ``c`` belongs to are recomputed.
        ``a`` is left as it was."""
        old = int(a[c])
        a[c] = d
        try:
            (gs, grow, gcls), (ms, mrow, mcls) = self._groups_of(c)
            cost, cm = self.cost[c], float(self.prob.class_mem[c])
            load = st.load.copy()
            load[old] -= cost[old]
            load[d] += cost[d]
            held = st.held.copy()
            held[old] -= cm
            held[d] += cm
            eg, ing = st.eg, st.ing
            if len(gs):
                send, recv = self._links(a, self.prod[gs], grow, gcls)
                eg = eg + (self.out_c[gs] * (send.astype(float) - st.send[gs])).sum(axis=0)
                ing = ing + (self.in_c[gs] * (recv.astype(float) - st.recv[gs])).sum(axis=0)
            if len(ms):
                pres = self._present(a, mrow, mcls, len(ms))
                held += self.gbytes[ms] @ (pres.astype(float) - st.mpres[ms])
            return _State(st.own - cost[old] + cost[d], load, st.send, st.recv, eg, ing, st.mpres, held)
        finally:
            a[c] = old


@dataclass
class _State:
    """An assignment's sums: total and per-device compute, which groups each
    device sends and receives, egress and ingress per device, which memory
    groups each device holds and its bytes held (``send``, ``recv`` and
    ``mpres`` are those of the assignment the state was computed for)."""

    own: float
    load: np.ndarray
    send: np.ndarray
    recv: np.ndarray
    eg: np.ndarray
    ing: np.ndarray
    mpres: np.ndarray
    held: np.ndarray


class _Rows:
    """Lists of classes (a group's consumers, a memory group's classes) as
    flat entries: ``row[i]`` holds class ``cls[i]``."""

    def __init__(self, lists) -> None:
        self.lists = [np.asarray(sorted(x), dtype=np.int64) for x in lists]
        self.row = np.repeat(np.arange(len(self.lists)), [len(x) for x in self.lists]).astype(np.int64)
        self.cls = np.concatenate(self.lists) if self.lists else np.zeros(0, dtype=np.int64)

    def select(self, rows: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(rows, row, cls)`` of the chosen rows, renumbered 0..len(rows)-1."""
        parts = [self.lists[r] for r in rows]
        local = np.repeat(np.arange(len(rows)), [len(x) for x in parts]).astype(np.int64)
        cls = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return np.asarray(rows, dtype=np.int64), local, cls


def improve(obj: Objective, a: np.ndarray, passes: int = 20) -> np.ndarray:
    """Single-class moves, each kept when it lowers the objective (first
    improvement), until a pass over every class and device finds none."""
    a = a.copy()
    st = obj.state(a)
    best = obj.score(st)
    C, D = obj.cost.shape
    for _ in range(passes):
        moved = False
        for c in range(C):
            keep = int(a[c])
            for d in range(D):
                if d == int(a[c]):
                    continue
                v = obj.score(obj.moved(a, st, c, d))
                if v[0] < best[0] - 1e-12 or (v[0] <= best[0] + 1e-12 and v[1] < best[1] * (1 - 1e-9)):
                    best, keep, moved = v, d, True
            if keep != a[c]:
                a[c] = keep
                st = obj.state(a)       # recomputed whole: no drift of the sums
                best = obj.score(st)
        if not moved:
            break
    return a


def round_relaxation(obj: Objective, x: np.ndarray, passes: int = 20) -> np.ndarray:
    """The relaxation's ``x`` [class, device] rounded to its largest share,
    then :func:`improve`."""
    return improve(obj, np.asarray(np.argmax(x, axis=1), dtype=np.int64), passes)
