"""The queue order of several slots on streams their devices share.

A device that runs the segments of every micro-batch slot on one stream
executes them in the order they were queued, so that order *is* the
schedule.  :func:`list_schedule` builds it greedily: each slot is an endless
chain of steps (a decode step needs the previous one's token), each step its
plan's segments in order; next in the queue comes the pending segment that
could start earliest - when its device frees up, its step may begin and its
inputs from other devices have arrived - ties to the slot with the fewest
steps done, then the lower slot.  The mix planner scores mixes by its
makespan (``tessera plan`` reports the best mix of slot plans).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tessera_actors.plan import Plan
from tessera_actors.planning.costs import CostTable


@dataclass
class Schedule:
    order: list[int]          # slot of every queued segment, in queue order
    steps: list[int]          # whole steps of every slot in it
    makespan_s: float         # estimated seconds until the last segment ends
    busy_s: list[float]       # per device

    @property
    def throughput(self) -> float:
        """Executions of the graph per second over the whole schedule (what
        a run of exactly this queue order measures, tail included)."""
        return sum(self.steps) / self.makespan_s if self.makespan_s > 0 else 0.0


def list_schedule(plans: Sequence[Plan], costs: CostTable | None, total_steps: int | None = None,
                  steps: Sequence[int] | None = None) -> Schedule:
    """Queue order for the slots of ``plans`` (one plan per slot): until
    ``total_steps`` steps are done in all (slots at their own pace), or
    exactly ``steps[m]`` steps of slot ``m``.  Without ``costs`` every
    kernel counts one unit and transfers are free."""
    if (total_steps is None) == (steps is None):
        raise ValueError("give total_steps or steps")
    if steps is not None and len(steps) != len(plans):
        raise ValueError(f"{len(steps)} step counts for {len(plans)} slots")
    ndev = len(plans[0].devices) if plans else 0
    seg_t = []
    xfer_t = []
    for p in plans:
        if costs is None:
            seg_t.append([float(len(s.kernels)) for s in p.segments])
            xfer_t.append({t.tag: 0.0 for t in p.transfers})
        else:
            seg_t.append([sum(costs.times[k][s.device] for k in s.kernels) for s in p.segments])
            xfer_t.append({t.tag: costs.comm_s(t.src, t.dst, t.nbytes) for t in p.transfers})
    sends = [{} for _ in plans]
    for m, p in enumerate(plans):
        for t in p.transfers:
            sends[m].setdefault(t.src_segment, []).append(t)
    free = [0.0] * ndev
    busy = [0.0] * ndev
    pos = [0] * len(plans)                 # next segment index of every slot
    begin = [0.0] * len(plans)             # when the slot's current step may start
    end_of_step = [0.0] * len(plans)
    ready: list[dict[int, float]] = [{} for _ in plans]
    done = [0] * len(plans)
    want = list(steps) if steps is not None else None
    order: list[int] = []
    makespan = 0.0

    def active(m: int) -> bool:
        if not plans[m].segments:
            return False
        return done[m] < want[m] if want is not None else sum(done) < total_steps

    live = [m for m in range(len(plans)) if active(m)]
    while live:
        best, best_t = -1, 0.0
        for m in live:
            s = plans[m].segments[pos[m]]
            t0 = max(free[s.device], begin[m], ready[m].get(s.id, 0.0))
            # ties (both wait for the device to free up) go to the slot with
            # the fewest steps done: a slot that is always ready (a replica)
            # must not starve one whose work hops between devices
            if best < 0 or t0 < best_t - 1e-12 or (t0 <= best_t + 1e-12 and done[m] < done[best]):
                best, best_t = m, t0
        m = best
        s = plans[m].segments[pos[m]]
        end = best_t + seg_t[m][pos[m]]
        free[s.device] = end
        busy[s.device] += seg_t[m][pos[m]]
        end_of_step[m] = max(end_of_step[m], end)
        for t in sends[m].get(s.id, ()):
            ready[m][t.dst_segment] = max(ready[m].get(t.dst_segment, 0.0), end + xfer_t[m][t.tag])
            end_of_step[m] = max(end_of_step[m], end + xfer_t[m][t.tag])
        order.append(m)
        pos[m] += 1
        if pos[m] == len(plans[m].segments):
            pos[m] = 0
            done[m] += 1
            begin[m] = end_of_step[m]
            makespan = max(makespan, end_of_step[m])
            ready[m] = {}
        live = [k for k in live if active(k) or pos[k]]   # a started step is always finished
    return Schedule(order, done, makespan, busy)
