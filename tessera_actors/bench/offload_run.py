"""Running offload plans on device actors: deploy a plan (one device actor
per plan device, in one actor system), step it, decode greedily, and feed
what the devices measured back into the planner (load-aware re-planning).

Contract: :func:`deploy` spawns a transfer actor and the device actors
(names ``{prefix}transfer``, ``{prefix}device{i}``), installs the plan and
loads the values each device holds (streamed weights go to their host homes);
:meth:`Deployed.step` sends one ``RunStep`` per device and returns the
outputs and every device's ``StepDone``; :func:`adapt` rescales the rates of
a device that ran slower (or faster) than the step model predicted."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Sequence

import msgpack
import torch

from actors.device import DeviceActor
from actors.transfer import TransferActor
from tessera_actors.devices import DeviceSpec
from tessera_actors.graph import KernelGraph
from tessera_actors.runtime.messages import InstallPlan, LoadValues, Routes, RunStep, StepDone, Uninstall
from tessera_actors.plan import Plan, plan_to_dict
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.offload import Offload, Placement
from tessera_actors.execution.inputs import assemble_outputs


@dataclass
class Deployed:
    graph: KernelGraph
    plan: Plan
    plan_id: str
    refs: list
    timeout: float = 600.0
    steps: int = 0
    busy_s: list[float] = field(default_factory=list)   # per device, summed over steps
    wall_s: float = 0.0
    counted: int = 0                                     # steps in busy_s / wall_s
    installed: list = field(default_factory=list)        # each device's Installed (nbytes: its allocation)

    async def step(self, inputs: dict[str, torch.Tensor], outputs: bool = True
                   ) -> tuple[list[torch.Tensor], list[StepDone]]:
        step = self.steps
        self.steps += 1
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        done = await asyncio.gather(*(ref.ask(RunStep(self.plan_id, step, inputs if self.plan.inputs[d] else {},
                                                      outputs=outputs), timeout=self.timeout)
                                      for d, ref in enumerate(self.refs)))
        self.wall_s += loop.time() - t0
        self.counted += 1
        if not self.busy_s:
            self.busy_s = [0.0] * len(self.refs)
        for d, r in enumerate(done):
            self.busy_s[d] += r.busy_s
        pieces = {(b, s, e): data for r in done for (b, s, e), data in zip(r.ranges, r.data)}
        return (assemble_outputs(self.graph, pieces) if outputs else []), list(done)

    def reset_counters(self) -> None:
        """Start counting ``busy_s``, ``wall_s`` and ``counted`` steps afresh."""
        self.busy_s, self.wall_s, self.counted = [0.0] * len(self.refs), 0.0, 0

    async def close(self) -> None:
        for ref in self.refs:
            await ref.ask(Uninstall(self.plan_id, wait=True), timeout=60)


async def deploy(system, graph: KernelGraph, plan: Plan, values: dict, plan_id: str = "offload",
                 prefix: str = "", timeout: float = 600.0, graphs: bool | None = None) -> Deployed:
    transfer = f"{prefix}transfer"
    await system.spawn(TransferActor(), transfer)
    refs = [await system.spawn(DeviceActor(DeviceSpec.parse(d), transfer=transfer, graphs=graphs),
                               f"{prefix}device{i}") for i, d in enumerate(plan.devices)]
    routes = [[i, "", f"{prefix}device{i}"] for i in range(len(refs))]
    g_bytes = msgpack.packb(graph.to_dict(), use_bin_type=True)
    p_bytes = msgpack.packb(plan_to_dict(plan), use_bin_type=True)
    installed = [await ref.ask(InstallPlan(plan_id, i, g_bytes, p_bytes, routes), timeout=timeout)
                 for i, ref in enumerate(refs)]
    await system.ref(transfer).ask(Routes(plan_id, routes, list(plan.devices)))
    for i, ref in enumerate(refs):
        held = [b for b in plan.resident[i] if b in values]
        await ref.ask(LoadValues(plan_id, held, [values[b] for b in held]), timeout=timeout)
    return Deployed(graph, plan, plan_id, refs, timeout, installed=installed)


async def greedy(dep: Deployed, prompt: Sequence[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding of a batch-1 decode graph (``input_ids`` [1, 1],
    ``positions`` [1]): the new tokens and the logits of each."""
    tokens, logits = [], []
    out = None
    pos = 0
    for tok in prompt:
        out, _ = await dep.step({"input_ids": torch.tensor([[tok]]), "positions": torch.tensor([pos])})
        pos += 1
    for _ in range(new):
        last = out[0].reshape(-1, out[0].shape[-1])[-1].float()
        logits.append(last.clone())
        tok = int(torch.argmax(last))
        tokens.append(tok)
        out, _ = await dep.step({"input_ids": torch.tensor([[tok]]), "positions": torch.tensor([pos])})
        pos += 1
    return tokens, logits


def predicted_busy(o: Offload, plan: Plan) -> list[float]:
    """Per-device busy seconds of one step of ``plan`` on the step model."""
    off = plan.meta.get("offload") or {}
    p = Placement(list(plan.assignment), list(off.get("streamed", ())), int(off.get("slots", 0)),
                  int(off.get("slot_bytes", 0)), ring=str(off.get("ring", "slots")))
    return list(o.simulate(p).busy_s)


def adapt(costs: CostTable, predicted_busy: Sequence[float], observed_busy: Sequence[float],
          tolerance: float = 1.25) -> tuple[CostTable, list[float]]:
    """Rates rescaled per device by observed / predicted busy time where the
    two differ by more than ``tolerance`` (either way); returns the new table
    and the factors applied (1.0: unchanged)."""
    factors = []
    for p, o in zip(predicted_busy, observed_busy):
        f = o / p if p > 0 and o > 0 else 1.0
        factors.append(f if (f > tolerance or f < 1 / tolerance) else 1.0)
    times = [[t * factors[d] for d, t in enumerate(row)] for row in costs.times]
    return CostTable(list(costs.devices), times, costs.latency, costs.bandwidth, list(costs.mem), "adapted"), factors


__all__ = ["Deployed", "adapt", "deploy", "greedy", "predicted_busy"]
