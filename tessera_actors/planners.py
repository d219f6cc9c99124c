"""Planners by name, for the CLI and the scheduler.

``contiguous``: the simple rule (contiguous runs, equal shares);
``milp``: the memory-aware MILP (``tessera_actors.planning``);
``offload``: a budgeted GPU beside a CPU, weights resident, streamed or
computed on the CPU (``tessera_actors.planning.offload``)."""
from __future__ import annotations

from .plan import ContiguousPlanner, Planner

NAMES = ("contiguous", "milp", "offload")


def get_planner(name: str, **options) -> Planner:
    if name == "contiguous":
        return ContiguousPlanner(**options)
    if name == "milp":
        from .planning import MilpPlanner
        return MilpPlanner(**options)
    if name == "offload":
        from .planning.offload import OffloadPlanner
        return OffloadPlanner(**options)
    raise ValueError(f"unknown planner {name!r}; known: {', '.join(NAMES)}")
