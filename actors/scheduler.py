"""The scheduler actor: knows the nodes and their devices, plans placements
and sends them out as placement messages.

* Nodes ``Register`` (reply ``Registered``) and heartbeat to the
  scheduler's ``LeaseActor`` (``actors/lease.py``); a node silent for
  ``heartbeat_timeout`` seconds is considered lost (reported in ``Stats``;
  plans that used it must be re-placed); devices registered at the
  scheduler's own address (in-process devices) hold no lease.  A node registering under the
  name of a lost one (restarted) takes its place: same devices, same
  inventory slots; a name held by a live node (one that still answers
  ``Describe`` at its endpoint within 1 s) is refused.  A node reported
  lost that answers again (it was paused) is re-admitted by ``Readmit``:
  checked to be the same process, the plans it held when it was lost
  uninstalled, no longer lost.
* The device inventory is the registered devices in registration order; a
  plan's device ``i`` is inventory entry ``i``.
* ``Place`` asks the graph actor for the graph, runs the planner (in a
  thread: planning may take seconds) on the live inventory and deploys it.
  Deploying = ``InstallPlan`` to every
  plan device, ``Routes`` to every node's transfer actor, ``LoadValues``
  with the weights/state each device still needs (``Installed.need``: a
  device holding a share group's buffers already is not sent them again).
  Reply: ``Placed``.
* Several graphs (the buckets of a served model): ``Place.graph`` names one,
  ``values`` may map graph names to their values, and ``Place.pins`` keeps
  state buffers on the devices they already live on (``planning.pinning``).
* Placements run one at a time, but beside the mailbox (a deferred reply):
  a placement that waits on a paused node does not hold up ``GetStats``,
  ``ReportLost`` or ``Readmit``.  A node reported lost abandons every
  placement that uses it at once (``PlanError`` naming the node; what it had
  installed on the others is uninstalled), instead of its asks running into
  ``install_timeout``; the asker places again on the nodes left.
* Clean-ups never hold up an answer: a loss's uninstalls go out at once,
  side by side, and are not waited for; a re-admission's go side by side.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping

import msgpack

from actors.lease import LEASE_SUFFIX, LeaseActor, Leases
from tessera_actors.runtime.actor import Actor, ActorRef, LocalRef, handler, retrieve_error
from tessera_actors.runtime.errors import ActorDead, ActorError
from tessera_actors.graph import KernelGraph, graph_from_bytes
from tessera_actors.runtime.messages import (Placed, Describe, GetGraph, GetStats, Heartbeat, InstallPlan,
                                     LoadValues, Ok, Place, Readmit, Register, Registered, ReportLost, Routes,
                                     Stats, Uninstall)
from tessera_actors.plan import Plan, Planner, PlanError, plan_to_dict
from tessera_actors.planning.pinning import served_plan

log = logging.getLogger("tessera_actors.scheduler")


class Wire:
    """A placement's graph and plan for ``InstallPlan``: the objects to a
    device actor of this process, their msgpack bytes (encoded once, when
    first needed) to one elsewhere."""

    def __init__(self, graph: KernelGraph, plan: Plan, graph_bytes: bytes = b"") -> None:
        self.graph, self.plan = graph, plan
        self._graph_bytes, self._plan_bytes = graph_bytes or None, None

    def plan_bytes(self) -> bytes:
        if self._plan_bytes is None:
            self._plan_bytes = msgpack.packb(plan_to_dict(self.plan), use_bin_type=True)
        return self._plan_bytes

    def install(self, plan_id: str, device: int, routes: list, share: str, here: bool,
                values: dict | None = None) -> InstallPlan:
        """``values``: weight bytes by buffer id that a device of this process may adopt (``InstallPlan.adopt``)."""
        if here:
            adopt = {b: values[b] for b in self.plan.resident[device]
                     if b in values and self.graph.buffers[b].role == "weight"} if share and values else {}
            return InstallPlan(plan_id, device, self.graph, self.plan, routes, share, adopt)
        if self._graph_bytes is None:
            self._graph_bytes = msgpack.packb(self.graph.to_dict(), use_bin_type=True)
        return InstallPlan(plan_id, device, self._graph_bytes, self.plan_bytes(), routes, share)


class _Placing:
    """A placement in progress: the node endpoints it may use, and a future
    set to the endpoint of the first of them reported lost (abandoned)."""

    def __init__(self, endpoints: set[str]) -> None:
        self.endpoints = endpoints
        self.abandoned: asyncio.Future = asyncio.get_running_loop().create_future()

    def lose(self, endpoint: str) -> None:
        if endpoint in self.endpoints and not self.abandoned.done():
            self.abandoned.set_result(endpoint)


@dataclass
class _Node:
    name: str
    endpoint: str
    devices: list[str]
    first: int
    last_seen: float
    pid: int = 0


class SchedulerActor(Actor):
    def __init__(self, planner: Planner, values: dict | None = None,
                 graph_actor: str = "graph", heartbeat_timeout: float = 5.0, install_timeout: float = 60.0,
                 named_values: Mapping[str, Any] | None = None) -> None:
        """``values``: initial bytes of weight/state buffers by buffer id (one
        graph), or by graph name then buffer id (several graphs; the mapping
        is read at each deployment, not copied);
        ``named_values``: bytes by buffer name, for the buffers of a graph
        that ``values`` does not cover (a served model's buckets captured
        after start name their weights as the model does); read at each
        deployment, not copied: its owner may empty it (a served model
        gives its copy of the weights back once every bucket is placed)."""
        self.planner = planner
        values = values if values is not None else {}
        if values and all(isinstance(k, str) for k in values):
            self.values_by_graph = values   # read, not copied: as named_values
        else:
            self.values_by_graph = {"": values}
        self.named_values = named_values if named_values is not None else {}
        self.graph_actor = graph_actor
        self.heartbeat_timeout = heartbeat_timeout
        self.install_timeout = install_timeout
        self.nodes: dict[str, _Node] = {}
        self.inventory: list[tuple[str, int, str]] = []   # (node, local index, device spec)
        self.plans: dict[str, Plan] = {}
        self.routes: dict[str, list] = {}
        self.reported_lost: set[str] = set()   # node names reported dead by an engine
        self.stale: dict[str, set[tuple[str, str]]] = {}   # endpoint -> (plan, device actor) it held when lost
        self.leases = Leases()   # renewed by this scheduler's LeaseActor
        self._placings: dict[str, _Placing] = {}   # plan id -> placement in progress
        self._place_lock: asyncio.Lock | None = None   # placements one at a time
        self._background: set[asyncio.Task] = set()   # placements and clean-ups under way

    async def on_start(self) -> None:
        self._place_lock = asyncio.Lock()
        await self.system.spawn(LeaseActor(self.leases), self.name + LEASE_SUFFIX)

    async def on_stop(self) -> None:
        for task in self._background:
            task.cancel()   # a placement must not outlive the scheduler (its asker gets ActorDead)
        try:
            await self.system.ref(self.name + LEASE_SUFFIX).stop()
        except ActorDead:
            pass

    @handler(Register)
    async def register(self, msg: Register) -> Registered:
        old = self.nodes.get(msg.node)
        devices = list(msg.devices)
        if old is not None and (old.endpoint, old.devices) == (msg.endpoint, devices):
            self.leases.grant(msg.node)
            return Registered(msg.node, old.first)
        if old is not None:
            if msg.node not in self.lost_nodes() and await self._answers(old.endpoint, msg.pid):
                raise ValueError(f"node {msg.node!r} is already registered at {old.endpoint} and alive")
            if old.devices != devices:
                raise ValueError(f"node {msg.node!r} rejoins with devices {devices}, it had {old.devices}: "
                                 f"use another name")
            log.warning("node %s rejoins at %s (was %s, lost)", msg.node, msg.endpoint, old.endpoint)
            self.stale.pop(old.endpoint, None)   # a new process holds no plan
            old.endpoint, old.last_seen, old.pid = msg.endpoint, time.monotonic(), msg.pid
            self.reported_lost.discard(msg.node)
            self.leases.grant(msg.node)
            return Registered(msg.node, old.first)
        node = _Node(msg.node, msg.endpoint, devices, len(self.inventory), time.monotonic(), msg.pid)
        self.nodes[msg.node] = node
        self.inventory += [(msg.node, i, d) for i, d in enumerate(msg.devices)]
        self.leases.grant(msg.node)
        log.info("node %s at %s registered devices %s", msg.node, msg.endpoint, msg.devices)
        return Registered(msg.node, node.first)

    @handler(Heartbeat)
    def heartbeat(self, msg: Heartbeat) -> None:
        """Heartbeats told here (older nodes, in-process devices) renew a
        registered node's lease; others are ignored (nodes ask ``LeaseActor``)."""
        self.leases.renew(msg.node)

    async def _answers(self, endpoint: str, new_pid: int, timeout: float = 1.0) -> bool:
        """Whether another process than ``new_pid`` still serves a node at ``endpoint``."""
        try:
            info = await (await self.system.ref_at(endpoint, "node")).ask(Describe(), timeout=timeout)
        except ActorError:
            return False
        return getattr(info, "pid", None) != new_pid

    def lost_nodes(self) -> list[str]:
        """Nodes reported lost, or silent past ``heartbeat_timeout``.  A node
        registered at this scheduler's own address hosts devices in this
        very process: they live as long as the scheduler, so they hold no
        lease (a placement that kept this event loop busy for longer than
        the timeout must not count them lost)."""
        here = self.system.address if self.system is not None else None
        return [n.name for n in self.nodes.values()
                if n.name in self.reported_lost
                or (n.endpoint != here and self.leases.age(n.name) > self.heartbeat_timeout)]

    @handler(ReportLost)
    def report_lost(self, msg: ReportLost) -> Ok:
        """Mark the node at ``endpoint`` lost, abandon the placements that
        would use it, and uninstall the plans that used it from the surviving
        devices (their pending steps fail at once); the uninstalls are sent
        now, side by side, and not waited for."""
        names = [n.name for n in self.nodes.values() if n.endpoint == msg.endpoint]
        self.reported_lost.update(names)
        log.warning("node(s) %s at %s reported lost: %s", names, msg.endpoint, msg.reason)
        for placing in self._placings.values():
            placing.lose(msg.endpoint)
        gone = []
        for plan_id, routes in list(self.routes.items()):
            if not any(ep == msg.endpoint for _, ep, _ in routes):
                continue
            for _, ep, name in routes:
                if ep == msg.endpoint:
                    self.stale.setdefault(ep, set()).add((plan_id, name))
                else:
                    gone.append((ep, name, plan_id))
            self.plans.pop(plan_id, None)
            self.routes.pop(plan_id, None)
        if gone:
            self._soon(self._uninstall(gone, "a second casualty: reported by its own failure"))
        return Ok(f"lost: {names}")

    async def _uninstall(self, where: list[tuple[str, str, str]], why: str) -> list[BaseException]:
        """``Uninstall`` each (endpoint, device actor, plan id), side by side
        (5 s each at most); the failures, logged."""
        async def one(ep: str, name: str, plan_id: str) -> None:
            await (await self.system.ref_at(ep, name)).ask(Uninstall(plan_id), timeout=5)
        results = await asyncio.gather(*(one(*w) for w in where), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        for (ep, name, plan_id), r in zip(where, results):
            if isinstance(r, BaseException):
                log.warning("could not uninstall %r from %s/%s (%s): %s", plan_id, ep, name, why, r)
        return failed

    def _soon(self, coro) -> asyncio.Task:
        """Run ``coro`` beside the mailbox (kept until it ends; cancelled when the scheduler stops)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    @handler(Readmit)
    async def readmit(self, msg: Readmit) -> Ok:
        """A node reported lost answers again: if it is the process that
        registered (``Describe``: same name and pid), its stale plans are
        uninstalled and it is no longer lost; else ``ValueError`` (a node
        restarted at that address registers itself)."""
        node = next((n for n in self.nodes.values() if n.endpoint == msg.endpoint), None)
        if node is None:
            raise LookupError(f"no node is registered at {msg.endpoint}")
        if node.name not in self.reported_lost:
            return Ok(f"{node.name} was not lost")
        info = await (await self.system.ref_at(msg.endpoint, "node")).ask(Describe(), timeout=5)
        if (info.node, info.pid) != (node.name, node.pid):
            raise ValueError(f"{msg.endpoint} is {info.node} (pid {info.pid}) now, not the node {node.name} "
                             f"(pid {node.pid}) reported lost")
        stale = sorted(self.stale.get(msg.endpoint, ()))
        failed = await self._uninstall([(msg.endpoint, name, plan_id) for plan_id, name in stale], "re-admission")
        if failed:
            raise failed[0]
        self.stale.pop(msg.endpoint, None)
        self.reported_lost.discard(node.name)
        self.leases.grant(node.name)
        log.warning("node %s at %s answers again: re-admitted", node.name, msg.endpoint)
        return Ok(f"re-admitted: {node.name}")

    @handler(GetStats)
    def stats(self, msg: GetStats) -> Stats:
        return Stats({"nodes": list(self.nodes), "endpoints": {n.name: n.endpoint for n in self.nodes.values()},
                      "devices": [d for _, _, d in self.inventory],
                      "lost": self.lost_nodes(), "plans": list(self.plans)})

    def _values(self, graph: str) -> dict:
        if graph in self.values_by_graph:
            return self.values_by_graph[graph]
        if not graph and len(self.values_by_graph) >= 1:
            return next(iter(self.values_by_graph.values()))
        return {}

    @handler(Place)
    def place(self, msg: Place) -> asyncio.Future:
        """Answered when the placement is deployed (a deferred reply: the
        mailbox keeps serving meanwhile); placements run one at a time."""
        return self._soon(self._place(msg))

    async def _place(self, msg: Place) -> Placed:
        async with self._place_lock:
            # the graph actor may capture the graph first (a served bucket on first use): seconds, not a round trip
            blob = await self.system.ref(self.graph_actor).ask(GetGraph(msg.graph, objects=True),
                                                               timeout=self.install_timeout)
            graph = blob.graph if isinstance(blob.graph, KernelGraph) else graph_from_bytes(blob.data)
            lost = set(self.lost_nodes())
            live = [d for d, (node, _, _) in enumerate(self.inventory) if node not in lost]
            if msg.devices:
                live = [d for d in live if d in set(msg.devices)]
            if not live:
                raise PlanError("no live devices registered")
            placing = self._placings[msg.plan_id] = _Placing({self.nodes[self.inventory[d][0]].endpoint
                                                              for d in live})
            try:
                return await self._plan_and_deploy(msg, graph, blob.data, live, placing)
            finally:
                self._placings.pop(msg.plan_id, None)

    async def _plan_and_deploy(self, msg: Place, graph: KernelGraph, graph_bytes: bytes, live: list[int],
                               placing: _Placing) -> Placed:
        specs = [self.inventory[d][2] for d in live]
        plan = await self._unless_lost(placing, msg.plan_id, asyncio.to_thread(self.planner.plan, graph, specs,
                                                                                msg.mode))
        where = {(self.nodes[self.inventory[d][0]].endpoint, f"device{self.inventory[d][1]}"): i
                 for i, d in enumerate(live)}
        pins = {name: where[tuple(r)] for name, r in msg.pins.items() if tuple(r) in where}
        weights = {name: {where[tuple(r)] for r in rs if tuple(r) in where} for name, rs in msg.weights.items()}
        weights = {name: ds for name, ds in weights.items() if ds}
        plan = served_plan(graph, plan, specs, pins, weights, msg.mode)
        placed = await self._deploy(msg.plan_id, graph, plan, live, graph_bytes, placing, msg.graph, msg.share)
        return Placed(placed.plan_id, placed.routes, plan) if msg.objects else placed

    async def _unless_lost(self, placing: _Placing, plan_id: str, aw):
        """``aw``'s result, unless a node of the placement is reported lost
        first: then ``aw`` is cancelled and ``PlanError`` says which node."""
        task = asyncio.ensure_future(aw)
        try:
            await asyncio.wait({task, placing.abandoned}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()   # a cancelled gather ends with a CancelledError to retrieve, not as cancelled
            task.add_done_callback(retrieve_error)
            raise
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise PlanError(f"placement of {plan_id!r} abandoned: the node at {placing.abandoned.result()} "
                            f"was reported lost while it was placed")
        return task.result()

    async def _deploy(self, plan_id: str, graph: KernelGraph, plan: Plan, devs: list[int],
                      graph_bytes: bytes, placing: _Placing, graph_name: str = "", share: str = "") -> Placed:
        """Install ``plan`` on its devices and load their values: a device
        actor of this process is given the graph and the plan themselves,
        one elsewhere their bytes (each encoded once, when first needed)."""
        routes = []
        for i, d in enumerate(devs):
            node, local, _ = self.inventory[d]
            routes.append([i, self.nodes[node].endpoint, f"device{local}"])
        wire = Wire(graph, plan, graph_bytes)
        refs: list[ActorRef] = [await self.system.ref_at(ep, name) for _, ep, name in routes]
        values = self._initial_values(graph, graph_name)
        try:
            installed = await self._unless_lost(placing, plan_id, asyncio.gather(
                *(ref.ask(wire.install(plan_id, i, routes, share, isinstance(ref, LocalRef), values),
                          timeout=self.install_timeout) for i, ref in enumerate(refs))))
            for node in {self.inventory[d][0] for d in devs}:
                ref = await self.system.ref_at(self.nodes[node].endpoint, "transfer")
                await self._unless_lost(placing, plan_id, ref.ask(Routes(plan_id, routes, list(plan.devices))))
            await self._load(plan_id, plan, values, share, refs, installed, placing)
        except Exception:
            self._forget_partial(plan_id, routes)
            raise
        self.plans[plan_id] = plan
        self.routes[plan_id] = routes
        log.info("deployed plan %r on %s", plan_id, [r[1:] for r in routes])
        return Placed(plan_id, routes, wire.plan_bytes())

    def _initial_values(self, graph: KernelGraph, graph_name: str) -> dict:
        """The initial bytes of the graph's weight and state buffers, by buffer id."""
        values = dict(self._values(graph_name))
        for b, buf in graph.buffers.items():
            if b not in values and buf.role == "weight" and buf.name in self.named_values:
                values[b] = self.named_values[buf.name]
        return values

    async def _load(self, plan_id: str, plan: Plan, values: dict, share: str,
                    refs: list[ActorRef], installed: list, placing: _Placing) -> None:
        """``LoadValues`` to every device: the weights and state it still needs."""
        for i, ref in enumerate(refs):
            need = set(installed[i].need) if share else set(plan.resident[i])
            held = [b for b in plan.resident[i] if b in values and b in need]
            await self._unless_lost(placing, plan_id, ref.ask(LoadValues(plan_id, held, [values[b] for b in held]),
                                                              timeout=self.install_timeout))

    def _forget_partial(self, plan_id: str, routes: list) -> None:
        """A deployment that failed or was abandoned: its plan goes from the
        devices that may hold it (now, not waited for); a node reported lost
        uninstalls it when it is re-admitted."""
        lost = {self.nodes[n].endpoint for n in self.lost_nodes()}
        for _, ep, name in routes:
            if ep in lost:
                self.stale.setdefault(ep, set()).add((plan_id, name))
        live = [(ep, name, plan_id) for _, ep, name in routes if ep not in lost]
        if live:
            self._soon(self._uninstall(live, "a placement that did not complete"))
