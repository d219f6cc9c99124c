"""Planners by name, for the CLI, the scheduler and the serving engine.

``contiguous``: the simple rule (contiguous runs, equal kernel shares);
``layers``: a layer split balanced by the cost table (a pipeline);
``af``: attention on one device, the rest on the other (AF disaggregation);
``milp``: the memory-aware MILP (:mod:`.planner`): Tessera;
``offload``: a budgeted GPU beside a CPU, every weight resident, streamed
or computed on the CPU (:mod:`.offload`).

``costs`` (optional) maps a graph's fingerprint (:func:`graph_key`) to its
measured :class:`~tessera_actors.planning.costs.CostTable` on the devices
it will be planned on; graphs without one are planned on the roofline
estimate (``CostTable.estimate``)."""
from __future__ import annotations

from typing import Mapping, Sequence

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import ContiguousPlanner, Plan, Planner, PlanError

NAMES = ("contiguous", "layers", "af", "milp", "offload")


def graph_key(graph: KernelGraph) -> tuple:
    """A fingerprint of a graph that survives a msgpack round trip."""
    return (len(graph.kernels), len(graph.buffers), tuple(k.name for k in graph.kernels[:64]),
            round(sum(k.flops for k in graph.kernels), 3))


class Measured:
    """The :class:`~tessera_actors.planning.costs.CostModel` of profiled
    tables (by :func:`graph_key`), for the devices they were measured on; a
    roofline estimate for any other graph or devices."""

    def __init__(self, tables: Mapping[tuple, object] | None = None) -> None:
        self.tables = dict(tables or {})

    def table(self, graph: KernelGraph, devices: Sequence[str]):
        from tessera_actors.planning.costs import Roofline
        table = self.tables.get(graph_key(graph))
        if table is not None and list(table.devices) == list(devices):
            return table
        return Roofline().table(graph, devices)


class _CostsPlanner:
    def __init__(self, name: str, costs: Mapping[tuple, object] | None) -> None:
        self.name, self.costs = name, Measured(costs)

    def _table(self, graph: KernelGraph, devices: Sequence[str]):
        return self.costs.table(graph, devices)

    def plan(self, graph: KernelGraph, devices: Sequence[str], mode: str = "latency") -> Plan:
        from tessera_actors.planning.baselines import af_plan, layer_split_plan
        from tessera_actors.planning.planner import MilpPlanner
        costs = self._table(graph, devices)
        if self.name == "milp":
            return MilpPlanner(costs).plan(graph, devices, mode)
        if len(devices) < 2:   # one device: every policy is that device alone
            return ContiguousPlanner().plan(graph, devices, mode)
        if self.name == "af":
            return af_plan(graph, devices, costs)
        return layer_split_plan(graph, devices, costs)


def get_planner(name: str, costs: Mapping[tuple, object] | None = None, **options) -> Planner:
    if name == "contiguous":
        return ContiguousPlanner(**options)
    if name in ("layers", "af", "milp"):
        if options:
            raise PlanError(f"planner {name!r} takes no options {sorted(options)}")
        return _CostsPlanner(name, costs)
    if name == "offload":
        from tessera_actors.planning.offload import OffloadPlanner
        return OffloadPlanner(**options)
    raise ValueError(f"unknown planner {name!r}; known: {', '.join(NAMES)}")
