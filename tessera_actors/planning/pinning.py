"""Plans of several graphs that share state: keep each state buffer on one device.

A served model is captured once per shape bucket (decode batch sizes,
prefill chunk sizes); every bucket's graph touches the same KV cache, which
lives on one device per layer for the whole deployment.  So the plan of a
bucket must run the kernels touching a state buffer where that buffer lives.

* :func:`state_homes` reads those homes off a placed graph (by buffer name).
* :func:`pinned_assignment` places another graph under such homes: kernels
  touching a pinned state buffer go to its device, every other kernel
  follows the nearest pinned kernel before it (after it, for a prefix that
  precedes all of them) - a split that moves only activations.
* :func:`respects` says whether a plan already keeps the homes (the
  planner's own choice is used then);
* :func:`served_assignment` is that rule whole: what the scheduler serves a
  bucket with beside a reference placement, and :func:`served_plan` the
  plan it serves (``tessera advise`` predicts the same).

Pure functions over the graph model (no torch).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan, PlanError, build_plan


def _state_names(graph: KernelGraph, kernel) -> set[str]:
    return {graph.buffers[a.buffer].name for a in kernel.accesses
            if graph.buffers[a.buffer].role == "state" and graph.buffers[a.buffer].name}


def state_homes(graph: KernelGraph, assignment: Sequence[int]) -> dict[str, int]:
    """State-buffer name -> the device its kernels run on.  Raises
    :class:`PlanError` when one state buffer is touched on two devices."""
    homes: dict[str, int] = {}
    for k in graph.kernels:
        for name in _state_names(graph, k):
            d = assignment[k.id]
            if homes.setdefault(name, d) != d:
                raise PlanError(f"state {name!r} is touched on devices {homes[name]} and {d}")
    return homes


def _weight_names(graph: KernelGraph, kernel) -> set[str]:
    return {graph.buffers[a.buffer].name for a in kernel.accesses
            if graph.buffers[a.buffer].role == "weight" and graph.buffers[a.buffer].name}


def weight_homes(graph: KernelGraph, assignment: Sequence[int]) -> dict[str, set[int]]:
    """Named weight -> the devices whose kernels read it (where it is resident)."""
    homes: dict[str, set[int]] = {}
    for k in graph.kernels:
        for name in _weight_names(graph, k):
            homes.setdefault(name, set()).add(assignment[k.id])
    return homes


def respects(graph: KernelGraph, assignment: Sequence[int], pins: Mapping[str, int],
             weights: Mapping[str, Sequence[int]] | None = None) -> bool:
    """True when every kernel touching a pinned state runs on its pin and
    every kernel reading a placed weight runs where that weight lives (a
    bucket then adds no weight copy to any device: the budgets hold)."""
    weights = weights or {}
    for k in graph.kernels:
        d = assignment[k.id]
        if any(d != pins[n] for n in _state_names(graph, k) if n in pins):
            return False
        if any(d not in weights[n] for n in _weight_names(graph, k) if n in weights):
            return False
    return True


def pinned_assignment(graph: KernelGraph, pins: Mapping[str, int],
                      weights: Mapping[str, Sequence[int]] | None = None) -> list[int]:
    """Kernel -> device under ``pins`` (state name -> device) and
    ``weights`` (weight name -> the devices holding it: a weight held on one
    device pins its readers there too); see the module docstring.  With no
    pinned kernel at all every kernel goes to the device of the smallest pin
    (or 0).  Raises :class:`PlanError` when one kernel is pinned to two
    devices."""
    weights = weights or {}
    fixed: dict[int, int] = {}
    for k in graph.kernels:
        devs = {pins[n] for n in _state_names(graph, k) if n in pins}
        devs |= {next(iter(weights[n])) for n in _weight_names(graph, k) if n in weights and len(weights[n]) == 1}
        if len(devs) > 1:
            raise PlanError(f"kernel {k.id} ({k.name}) touches state/weights pinned to devices {sorted(devs)}")
        if devs:
            fixed[k.id] = devs.pop()
    if not fixed:
        return [min(pins.values(), default=0)] * len(graph.kernels)
    first = min(fixed)
    current = fixed[first]
    out = []
    for k in range(len(graph.kernels)):
        current = fixed.get(k, current)
        out.append(current)
    return out


def served_assignment(graph: KernelGraph, assignment: Sequence[int], pins: Mapping[str, int],
                      weights: Mapping[str, Sequence[int]] | None = None) -> list[int] | None:
    """The assignment a bucket planned as ``assignment`` is served with under
    ``pins`` and ``weights`` (as :func:`pinned_assignment` takes them): None
    when the plan keeps them (it is served as planned), else
    :func:`pinned_assignment`."""
    if not (pins or weights) or respects(graph, assignment, pins, weights):
        return None
    return pinned_assignment(graph, pins, weights)


def served_plan(graph: KernelGraph, plan: Plan, devices: Sequence[str], pins: Mapping[str, int],
                weights: Mapping[str, Sequence[int]] | None = None, mode: str | None = None) -> Plan:
    """The plan a bucket planned as ``plan`` is served with under ``pins``
    and ``weights`` (:func:`served_assignment`): ``plan`` itself when it
    keeps them, else the pinned assignment at the planned micro-batches in
    flight (only the homes change: the engine pipelines its prompt chunks
    as planned, :func:`.inflight.prompt_inflight`)."""
    a = served_assignment(graph, plan.assignment, pins, weights)
    if a is None:
        return plan
    return build_plan(graph, devices, a, name=f"{plan.name}, state-pinned", mode=mode or plan.mode,
                      microbatches=plan.microbatches)
