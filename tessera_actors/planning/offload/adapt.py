"""Load-aware re-planning for the offload planner (ATSInfer's dynamic
transfer): the busy time the step model predicts for a plan against what the
devices showed, and a cost table rescaled by that ratio per device, for the
next plan.  Pure Python; no torch."""
from __future__ import annotations

from typing import Sequence

from tessera_actors.plan import Plan
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.offload.model import Offload, Placement


def predicted_busy(o: Offload, plan: Plan) -> list[float]:
    """Per-device busy seconds of one step of ``plan`` (an offload plan of
    ``o``'s graph) on the step model."""
    off = plan.meta.get("offload") or {}
    p = Placement(list(plan.assignment), list(off.get("streamed", ())), int(off.get("slots", 0)),
                  int(off.get("slot_bytes", 0)), ring=str(off.get("ring", "slots")), breaks=list(off.get("breaks", ())))
    return list(o.simulate(p).busy_s)


def busy_factors(predicted: Sequence[float], observed: Sequence[float], tolerance: float = 1.25,
                 bound: float | None = None) -> list[float]:
    """Per device observed / predicted busy time where the two differ by
    more than ``tolerance`` (either way), else 1.0; clamped to ``bound``
    either way (None: no bound)."""
    factors = []
    for p, o in zip(predicted, observed):
        f = o / p if p > 0 and o > 0 else 1.0
        if bound is not None:
            f = min(max(f, 1 / bound), bound)
        factors.append(f if (f > tolerance or f < 1 / tolerance) else 1.0)
    return factors


def adapt(costs: CostTable, predicted: Sequence[float], observed: Sequence[float],
          tolerance: float = 1.25) -> tuple[CostTable, list[float]]:
    """Rates rescaled per device by :func:`busy_factors`; returns the new
    table and the factors applied (1.0: unchanged)."""
    factors = busy_factors(predicted, observed, tolerance)
    times = [[t * factors[d] for d, t in enumerate(row)] for row in costs.times]
    return CostTable(list(costs.devices), times, costs.latency, costs.bandwidth, list(costs.mem), "adapted"), factors


__all__ = ["adapt", "busy_factors", "predicted_busy"]
