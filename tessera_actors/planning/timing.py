"""The one step-time model: a discrete-event simulation of per-device programs.

Every prediction of how long work takes on shared devices comes from here:
:func:`~tessera_actors.planning.simulate.simulate` (a plan with micro-batches
in flight: the planners, ``tessera plan``'s timeline) and
:meth:`~tessera_actors.planning.offload.model.Offload.simulate` (the offload
planner's step, whose streamed weights are copies on the GPU's copy engine)
are two ways of writing :class:`Programs` for :func:`run`.

The model (the contract predictions are made under):

* a *job* is one set of per-device programs and its *slots* (how many of its
  micro-batches may be in flight); several jobs may share the devices.  A
  micro-batch of a job is admitted when the one ``slots`` before it (of the
  same job) has finished everywhere; admitted micro-batches are numbered in
  admission order and the earlier goes first wherever several are ready;
* ``run`` occupies its device for the segment's seconds, one segment at a
  time, never preempted;
* ``send`` costs the device nothing and queues a transfer on the transfer's
  *channel* (a link direction ``src -> dst``, or a device's copy engine);
  a channel carries one transfer at a time, for its seconds, and the
  transfer arrives at the end; ``recv`` waits until it has arrived;
* a micro-batch finishes when every device's program for it has ended.

Pure Python; no torch.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from tessera_actors.plan import PlanError


@dataclass
class Event:
    resource: str      # device name, "a->b" link, or a copy engine
    kind: str          # "run" | "xfer"
    item: int
    start: float
    end: float
    ref: int           # segment id or transfer tag


@dataclass
class Programs:
    """What one micro-batch of a job does, per device: ``programs[d]`` is a
    list of ``(op, ref)`` with op ``run`` (ref: a segment, ``seconds[ref]``
    long) or ``send`` / ``recv`` (ref: a transfer tag).  ``transfers[tag]`` is
    ``(channel, receiving device, seconds)``; ``names`` names the devices and
    channels in recorded events."""
    programs: list[list[tuple[str, int]]]
    seconds: list[float]
    transfers: dict[int, tuple[Hashable, int, float]]
    names: dict = field(default_factory=dict)


@dataclass
class Run:
    """What :func:`run` returns: per admitted micro-batch (admission order) its
    job, start and finish; per device its busy seconds; the events when
    recorded."""
    job: list[int]
    start: list[float]
    finish: list[float]
    busy: list[float]
    events: list[Event]


class _Sim:
    """The event loop of :func:`run` (state of one simulation).

    Hot loop, so plain lists and ints: programs as ``(op, ref)`` with op 0
    run, 1 send, 2 recv and transfers renumbered densely per job; channels
    numbered; a transfer of micro-batch ``i`` is ``i * width + tag`` in the
    channel queues and the arrived set.  After an event only the device it
    concerns can newly start a segment (every other one is running or has
    nothing ready), so only that device is tried."""

    def __init__(self, jobs: Sequence[tuple[Programs, int]], items: Sequence[int], record: bool) -> None:
        self.jobs, self.items, self.record = list(jobs), list(items), record
        self.ndev = max(len(p.programs) for p, _ in self.jobs)
        chan: dict[Hashable, int] = {}
        self.progs, self.xchan, self.xdst, self.xdur, self.xtag = [], [], [], [], []
        for p, _ in self.jobs:
            tags = list(p.transfers)
            dense = {t: n for n, t in enumerate(tags)}
            ops = {"run": 0, "send": 1, "recv": 2}
            progs = [[(ops[op], ref if op == "run" else dense[ref]) for op, ref in prog] for prog in p.programs]
            self.progs.append(progs + [[] for _ in range(self.ndev - len(progs))])
            self.xchan.append([chan.setdefault(p.transfers[t][0], len(chan)) for t in tags])
            self.xdst.append([p.transfers[t][1] for t in tags])
            self.xdur.append([p.transfers[t][2] for t in tags])
            self.xtag.append(tags)
        self.chan_key = list(chan)
        self.width = max(1, max(len(t) for t in self.xtag))
        self.job: list[int] = []          # per admitted micro-batch
        self.ptr: list[list[int]] = [[] for _ in range(self.ndev)]
        self.start: list[float] = []
        self.finish: list[float] = []
        self.left: list[int] = []
        self.queued: list[list[bool]] = [[] for _ in range(self.ndev)]
        self.admitted = [0] * len(self.jobs)
        self.first: list[list[int]] = [[] for _ in self.jobs]   # per job, its micro-batches' numbers
        self.arrived: set[int] = set()
        self.running = [0] * self.ndev    # 1 + the micro-batch whose segment runs; 0: idle
        self.ready: list[list[int]] = [[] for _ in range(self.ndev)]
        self.busy = [0.0] * self.ndev
        self.chan_busy = [False] * len(chan)
        self.chan_queue: list[list[int]] = [[] for _ in chan]
        self.events: list[Event] = []
        self.heap: list[tuple[float, int, int, int, int]] = []   # (time, seq, kind 0=done 1=arrive, a, b)
        self.seq = 0

    def start_channel(self, c: int, now: float) -> None:
        q = self.chan_queue[c]
        if not q or self.chan_busy[c]:
            return
        i, t = divmod(heapq.heappop(q), self.width)
        j = self.job[i]
        dur = self.xdur[j][t]
        self.chan_busy[c] = True
        heapq.heappush(self.heap, (now + dur, self.seq, 1, i, t))
        self.seq += 1
        if self.record:
            key = self.chan_key[c]
            self.events.append(Event(self.jobs[j][0].names.get(key, str(key)), "xfer", i, now, now + dur,
                                     self.xtag[j][t]))

    def step_item(self, d: int, i: int, now: float) -> None:
        """Zero-time steps of micro-batch ``i`` on device ``d``."""
        if self.queued[d][i] or self.running[d] == i + 1:
            return
        j = self.job[i]
        prog = self.progs[j][d]
        n, at = len(prog), self.ptr[d][i]
        base = i * self.width
        while at < n:
            op, ref = prog[at]
            if op == 1:
                c = self.xchan[j][ref]
                heapq.heappush(self.chan_queue[c], base + ref)
                self.start_channel(c, now)
            elif op == 2:
                if base + ref not in self.arrived:
                    break
            else:
                heapq.heappush(self.ready[d], i)
                self.queued[d][i] = True
                break
            at += 1
        self.ptr[d][i] = at
        if at == n and at:
            self.left[i] -= 1
            if self.left[i] == 0:
                self.finish[i] = now
                self.admit(now)

    def try_run(self, d: int, now: float) -> None:
        if self.running[d] or not self.ready[d]:
            return
        i = heapq.heappop(self.ready[d])
        self.queued[d][i] = False
        j = self.job[i]
        sid = self.progs[j][d][self.ptr[d][i]][1]
        dur = self.jobs[j][0].seconds[sid]
        self.running[d] = i + 1
        self.busy[d] += dur
        heapq.heappush(self.heap, (now + dur, self.seq, 0, d, i))
        self.seq += 1
        if self.record:
            self.events.append(Event(self.jobs[j][0].names.get(d, str(d)), "run", i, now, now + dur, sid))

    def admit(self, now: float) -> None:
        for j, (_, slots) in enumerate(self.jobs):
            mine = self.first[j]
            while self.admitted[j] < self.items[j] and (
                    self.admitted[j] < slots or self.finish[mine[self.admitted[j] - slots]] >= 0):
                self.admitted[j] += 1
                i = len(self.job)
                mine.append(i)
                self.job.append(j)
                self.start.append(now)
                self.finish.append(-1.0)
                self.left.append(sum(1 for prog in self.progs[j] if prog))
                for d in range(self.ndev):
                    self.ptr[d].append(0)
                    self.queued[d].append(False)
                if self.left[i] == 0:
                    self.finish[i] = now
                for d in range(self.ndev):
                    self.step_item(d, i, now)
                    self.try_run(d, now)

    def loop(self) -> None:
        self.admit(0.0)
        heap, pop, running, ptr = self.heap, heapq.heappop, self.running, self.ptr
        step_item, try_run, start_channel = self.step_item, self.try_run, self.start_channel
        xchan, xdst, job, arrived, chan_busy, width = self.xchan, self.xdst, self.job, self.arrived, \
            self.chan_busy, self.width
        while heap:
            now, _, kind, a, b = pop(heap)
            if kind == 0:
                d, i = a, b
                running[d] = 0
                ptr[d][i] += 1
            else:
                i, t = a, b
                j = job[i]
                c, d = xchan[j][t], xdst[j][t]
                arrived.add(i * width + t)
                chan_busy[c] = False
                start_channel(c, now)
            step_item(d, i, now)
            try_run(d, now)


def run(jobs: Sequence[tuple[Programs, int]], items: Sequence[int], record: bool = False, name: str = "") -> Run:
    """Simulate ``items[j]`` micro-batches of each job ``(programs, slots)``
    (see the module docstring); ``PlanError`` when a slot is < 1 or the
    programs deadlock (a ``recv`` whose ``send`` never comes; ``name``: the
    plan's, for the message)."""
    for _, slots in jobs:
        if slots < 1:
            raise PlanError(f"inflight must be >= 1, got {slots}")
    sim = _Sim(jobs, items, record)
    sim.loop()
    if len(sim.job) < sum(items) or any(f < 0 for f in sim.finish):
        raise PlanError(f"plan {name!r} deadlocks in simulation (a recv without its send)")
    return Run(sim.job, sim.start, sim.finish, sim.busy, sim.events)


__all__ = ["Event", "Programs", "Run", "run"]
