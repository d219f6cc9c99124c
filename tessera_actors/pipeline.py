"""Run a plan on several devices of one process with micro-batch pipelining.

Written once against the device seam (``actors/backends/base.py``): on CUDA
every segment is a CUDA graph replayed on its device's stream for its
micro-batch, cut edges are copies on a communication stream ordered by
events, and the host never waits until the step's end; on CPU the same
calls execute immediately, in the same order.

Per micro-batch ``m`` every device has its own activations, inputs, outputs
and state (a separate request stream); weights are shared.  By default the
slots share one compute and one communication stream per device, and their
segments are queued in the order of a list schedule
(:mod:`tessera_actors.planning.schedule`), which is then each device's
execution order; ``streams="slot"`` gives every slot its own streams,
earlier slots at higher priority.  Each micro-batch slot may have a plan of
its own (``plans`` given as a list): Request Distribution is the mix of
one-device plans, and kernel-level plans mix with them.

Ordering rules for a transfer ``t`` (src segment -> first consumer segment):
1. the copy waits for the producer segment (event on the src compute stream);
2. the copy waits for the last earlier segment on the *destination* that
   touched those bytes (it may still be reading the old contents);
3. the consumer waits for the copy;
4. the next segment on the *source* that overwrites those bytes waits for
   the copy (it would change what is being sent).
Every slot's segments are queued in its plan's order (slots interleave),
so each event is recorded before it is waited for, and every rule holds on
an immediate (CPU) backend too.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Sequence

import torch

from actors.backends.aten import AtenProgram
from actors.backends.base import DeviceBackend
from .graph import KernelGraph
from .plan import Plan
from .planning.schedule import Schedule, list_schedule
from .runner import assemble_outputs, write_inputs


def _overlaps(ranges_a, s: int, e: int) -> bool:
    return any(a < e and s < b for a, b in ranges_a)


class _Slot:
    """One micro-batch slot: its plan and the ordering facts derived from it."""

    def __init__(self, graph: KernelGraph, plan: Plan) -> None:
        self.plan = plan
        self.by_src: dict[int, list] = defaultdict(list)
        for t in plan.transfers:
            self.by_src[t.src_segment].append(t)
        segs = plan.segments
        n = len(segs)
        touches: dict[int, list[tuple[int, int, int, str]]] = defaultdict(list)
        for s in segs:
            for k in s.kernels:
                for a in graph.kernels[k].accesses:
                    touches[s.id].append((a.buffer, a.start, a.end, a.mode))

        def hits(sid: int, t, write_only: bool) -> bool:
            return any(b == t.buffer and (not write_only or "w" in mode) and _overlaps(t.ranges, st, en)
                       for b, st, en, mode in touches[sid])
        # Rules 2 and 4 as segment ids.  Steps follow each other without a
        # host wait, so the search wraps around: a guard found past the end
        # belongs to the previous (rule 2) or the next (rule 4) step.
        self.dst_guard: dict[int, int] = {}
        self.src_guard: dict[int, int] = {}
        for t in plan.transfers:
            for i in range(1, n + 1):
                s = segs[(t.src_segment - i) % n]
                if s.device == t.dst and hits(s.id, t, False):
                    self.dst_guard[t.tag] = s.id
                    break
            for i in range(1, n + 1):
                s = segs[(t.src_segment + i) % n]
                if s.device == t.src and hits(s.id, t, True):
                    self.src_guard[t.tag] = s.id
                    break
        self.guard_segments = set(self.dst_guard.values())
        self.seg_done: dict[int, object] = {}               # latest event per guard segment
        self.carry: dict[int, list] = defaultdict(list)     # waits for the next step


class PipelinedExecutor:
    def __init__(self, graph: KernelGraph, plan: Plan | Sequence[Plan], values: dict[int, torch.Tensor],
                 backends: Sequence[DeviceBackend], microbatches: int = 1, capture: bool = True,
                 program_cls: type = AtenProgram, streams: str = "device", costs=None) -> None:
        """``plan`` is one plan for every micro-batch, or a list with one
        plan per micro-batch slot (``microbatches`` is then its length); all
        over the same devices.  ``program_cls`` runs the graph's kernels
        (``AtenProgram`` for aten captures; a subclass for generated kernels).
        ``streams``: ``"device"`` - one compute and one communication stream
        per device, shared by every slot, so a device runs its segments one
        at a time in the order they were queued (concurrent segments of
        different slots on one GPU share its SMs, finish together and stall
        the pipeline); ``"slot"`` - a stream pair per slot and device, earlier
        slots at higher priority (segments of different slots may overlap)."""
        self.costs = costs   # a CostTable over these devices: orders the segments of several slots
        self._orders: dict[tuple[int, ...], list[int]] = {}
        if streams not in ("device", "slot"):
            raise ValueError(f"streams must be 'device' or 'slot', not {streams!r}")
        plans = list(plan) if isinstance(plan, (list, tuple)) else [plan] * microbatches
        if not plans or microbatches < 1:
            raise ValueError("microbatches must be >= 1")
        devices = plans[0].devices
        if any(p.devices != devices for p in plans):
            raise ValueError("the plans of a mix must be over the same devices")
        if len(backends) != len(devices):
            raise ValueError(f"{len(backends)} backends for a plan of {len(devices)} devices")
        self.graph, self.backends, self.mb = graph, list(backends), len(plans)
        self.plans = plans
        self.plan = plans[0]
        mb = self.mb
        self.slots = [_Slot(graph, p) for p in plans]
        self.progs: list[list[AtenProgram]] = []
        self.weight_bytes: list[int] = []
        state = {b: v for b, v in values.items() if graph.buffers[b].role == "state"}
        for d, be in enumerate(backends):
            wanted = sorted({b for p in plans for b in p.resident[d] if graph.buffers[b].role == "weight"})
            weights = {b: torch.zeros(max(graph.buffers[b].nbytes, 1), dtype=torch.uint8, device=be.device)
                       for b in wanted}
            for b, t in weights.items():
                if b in values:
                    t[: values[b].numel()].copy_(values[b].reshape(-1))
            self.weight_bytes.append(sum(graph.buffers[b].nbytes for b in wanted))
            row = []
            for m in range(mb):
                p = program_cls(graph, be.device, plans[m].resident[d], shared=weights)
                p.load(state)
                row.append(p)
            self.progs.append(row)
        if streams == "slot":
            self.compute = [[be.stream(priority=-(mb - 1 - m)) for m in range(mb)] for be in backends]
            self.comm = [[be.stream(priority=-(mb - 1 - m)) for m in range(mb)] for be in backends]
        else:
            self.compute = [[be.stream()] * mb for be in backends]
            self.comm = [[be.stream()] * mb for be in backends]
        self.streams = streams
        self.runs: list[dict[int, object]] = [{} for _ in range(mb)]   # per slot: segment -> callable
        for m, p in enumerate(plans):
            for s in p.segments:
                prog = self.progs[s.device][m]
                for k in s.kernels:
                    prog.bind(k)
                self.runs[m][s.id] = (lambda prog=prog, ks=s.kernels: prog.run(ks))
        if capture:
            # One eager step in program order, transfers included, so every
            # kernel has met valid inputs (reused slots hold stale bytes of
            # other values until the transfer lands) before graphs are
            # captured; then undo what it did to the state.
            self._eager_step()
            for row in self.progs:
                for prog in row:
                    prog.load(state)
            for m, p in enumerate(plans):
                for s in p.segments:
                    be = backends[s.device]
                    self.runs[m][s.id] = be.replayable(self.runs[m][s.id], self.compute[s.device][m], warmup=False)
            self.synchronize()
        self.step_count = 0

    def _eager_step(self) -> None:
        for m, slot in enumerate(self.slots):
            for s in slot.plan.segments:
                be = self.backends[s.device]
                with be.scope():   # a partition's lazily loaded kernels go into its own context
                    be.run_on(self.compute[s.device][m], self.runs[m][s.id])
                be.synchronize()
                for t in slot.by_src[s.id]:
                    src, dst = self.progs[s.device][m].arena[t.buffer], self.progs[t.dst][m].arena[t.buffer]
                    for a, b in t.ranges:
                        dst[a:b].copy_(src[a:b])
                be.synchronize()
        self.synchronize()

    def enqueue(self, inputs: Sequence[dict[str, torch.Tensor]] | None = None,
                slots: Sequence[int] | None = None) -> None:
        """Queue one step for every micro-batch slot, or for ``slots`` only
        (slots are independent request streams: they need not step
        together).  ``inputs`` per slot, or None to reuse the inputs already
        in place; given with ``slots``, one input set per chosen slot).
        Does not wait."""
        mb = self.mb
        chosen = list(range(mb) if slots is None else slots)
        if inputs is not None:
            if len(inputs) != len(chosen):
                raise ValueError(f"{len(inputs)} input sets for {len(chosen)} micro-batch slots")
            for m, inp in zip(chosen, inputs):
                slot = self.slots[m]
                for d, be in enumerate(self.backends):
                    feed = slot.plan.inputs[d]
                    if feed:
                        be.run_on(self.compute[d][m],
                                  lambda p=self.progs[d][m], i=inp, f=feed: write_inputs(p, self.graph, i, f))
        key = tuple(chosen)
        order = self._orders.get(key)
        if order is None:   # one step of these slots is queued the same way every time
            sched = list_schedule([self.slots[m].plan for m in chosen], self.costs, steps=[1] * len(chosen))
            order = self._orders[key] = [chosen[i] for i in sched.order]
        self.run_order(order)
        self.step_count += 1

    def _slot_step(self, m: int):
        """Queue one step of slot ``m``, a segment (with its sends) at a
        time: yields each segment before queueing it, so the caller decides
        how the segments of different slots interleave on shared streams."""
        slot = self.slots[m]
        waits_before = None
        for s in slot.plan.segments:
            yield s
            if waits_before is None:   # taken when the step's first segment is queued, not before
                waits_before, slot.carry = slot.carry, defaultdict(list)   # segment -> events
            d, be = s.device, self.backends[s.device]
            cs = self.compute[d][m]
            for ev in waits_before.pop(s.id, []):
                be.wait(cs, ev)
            self.runs[m][s.id]()
            if s.id in slot.guard_segments:
                slot.seg_done[s.id] = be.record(cs)
            sends = slot.by_src[s.id]
            if not sends:
                continue
            comm = self.comm[d][m]
            be.wait(comm, be.record(cs))
            for t in sends:
                guard = slot.seg_done.get(slot.dst_guard.get(t.tag, -1))
                if guard is not None:
                    be.wait(comm, guard)
                src, dst = self.progs[d][m].arena[t.buffer], self.progs[t.dst][m].arena[t.buffer]
                for a, b in t.ranges:
                    be.copy(comm, dst[a:b], src[a:b])
            done = be.record(comm)
            for t in sends:
                waits_before[t.dst_segment].append(done)
                if t.tag in slot.src_guard:
                    g_id = slot.src_guard[t.tag]
                    (waits_before if g_id > s.id else slot.carry)[g_id].append(done)

    def _slot_steps(self, m: int):
        while True:
            yield from self._slot_step(m)

    def run_order(self, order: Sequence[int]) -> None:
        """Queue segments slot by slot in ``order`` (a slot id per segment,
        e.g. ``list_schedule(...).order``): each entry queues the next
        segment of that slot, its steps following each other.  On streams a
        device shares, this order is the device's execution order.  Does not
        wait."""
        gens = {}
        for m in order:
            g = gens.get(m)
            if g is None:
                g = gens[m] = self._slot_steps(m)
                next(g)
            next(g)
        for g in gens.values():   # each stops before a segment, before any side effect
            g.close()

    def allocated_bytes(self) -> list[int]:
        """Bytes of plan buffers held on each device: shared weights once,
        everything else once per micro-batch."""
        return [self.weight_bytes[d] + sum(p.nbytes for p in row) for d, row in enumerate(self.progs)]

    def synchronize(self) -> None:
        for be in self.backends:
            be.synchronize()

    def outputs(self) -> list[list[torch.Tensor]]:
        """The outputs of the last step, per micro-batch (after synchronize)."""
        res = []
        for m, slot in enumerate(self.slots):
            pieces = {(b, s, e): self.progs[dev][m].arena[b][s:e] for b, s, e, dev in slot.plan.outputs}
            res.append(assemble_outputs(self.graph, pieces))
        return res

    def step(self, inputs: Sequence[dict[str, torch.Tensor]]) -> list[list[torch.Tensor]]:
        self.enqueue(inputs)
        self.synchronize()
        return self.outputs()

    def time_steps(self, n: int, warmup: int = 3) -> float:
        """Mean seconds per step (all micro-batches) over ``n`` steps with the
        inputs in place; several slots are queued as one list schedule of
        all ``n`` steps (no barrier between steps)."""
        for _ in range(warmup):
            self.enqueue()
        self.synchronize()
        t0 = time.perf_counter()
        if self.mb == 1:
            for _ in range(n):
                self.enqueue()
        else:
            self.run_order(list_schedule(self.plans, self.costs, steps=[n] * self.mb).order)
            self.step_count += n
        self.synchronize()
        return (time.perf_counter() - t0) / n

    def time_slots(self, steps: Sequence[int] | Schedule, warmup: int = 2) -> float:
        """Seconds to run ``steps[m]`` steps of every slot ``m``, each slot
        at its own pace, queued in the order of :func:`list_schedule` (or
        of the given schedule), one wait at the end: how a mix serves
        independent request streams."""
        if isinstance(steps, Schedule):
            sched = steps
            if len(sched.steps) != self.mb:
                raise ValueError(f"a schedule of {len(sched.steps)} slots for {self.mb} slots")
        else:
            if len(steps) != self.mb:
                raise ValueError(f"{len(steps)} step counts for {self.mb} slots")
            sched = list_schedule(self.plans, self.costs, steps=list(steps))
        for _ in range(warmup):
            self.enqueue()
        self.synchronize()
        t0 = time.perf_counter()
        self.run_order(sched.order)
        self.synchronize()
        return time.perf_counter() - t0
