"""A plan's prediction: its per-device programs with micro-batches in flight,
run by the one step-time model (:mod:`.timing`).

* every device executes, for every micro-batch, its program (``Plan.programs``)
  in order; ``run`` occupies the device for the segment's time (the sum of
  its kernels' times in the cost table); ``send`` enqueues a transfer on its
  link direction ``src -> dst`` (``latency + bytes / bandwidth``; full
  duplex, one transfer at a time per direction); ``recv`` waits for it;
* at most ``inflight`` micro-batches are in flight: micro-batch ``i`` starts
  when micro-batch ``i - inflight`` has finished everywhere.

:func:`simulate` returns the step time (latency of one micro-batch alone),
the steady-state throughput (micro-batches per second, each micro-batch one
execution of the graph), per-device busy fractions and the event timeline.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tessera_actors.plan import Plan, PlanError
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.timing import Event, Programs, run


@dataclass
class Prediction:
    step_s: float                     # one micro-batch alone, start to finish
    throughput: float                 # micro-batches (graph executions) per second
    item_latency_s: float             # mean latency of a micro-batch at steady state
    busy: list[float]                 # per device, busy fraction at steady state
    inflight: int
    events: list[Event] = field(default_factory=list)


def segment_times(plan: Plan, costs: CostTable) -> list[float]:
    """Seconds of every segment on its device."""
    if costs.ndev != len(plan.devices):
        raise PlanError(f"cost table has {costs.ndev} devices, plan has {len(plan.devices)}")
    return [sum(costs.times[k][s.device] for k in s.kernels) for s in plan.segments]


def plan_programs(plan: Plan, costs: CostTable) -> Programs:
    """The plan's per-device programs as the step-time model takes them."""
    xfer = {t.tag: ((t.src, t.dst), t.dst, costs.comm_s(t.src, t.dst, t.nbytes)) for t in plan.transfers}
    names = {d: name for d, name in enumerate(plan.devices)}
    names.update({(t.src, t.dst): f"{plan.devices[t.src]}->{plan.devices[t.dst]}" for t in plan.transfers})
    return Programs([[(st.op, st.ref) for st in prog] for prog in plan.programs], segment_times(plan, costs),
                    xfer, names)


class Simulation:
    """One plan's programs and its step time, built once for predictions at
    several micro-batch counts (:func:`.inflight.choose_inflight` asks for
    1, 2, 4, ...)."""

    def __init__(self, plan: Plan, costs: CostTable) -> None:
        self.plan, self.costs = plan, costs
        self.programs = plan_programs(plan, costs)
        self._one: tuple[float, list[Event]] | None = None

    def run(self, items: int, inflight: int,
            record: bool = False) -> tuple[list[float], list[float], list[float], list[Event]]:
        """Simulate ``items`` micro-batches, ``inflight`` at a time (admitted in
        order); returns (start, finish) time per item, per-device busy seconds
        and, with ``record``, the events."""
        r = run([(self.programs, inflight)], [items], record, self.plan.name)
        return r.start, r.finish, r.busy + [0.0] * (len(self.plan.devices) - len(r.busy)), r.events

    def step(self, record: bool = False) -> tuple[float, list[Event]]:
        """Seconds of one micro-batch alone, and its events when ``record``."""
        if record:
            _, one, _, ev = self.run(1, 1, record=True)
            return one[0], ev
        if self._one is None:
            self._one = (self.run(1, 1)[1][0], [])
        return self._one

    def predict(self, inflight: int, items: int | None = None, record: bool = False) -> Prediction:
        """See :func:`simulate`."""
        plan, m = self.plan, inflight
        n = items or max(16, 8 * m)
        step, ev1 = self.step(record and m == 1)
        if m == 1:
            # One at a time: every micro-batch repeats the first exactly.
            seg_t = self.programs.seconds
            busy1 = [sum(e.end - e.start for e in ev1 if e.resource == dev) for dev in plan.devices] \
                if record else [sum(t for s, t in zip(plan.segments, seg_t) if s.device == d)
                                for d in range(len(plan.devices))]
            thr = float("inf") if step == 0 else 1.0 / step
            return Prediction(step, thr, step, [b / step if step else 0.0 for b in busy1], 1, ev1)
        st, fin, busy, ev = self.run(n, m, record=record)
        # Measure between the completions of the first and third quarter: the
        # pipeline is full there (no fill at the start, no drain at the end).
        a, b = n // 4, (3 * n) // 4
        span = fin[b] - fin[a]
        if span <= 0:
            thr, lat = (float("inf") if step == 0 else 1.0 / step), step
        else:
            thr = (b - a) / span
            lat = sum(f - s for s, f in zip(st[a:b], fin[a:b])) / (b - a)
        total = fin[-1] if fin[-1] > 0 else 1.0
        return Prediction(step, thr, lat, [x / total for x in busy], m, ev)


def simulate(plan: Plan, costs: CostTable, inflight: int | None = None, items: int | None = None,
             record: bool = False) -> Prediction:
    """Predict ``plan`` (see module docstring). ``inflight`` defaults to
    ``plan.microbatches``; ``items`` (micro-batches simulated for the steady
    state) to ``max(16, 8 * inflight)``; the first quarter is warm-up."""
    return Simulation(plan, costs).predict(inflight or plan.microbatches or 1, items, record)
