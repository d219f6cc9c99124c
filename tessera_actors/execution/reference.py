"""Run a plan inside one process, device programs interleaved by a policy.

The reference executor: CI soundness checks (random interleavings of the
per-device programs must not change a single bit) and ``tessera check``,
without any actor machinery.  Blocking: runs torch work on the calling
thread.
"""
from __future__ import annotations

import random
from typing import Callable

import torch

from tessera_actors.execution.inputs import assemble_outputs, write_inputs
from tessera_actors.execution.program import AtenProgram
from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan, PlanError


class PlanRunner:
    """One :class:`AtenProgram` per plan device, all in this process.

    ``policy`` picks which runnable device advances next: ``"order"`` (the
    lowest-numbered runnable device) or a ``random.Random`` for random
    interleavings."""

    def __init__(self, graph: KernelGraph, plan: Plan, values: dict[int, torch.Tensor],
                 device_of: Callable[[int], torch.device] = lambda d: torch.device("cpu")) -> None:
        self.graph, self.plan = graph, plan
        self.progs = []
        for d in range(len(plan.devices)):
            p = AtenProgram(graph, device_of(d), plan.resident[d])
            p.load(values)
            self.progs.append(p)
        self.bytes_moved = 0

    def step(self, inputs: dict[str, torch.Tensor], policy: "str | random.Random" = "order") -> list[torch.Tensor]:
        plan = self.plan
        for d, prog in enumerate(self.progs):
            write_inputs(prog, self.graph, inputs, only=plan.inputs[d])
        sent: dict[int, torch.Tensor] = {}
        pcs = [0] * len(self.progs)
        tr = {t.tag: t for t in plan.transfers}
        while True:
            ready = []
            for d, prog in enumerate(plan.programs):
                if pcs[d] < len(prog):
                    st = prog[pcs[d]]
                    if st.op != "recv" or st.ref in sent:
                        ready.append(d)
            if not ready:
                if any(pcs[d] < len(p) for d, p in enumerate(plan.programs)):
                    raise PlanError(f"plan {plan.name!r} deadlocked at program counters {pcs}")
                break
            d = ready[0] if policy == "order" else policy.choice(ready)
            st = plan.programs[d][pcs[d]]
            pcs[d] += 1
            if st.op == "run":
                self.progs[d].run(plan.segments[st.ref].kernels)
            elif st.op == "send":
                t = tr[st.ref]
                sent[t.tag] = self.progs[d].read(t.buffer, t.ranges)
                self.bytes_moved += t.nbytes
            else:
                t = tr[st.ref]
                self.progs[d].write(t.buffer, t.ranges, sent[t.tag])
        pieces = {(b, s, e): self.progs[d].read(b, [(s, e)]) for b, s, e, d in plan.outputs}
        return assemble_outputs(self.graph, pieces)
