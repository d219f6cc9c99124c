"""Sparse linear constraint rows for the planners' LPs and MILPs (torch-free).

:class:`SparseRows` gathers rows ``lb <= sum(vals * x[cols]) <= ub`` one at a
time as COO triplets, and hands out columns for new variables; the solvers
take its matrix (``scipy``'s ``linprog``: ``A_ub`` with ``ub``) or its
:class:`~scipy.optimize.LinearConstraint` (``milp``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy.optimize import LinearConstraint
from scipy.sparse import coo_matrix, csr_matrix


class SparseRows:
    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.n = 0   # variables handed out by :meth:`var`

    def var(self, count: int) -> int:
        """The first column of ``count`` new variables."""
        first, self.n = self.n, self.n + count
        return first

    def add(self, cols: Sequence[int], vals: Sequence[float], lb: float, ub: float) -> None:
        """The row ``lb <= sum(vals * x[cols]) <= ub``."""
        row = len(self.lb)
        self.r.extend([row] * len(cols))
        self.c.extend(cols)
        self.v.extend(vals)
        self.lb.append(lb)
        self.ub.append(ub)

    def matrix(self, nvars: int | None = None) -> csr_matrix:
        """The rows' coefficients over ``nvars`` columns (default: those of :meth:`var`)."""
        return coo_matrix((self.v, (self.r, self.c)), shape=(len(self.lb), self.n if nvars is None else nvars)).tocsr()

    def constraint(self, nvars: int) -> LinearConstraint:
        return LinearConstraint(self.matrix(nvars), np.asarray(self.lb), np.asarray(self.ub))


__all__ = ["SparseRows"]
