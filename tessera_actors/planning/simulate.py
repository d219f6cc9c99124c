"""Discrete-event simulation of a plan's per-device programs.

Model (the contract predictions are made under):

* every device executes, for every micro-batch, its program (``Plan.programs``)
  in order; ``run`` occupies the device for the segment's time (the sum of
  its kernels' times in the cost table), one segment at a time, never
  preempted; ``send`` enqueues a transfer and costs the device nothing;
  ``recv`` waits until the transfer arrived and costs nothing;
* a transfer occupies its link direction ``src -> dst`` for ``latency +
  bytes / bandwidth`` and arrives at the end of it; links are full duplex,
  one transfer at a time per direction;
* when a device or link is free and several micro-batches are ready, the
  earliest micro-batch goes first (stream priorities);
* at most ``inflight`` micro-batches are in flight: micro-batch ``i`` starts
  when micro-batch ``i - inflight`` has finished everywhere.

:func:`simulate` returns the step time (latency of one micro-batch alone),
the steady-state throughput (micro-batches per second, each micro-batch one
execution of the graph), per-device busy fractions and the event timeline.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from tessera_actors.plan import Plan, PlanError
from tessera_actors.planning.costs import CostTable


@dataclass
class Event:
    resource: str      # device name or "a->b" link
    kind: str          # "run" | "xfer"
    item: int
    start: float
    end: float
    ref: int           # segment id or transfer tag


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


def run_programs(plan: Plan, costs: CostTable, items: int, inflight: int,
                 record: bool = False) -> tuple[list[float], list[float], list[float], list[Event]]:
    """Simulate ``items`` micro-batches; returns (start, finish) time per item,
    per-device busy seconds and, with ``record``, the events.  Micro-batches
    are admitted in order."""
    if inflight < 1:
        raise PlanError(f"inflight must be >= 1, got {inflight}")
    ndev = len(plan.devices)
    seg_t = segment_times(plan, costs)
    xfer = {t.tag: (t.src, t.dst, costs.comm_s(t.src, t.dst, t.nbytes)) for t in plan.transfers}
    progs = [[(st.op, st.ref) for st in prog] for prog in plan.programs]
    plen = [len(p) for p in progs]
    ptr = [[0] * items for _ in range(ndev)]
    start = [0.0] * items
    finish = [-1.0] * items
    left = [sum(1 for d in range(ndev) if plen[d]) for _ in range(items)]
    arrived: set[tuple[int, int]] = set()
    running = [0] * ndev          # 1 + the micro-batch whose segment runs; 0: idle
    ready: list[list[int]] = [[] for _ in range(ndev)]      # heaps of items whose next step is a run
    queued = [[False] * items for _ in range(ndev)]
    busy = [0.0] * ndev
    link_busy: dict[tuple[int, int], bool] = {}
    link_queue: dict[tuple[int, int], list[tuple[int, int]]] = {}
    events: list[Event] = []
    heap: list[tuple[float, int, int, int, int]] = []      # (time, seq, kind 0=done 1=arrive, a, b)
    seq = 0
    admitted = 0

    def push(t: float, kind: int, a: int, b: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, a, b))
        seq += 1

    def start_link(key: tuple[int, int], now: float) -> None:
        q = link_queue.get(key)
        if not q or link_busy.get(key):
            return
        item, tag = heapq.heappop(q)
        dur = xfer[tag][2]
        link_busy[key] = True
        push(now + dur, 1, item, tag)
        if record:
            events.append(Event(f"{plan.devices[key[0]]}->{plan.devices[key[1]]}", "xfer", item, now, now + dur, tag))

    def step_item(d: int, i: int, now: float) -> None:
        """Zero-time steps of micro-batch i on device d."""
        if queued[d][i] or running[d] == i + 1:
            return
        prog, p = progs[d], ptr[d][i]
        while p < plen[d]:
            op, ref = prog[p]
            if op == "send":
                key = xfer[ref][:2]
                heapq.heappush(link_queue.setdefault(key, []), (i, ref))
                start_link(key, now)
            elif op == "recv":
                if (i, ref) not in arrived:
                    break
            else:
                heapq.heappush(ready[d], i)
                queued[d][i] = True
                break
            p += 1
        ptr[d][i] = p
        if p == plen[d] and p:
            left[i] -= 1
            if left[i] == 0:
                finish[i] = now
                admit(now)

    def try_run(d: int, now: float) -> None:
        if running[d] or not ready[d]:
            return
        i = heapq.heappop(ready[d])
        queued[d][i] = False
        sid = progs[d][ptr[d][i]][1]
        dur = seg_t[sid]
        running[d] = i + 1
        busy[d] += dur
        push(now + dur, 0, d, i)
        if record:
            events.append(Event(plan.devices[d], "run", i, now, now + dur, sid))

    def admit(now: float) -> None:
        nonlocal admitted
        while admitted < items and (admitted < inflight or finish[admitted - inflight] >= 0):
            i = admitted
            admitted += 1
            start[i] = now
            if left[i] == 0:
                finish[i] = now
            for d in range(ndev):
                step_item(d, i, now)
                try_run(d, now)

    admit(0.0)
    while heap:
        now, _, kind, a, b = heapq.heappop(heap)
        if kind == 0:
            d, i = a, b
            running[d] = 0
            ptr[d][i] += 1
            step_item(d, i, now)
        else:
            i, tag = a, b
            src, d, _ = xfer[tag]
            arrived.add((i, tag))
            link_busy[(src, d)] = False
            start_link((src, d), now)
            step_item(d, i, now)
        for dd in range(ndev):
            try_run(dd, now)
    if any(f < 0 for f in finish):
        raise PlanError(f"plan {plan.name!r} deadlocks in simulation (a recv without its send)")
    return start, finish, busy, events


def simulate(plan: Plan, costs: CostTable, inflight: int | None = None, items: int | None = None,
             record: bool = False) -> Prediction:
    """Predict ``plan`` (see module docstring). ``inflight`` defaults to
    ``plan.microbatches``; ``items`` (micro-batches simulated for the steady
    state) to ``max(8, 4 * inflight)``; the first quarter is warm-up."""
    m = inflight or plan.microbatches or 1
    n = items or max(16, 8 * m)
    _, one, _, ev1 = run_programs(plan, costs, 1, 1, record=record and m == 1)
    step = one[0]
    if m == 1:
        # One at a time: every micro-batch repeats the first exactly.
        busy1 = [sum(e.end - e.start for e in ev1 if e.resource == dev) for dev in plan.devices] \
            if record else [sum(t for s, t in zip(plan.segments, segment_times(plan, costs)) if s.device == d)
                            for d in range(len(plan.devices))]
        thr = float("inf") if step == 0 else 1.0 / step
        return Prediction(step, thr, step, [b / step if step else 0.0 for b in busy1], 1, ev1)
    st, fin, busy, ev = run_programs(plan, costs, n, m, record=record)
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


