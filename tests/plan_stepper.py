"""A test harness: a plan deployed on device actors of this process
(``deploy``) and stepped straight on them, and one graph deployed over node
processes (``split_on_nodes``).  The product steps plans
through ``serving.deployment.Deployment`` (the engine); the data-plane and
device-actor tests drive raw graphs of any model through this one.

``Engine.step`` sends one ``RunStep`` to every plan device at once and
assembles the outputs from the devices that hold their final bytes; a device
that does not answer within ``step_timeout`` fails the step.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Sequence

import msgpack
import torch

from actors.device import DeviceActor
from actors.graph import GraphActor
from actors.scheduler import SchedulerActor
from actors.transfer import TransferActor
from tessera_actors.cluster import LocalCluster
from tessera_actors.devices import DeviceSpec
from tessera_actors.launch import registry
from tessera_actors.planning.registry import get_planner
from tessera_actors.runtime.actor import ActorRef
from tessera_actors.runtime.messages import GetStats, InstallPlan, LoadValues, Place, Routes
from transport.system import ActorSystem
from tessera_actors.graph import KernelGraph
from tessera_actors.runtime.messages import RunStep, StepDone
from tessera_actors.plan import Plan, plan_from_dict, plan_to_dict
from tessera_actors.execution.inputs import assemble_outputs


class StepFailed(RuntimeError):
    """A step could not be completed; the message names the device and why."""


class Engine:
    def __init__(self, graph: KernelGraph, plan: Plan, plan_id: str, devices: Sequence[ActorRef],
                 step_timeout: float = 60.0) -> None:
        if len(devices) != len(plan.devices):
            raise ValueError(f"{len(devices)} device refs for a plan of {len(plan.devices)} devices")
        self.graph, self.plan, self.plan_id = graph, plan, plan_id
        self.devices = list(devices)
        self.step_timeout = step_timeout
        self.steps = 0
        self.last: list[StepDone] = []

    async def step(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        step = self.steps
        self.steps += 1
        asks = []
        for d, ref in enumerate(self.devices):
            feed = inputs if self.plan.inputs[d] else {}
            asks.append(ref.ask(RunStep(self.plan_id, step, feed), timeout=self.step_timeout))
        results = await asyncio.gather(*asks, return_exceptions=True)
        for d, r in enumerate(results):
            if isinstance(r, BaseException):
                raise StepFailed(f"step {step}: device {d} ({self.plan.devices[d]}) failed: "
                                 f"{type(r).__name__}: {r}") from r
        self.last = list(results)
        pieces = {}
        for done in results:
            for (b, s, e), data in zip(done.ranges, done.data):
                pieces[(b, s, e)] = data
        return assemble_outputs(self.graph, pieces)


async def deploy(system: ActorSystem, graph: KernelGraph, plan: Plan, values: dict, graphs: bool | None = None,
                 plan_id: str = "p", timeout: float = 300.0, **device_kw) -> tuple[Engine, list]:
    """Spawn a transfer actor and one device actor per plan device in
    ``system``, install ``plan`` (from its bytes, as from another process)
    and load ``values``: an engine over them, and each device's
    ``Installed`` reply."""
    await system.spawn(TransferActor(), "transfer")
    refs = [await system.spawn(DeviceActor(DeviceSpec.parse(d), graphs=graphs, **device_kw), f"device{i}")
            for i, d in enumerate(plan.devices)]
    routes = [[i, "", f"device{i}"] for i in range(len(refs))]
    g_bytes = msgpack.packb(graph.to_dict(), use_bin_type=True)
    p_bytes = msgpack.packb(plan_to_dict(plan), use_bin_type=True)
    installed = [await ref.ask(InstallPlan(plan_id, i, g_bytes, p_bytes, routes), timeout=timeout)
                 for i, ref in enumerate(refs)]
    await system.ref("transfer").ask(Routes(plan_id, routes, list(plan.devices)))
    for i, ref in enumerate(refs):
        held = [b for b in plan.resident[i] if b in values]
        await ref.ask(LoadValues(plan_id, held, [values[b] for b in held]), timeout=timeout)
    return Engine(graph, plan, plan_id, refs, step_timeout=timeout), installed


@dataclass
class SplitRun:
    """A plan deployed over node processes; ``engine`` steps it."""
    system: ActorSystem
    cluster: LocalCluster
    routes: list          # [plan device, endpoint, actor]
    plan: Plan
    engine: Engine

    async def transfer_stats(self) -> dict[str, dict]:
        """``GetStats`` of the transfer actor of every node the plan uses, by endpoint."""
        out = {}
        for ep in sorted({ep for _, ep, _ in self.routes}):
            out[ep] = (await (await self.system.remote_ref(ep, "transfer")).ask(GetStats())).values
        return out


@asynccontextmanager
async def split_on_nodes(graph: KernelGraph, values: dict, nodes: Sequence[str], planner: str = "contiguous",
                         mode: str = "latency", node_args: Sequence[str] = (), plan_id: str = "demo",
                         step_timeout: float = 60.0, register_timeout: float = 30.0):
    """Start one node process per entry of ``nodes`` (its device specs), let
    them register with a scheduler in this process, place ``graph`` (initial
    bytes ``values``) over all their devices and deploy it; yields a
    ``SplitRun``.  On exit the nodes are stopped (exit codes in
    ``cluster.nodes``) and the actor system shut down."""
    async with ActorSystem("demo") as system:
        address = await system.listen("tcp://127.0.0.1:0")
        await system.spawn(GraphActor(graph), "graph")
        sched = await system.spawn(SchedulerActor(get_planner(planner), values), "scheduler")
        async with LocalCluster(nodes, scheduler=address, node_args=node_args) as cluster:
            await registry.registered(sched, len(nodes), register_timeout)
            dep = await sched.ask(Place(plan_id, mode), timeout=120)
            plan = plan_from_dict(msgpack.unpackb(dep.plan, strict_map_key=False))
            refs = [await system.remote_ref(ep, name) for _, ep, name in dep.routes]
            yield SplitRun(system, cluster, dep.routes, plan, Engine(graph, plan, plan_id, refs, step_timeout))
