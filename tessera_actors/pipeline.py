"""Run a plan on several devices of one process with micro-batch pipelining.

Written once against the device seam (``actors/backends/base.py``): on CUDA
every segment is a CUDA graph replayed on its device's stream for its
micro-batch, cut edges are copies on a communication stream ordered by
events, and the host never waits until the step's end; on CPU the same
calls execute immediately, in the same order.

Per micro-batch ``m`` every device has its own activations, inputs, outputs
and state (a separate request stream); weights are shared.  Earlier
micro-batches get higher stream priority.

Ordering rules for a transfer ``t`` (src segment -> first consumer segment):
1. the copy waits for the producer segment (event on the src compute stream);
2. the copy waits for the last earlier segment on the *destination* that
   touched those bytes (it may still be reading the old contents);
3. the consumer waits for the copy;
4. the next segment on the *source* that overwrites those bytes waits for
   the copy (it would change what is being sent).
Work is enqueued in global segment order, which satisfies every rule on an
immediate (CPU) backend too.
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
from .runner import assemble_outputs, write_inputs


def _overlaps(ranges_a, s: int, e: int) -> bool:
    return any(a < e and s < b for a, b in ranges_a)


class PipelinedExecutor:
    def __init__(self, graph: KernelGraph, plan: Plan, values: dict[int, torch.Tensor],
                 backends: Sequence[DeviceBackend], microbatches: int = 1, capture: bool = True,
                 program_cls: type = AtenProgram) -> None:
        """``program_cls`` runs the graph's kernels (``AtenProgram`` for aten
        captures; a subclass for graphs of generated kernels)."""
        if len(backends) != len(plan.devices):
            raise ValueError(f"{len(backends)} backends for a plan of {len(plan.devices)} devices")
        if microbatches < 1:
            raise ValueError("microbatches must be >= 1")
        self.graph, self.plan, self.backends, self.mb = graph, plan, list(backends), microbatches
        nd = len(backends)
        self.progs: list[list[AtenProgram]] = []
        for d, be in enumerate(backends):
            weights = {b: torch.zeros(max(graph.buffers[b].nbytes, 1), dtype=torch.uint8, device=be.device)
                       for b in plan.resident[d] if graph.buffers[b].role == "weight"}
            for b, t in weights.items():
                if b in values:
                    t[: values[b].numel()].copy_(values[b].reshape(-1))
            row = []
            for m in range(microbatches):
                p = program_cls(graph, be.device, plan.resident[d], shared=weights)
                p.load({b: v for b, v in values.items() if graph.buffers[b].role == "state"})
                row.append(p)
            self.progs.append(row)
        self.compute = [[be.stream(priority=-(microbatches - 1 - m)) for m in range(microbatches)] for be in backends]
        self.comm = [[be.stream(priority=-(microbatches - 1 - m)) for m in range(microbatches)] for be in backends]
        self.runs: list[list[dict[int, object]]] = [[{} for _ in range(microbatches)] for _ in range(nd)]
        for s in plan.segments:
            for m in range(microbatches):
                prog = self.progs[s.device][m]
                for k in s.kernels:
                    prog.bind(k)
                self.runs[s.device][m][s.id] = (lambda prog=prog, ks=s.kernels: prog.run(ks))
        self._derive_guards()
        if capture:
            # One eager step in program order, transfers included, so every
            # kernel has met valid inputs (reused slots hold stale bytes of
            # other values until the transfer lands) before graphs are
            # captured; then undo what it did to the state.
            self._eager_step()
            state = {b: v for b, v in values.items() if graph.buffers[b].role == "state"}
            for row in self.progs:
                for p in row:
                    p.load(state)
            for s in plan.segments:
                be = backends[s.device]
                for m in range(microbatches):
                    fn = self.runs[s.device][m][s.id]
                    self.runs[s.device][m][s.id] = be.replayable(fn, self.compute[s.device][m], warmup=False)
            self.synchronize()
        self.step_count = 0

    def _derive_guards(self) -> None:
        """Rules 2 and 4 of the module docstring, as segment ids.  Steps
        follow each other without a host wait, so the search wraps around:
        a guard found past the end belongs to the previous (rule 2) or next
        (rule 4) step."""
        plan, g = self.plan, self.graph
        segs = plan.segments
        n = len(segs)
        touches: dict[int, list[tuple[int, int, int, str]]] = defaultdict(list)
        for s in segs:
            for k in s.kernels:
                for a in g.kernels[k].accesses:
                    touches[s.id].append((a.buffer, a.start, a.end, a.mode))

        def hits(sid: int, t, write_only: bool) -> bool:
            return any(b == t.buffer and (not write_only or "w" in mode) and _overlaps(t.ranges, st, en)
                       for b, st, en, mode in touches[sid])
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
        self._seg_done: dict[tuple[int, int], object] = {}          # latest event per (segment, m)
        self._carry: dict[tuple[int, int], list] = defaultdict(list)  # waits for the next step

    def _eager_step(self) -> None:
        plan = self.plan
        by_src: dict[int, list] = defaultdict(list)
        for t in plan.transfers:
            by_src[t.src_segment].append(t)
        for s in plan.segments:
            be = self.backends[s.device]
            for m in range(self.mb):
                be.run_on(self.compute[s.device][m], self.runs[s.device][m][s.id])
                be.synchronize()
                for t in by_src[s.id]:
                    src, dst = self.progs[s.device][m].arena[t.buffer], self.progs[t.dst][m].arena[t.buffer]
                    for a, b in t.ranges:
                        dst[a:b].copy_(src[a:b])
                be.synchronize()
        self.synchronize()

    def enqueue(self, inputs: Sequence[dict[str, torch.Tensor]] | None = None) -> None:
        """Queue one step for every micro-batch (inputs per micro-batch, or
        None to reuse the inputs already in place). Does not wait."""
        plan, mb = self.plan, self.mb
        if inputs is not None:
            if len(inputs) != mb:
                raise ValueError(f"{len(inputs)} input sets for {mb} micro-batches")
            for d, be in enumerate(self.backends):
                if plan.inputs[d]:
                    for m in range(mb):
                        be.run_on(self.compute[d][m],
                                  lambda p=self.progs[d][m], i=inputs[m], f=plan.inputs[d]: write_inputs(p, self.graph, i, f))
        by_src: dict[int, list] = defaultdict(list)
        by_dst: dict[int, list] = defaultdict(list)
        for t in plan.transfers:
            by_src[t.src_segment].append(t)
            by_dst[t.dst_segment].append(t)
        waits_before, self._carry = self._carry, defaultdict(list)   # (segment, m) -> events
        seg_done = self._seg_done
        for s in plan.segments:
            d, be = s.device, self.backends[s.device]
            for m in range(mb):
                cs = self.compute[d][m]
                for ev in waits_before.pop((s.id, m), []):
                    be.wait(cs, ev)
                self.runs[d][m][s.id]()
                if s.id in self.guard_segments:
                    seg_done[(s.id, m)] = be.record(cs)
                if not by_src[s.id]:
                    continue
                produced = be.record(cs)
                comm = self.comm[d][m]
                be.wait(comm, produced)
                for t in by_src[s.id]:
                    guard = seg_done.get((self.dst_guard.get(t.tag, -1), m))
                    if guard is not None:
                        be.wait(comm, guard)
                    src, dst = self.progs[d][m].arena[t.buffer], self.progs[t.dst][m].arena[t.buffer]
                    for a, b in t.ranges:
                        be.copy(comm, dst[a:b], src[a:b])
                done = be.record(comm)
                for t in by_src[s.id]:
                    waits_before[(t.dst_segment, m)].append(done)
                    if t.tag in self.src_guard:
                        g_id = self.src_guard[t.tag]
                        (waits_before if g_id > s.id else self._carry)[(g_id, m)].append(done)
        self.step_count += 1

    def allocated_bytes(self) -> list[int]:
        """Bytes of plan buffers held on each device: shared weights once,
        everything else once per micro-batch."""
        out = []
        for d, row in enumerate(self.progs):
            weights = sum(self.graph.buffers[b].nbytes for b in self.plan.resident[d]
                          if self.graph.buffers[b].role == "weight")
            out.append(weights + sum(p.nbytes for p in row))
        return out

    def synchronize(self) -> None:
        for be in self.backends:
            be.synchronize()

    def outputs(self) -> list[list[torch.Tensor]]:
        """The outputs of the last step, per micro-batch (after synchronize)."""
        res = []
        for m in range(self.mb):
            pieces = {(b, s, e): self.progs[dev][m].arena[b][s:e] for b, s, e, dev in self.plan.outputs}
            res.append(assemble_outputs(self.graph, pieces))
        return res

    def step(self, inputs: Sequence[dict[str, torch.Tensor]]) -> list[list[torch.Tensor]]:
        self.enqueue(inputs)
        self.synchronize()
        return self.outputs()

    def time_steps(self, n: int, warmup: int = 3) -> float:
        """Mean seconds per step (all micro-batches) over ``n`` steps with the
        inputs in place."""
        for _ in range(warmup):
            self.enqueue()
        self.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            self.enqueue()
        self.synchronize()
        return (time.perf_counter() - t0) / n
