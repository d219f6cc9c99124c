"""The engine's hold on the devices: an actor system with the graph and
scheduler actors, the devices (in-process actors or node processes), the
placed bucket plans, one-message-per-device steps, and a failure detector.

Contract:
* :meth:`Deployment.start` spawns everything and places every bucket graph:
  the reference bucket (the largest decode bucket) with the planner, the
  others with their state pinned where the reference put it
  (``Place.pins``), all in one share group, so one copy of the weights and
  one KV cache per device serve every bucket.
* :meth:`Deployment.step` sends one ``RunStep`` to every device of a bucket's
  plan (inputs only to the devices that read them) and returns the sampled
  tokens; a failure raises :class:`StepFailed` naming the device.
* Nodes come from a launcher (``tessera_actors.launch``; hook: :meth:`Deployment._start_nodes`).
* The detector pings every node every ``heartbeat_s`` and hears from the
  launcher when a node's process ends; a node silent for ``lost_after_s``
  (or exited) is reported through ``on_lost`` at once - the stall is
  bounded by the detector, not by a step timeout - and to the scheduler
  (which uninstalls the old plans, failing their pending steps, and abandons
  a placement under way that uses the node: a re-placement never waits on a
  node paused meanwhile).  :meth:`Deployment.replace` then places every
  bucket again on the survivors.  A
  lost node is only suspected (``serving/detector.py``): once it answers
  again the scheduler re-admits it; a node its launcher restarted takes its
  old place at the scheduler.  Either is reported through ``on_back`` and
  leaves ``lost``; the engine then re-places on all nodes.  With no node
  left to place on, :meth:`Deployment.replace` waits up to
  ``rejoin_wait_s`` for a suspected one to answer before it gives up.
"""
from __future__ import annotations

import asyncio
from collections import deque
import logging
import time
from typing import Callable, Sequence

import msgpack

from actors.device import DeviceActor
from actors.graph import GraphActor
from actors.scheduler import SchedulerActor
from actors.transfer import TransferActor
from tessera_actors.runtime.actor import ActorRef
from tessera_actors.devices import parse_devices
from tessera_actors.launch import registry
from tessera_actors.runtime.errors import ActorError
from tessera_actors.runtime.messages import GetStats, Place, Register, Uninstall
from tessera_actors.plan import Plan, plan_from_dict, token_devices
from tessera_actors.planning.registry import get_planner
from tessera_actors.planning.pinning import state_homes, weight_homes
from transport.system import ActorSystem
from tessera_actors.serving.config import EngineConfig
from tessera_actors.serving.buckets import Bucket, core_buckets
from tessera_actors.serving.deploy import ServedModel
from tessera_actors.serving.deployment_measure import Measuring
from tessera_actors.serving.deployment_steps import Stepping
from tessera_actors.serving.inflight import PlacedBucket, StepFailed
from tessera_actors.serving.detector import Suspects, answers
from tessera_actors.serving.memory import give_back_freed_memory
from tessera_actors.serving.params import EngineDead

log = logging.getLogger("tessera_actors.serving")

# a device actor's bytes (GetStats): everything it allocated, the share groups' weights and state, the
# scratch every plan's temporaries share, and the plans' own buffers (inputs, outputs, cross-segment values)
MEMORY_STATS = ("allocated_bytes", "shared_bytes", "scratch_bytes", "plan_bytes")


def _feeding_device(graph, plan: Plan, routes: list) -> int | None:
    """The plan device that reads ``input_ids``, when a step's sampled
    tokens can feed the next step without the host: it holds the logits
    (the first output) too, or the one device that does runs in the same
    process (``routes``: each plan device's ``(device, endpoint, actor)``),
    and hands it the tokens thread to thread (``execution/step.py``)."""
    pair = token_devices(graph, plan)
    if pair is None:
        return None
    reader, holder = pair
    return reader if reader == holder or routes[reader][1] == routes[holder][1] else None


def _background_order(b: Bucket) -> tuple:
    """Which buckets to place first after the core ones: decode before
    prompt chunks, short attention windows before the whole cache, the
    first group's rows and small sizes first (what a lightly loaded server
    runs most)."""
    return (b.kind == "embed", b.kind != "decode", not b.window, b.window, b.base, b.size)


class Deployment(Measuring, Stepping):
    def __init__(self, cfg: EngineConfig, served: ServedModel, on_lost: Callable[[list[str]], None],
                 trace=None, launcher=None, on_back: Callable[[str], None] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> None:
        """``trace``: a :class:`~tessera_actors.serving.trace.StepTrace` that
        records every step (None: no tracing); ``launcher``: who starts the
        nodes (``tessera_actors.launch``; None: in-process devices);
        ``on_back(endpoint)``: a node the launcher restarted is registered
        again; ``progress(placed, total)`` is called whenever a bucket of this
        placement generation is placed."""
        self.cfg, self.served, self.on_lost, self.on_back = cfg, served, on_lost, on_back
        self.launcher = launcher
        self.trace = trace
        self.progress = progress
        self.generation = 0
        self.placed: dict[str, PlacedBucket] = {}
        self._placing: dict[str, asyncio.Future] = {}   # buckets being placed
        self._unplaceable: set[str] = set()             # buckets whose placement failed this generation
        self.suspects: Suspects | None = None
        self.cluster = None   # a LocalLauncher's LocalCluster (the demo and tests read its processes)
        self.system: ActorSystem | None = None
        self._watchers: list[asyncio.Task] = []
        self.busy_s: dict[int, float] = {}     # plan device index -> worker seconds spent on steps
        # over every step since start, all devices: worker seconds, of them inside runs of kernels, and the
        # workers' CPU seconds outside them (StepDone.kernel_s, host_s)
        self.worker_s = {"busy": 0.0, "kernels": 0.0, "host": 0.0}
        self.bucket_counts: dict[str, dict[str, int]] = {}   # bucket -> RUN_COUNTS over its steps
        self.since = time.monotonic()          # when the current placement started
        self._busy_log: deque = deque()        # (time, busy_s copy) after steps: busy fractions over a window
        self.device_memory: dict[str, dict] = {}   # device actor -> its GetStats bytes, after its latest placement

    # -- lifecycle --------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        self.system = ActorSystem("engine")
        launcher = self.launcher
        address = await self.system.listen(launcher.listen if launcher else "tcp://127.0.0.1:0")
        # buckets not captured yet are captured when first placed (the graph actor asks the model)
        await self.system.spawn(GraphActor(self.served.graphs, source=self.served.graph), "graph")
        costs = {}
        if cfg.profile and launcher is None:
            costs = await asyncio.to_thread(self.profile_reference)
        try:
            planner = get_planner(cfg.planner, costs=costs, **cfg.planner_options)
        except TypeError as e:
            raise ValueError(f"planner {cfg.planner!r}: bad planner_options {cfg.planner_options}: {e}") from None
        if hasattr(planner, "expect"):   # the offload planner keeps room in the GPU budget for the other buckets
            await asyncio.to_thread(self.served.capture_all)
            planner.expect([g for name, g in self.served.graphs.items() if name != self.reference_bucket()])
        await self.system.spawn(SchedulerActor(planner, self.served.values, named_values=self.served.named_weights(),
                                               heartbeat_timeout=max(5.0, cfg.lost_after_s)), "scheduler")
        sched = self.system.ref("scheduler")
        self.suspects = Suspects(sched, self._ping, cfg.heartbeat_s, self._back)
        if launcher is not None:
            await self._start_nodes(launcher, address, sched)
        else:
            specs = parse_devices(cfg.devices)
            await self.system.spawn(TransferActor(), "transfer")
            for i, spec in enumerate(specs):
                await self.system.spawn(DeviceActor(spec), f"device{i}")
            # registered at the scheduler's own address: in-process devices hold no lease
            await sched.ask(Register("local", address, [s.name for s in specs]))
        await self.place_all()
        self._watchers.append(asyncio.get_running_loop().create_task(self._ping_loop()))

    async def _start_nodes(self, launcher, address: str, sched: ActorRef) -> None:
        """The launcher's hook: start the nodes, wait for them, hear when one dies or comes back."""
        count = await launcher.start(address)
        self.cluster = getattr(launcher, "cluster", None)
        try:
            await registry.registered(sched, count)
        except TimeoutError as e:
            raise EngineDead(str(e)) from None
        self._watchers.append(asyncio.get_running_loop().create_task(launcher.watch(self._exited, self._back)))

    def _exited(self, endpoint: str) -> None:
        if endpoint not in self.lost:
            self.on_lost([endpoint])
            self.suspect([endpoint])

    def suspect(self, endpoints: Sequence[str]) -> asyncio.Future:
        """:meth:`Suspects.lose`: counted lost now, reported to the scheduler (the future)."""
        return self.suspects.lose(endpoints)

    @property
    def lost(self) -> set[str]:
        """Node endpoints suspected (reported lost) and not back."""
        return self.suspects.lost if self.suspects is not None else set()

    def _back(self, endpoint: str) -> None:
        self._watchers.append(asyncio.get_running_loop().create_task(self._readmit(endpoint)))

    async def _readmit(self, endpoint: str) -> None:
        """Once a restarted or re-admitted node took its old place, it leaves
        ``lost`` (under every endpoint its name was lost at), and ``on_back``
        (unless the placement uses it already)."""
        sched = self.system.ref("scheduler")
        if not await registry.rejoined(sched, endpoint):
            log.warning("node at %s did not register again", endpoint)
            return
        st = (await sched.ask(GetStats())).values
        name = next((n for n, ep in st["endpoints"].items() if ep == endpoint), None)
        self.suspects.forget(name, endpoint)
        if endpoint not in self.node_endpoints() and self.on_back is not None:
            self.on_back(endpoint)

    async def stop(self) -> None:
        if self.suspects is not None:
            self.suspects.stop()
        for t in self._watchers:
            t.cancel()
        for t in self._placing.values():
            t.cancel()   # a background placement must not outlive the system it asks
        if self.launcher is not None:
            await self.launcher.stop()
        if self.system is not None:
            await self.system.shutdown()

    # -- placement ----------------------------------------------------------
    def reference_bucket(self) -> str:
        return f"decode:{self.cfg.max_seqs}@0"

    async def _place(self, bucket: str, pins: dict, weights: dict | None = None) -> PlacedBucket:
        sched = self.system.ref("scheduler")
        plan_id = f"g{self.generation}:{bucket}"
        dep = await sched.ask(Place(plan_id, "throughput", graph=bucket, pins=pins, share=self.served.name,
                                    weights=weights or {}, objects=True), timeout=600)
        plan = dep.plan if isinstance(dep.plan, Plan) else plan_from_dict(msgpack.unpackb(dep.plan, strict_map_key=False))
        refs = [await self.system.ref_at(ep, name) for _, ep, name in dep.routes]
        graph = self.served.graph(bucket)
        graph.forget_edges()   # placed: the next bucket's planning reuses that memory (a re-placement derives them again)
        await self._note_memory(dep.routes, refs)
        return PlacedBucket(plan_id, plan, refs, dep.routes, feeds=_feeding_device(graph, plan, dep.routes))

    async def _note_memory(self, routes: list, refs: list) -> None:
        """What the plan's devices hold now (:attr:`device_memory`): an
        answer that does not come within a second leaves the last one."""
        for (_, endpoint, name), ref in zip(routes, refs):
            try:
                st = (await ref.ask(GetStats(), timeout=1.0)).values
            except (ActorError, OSError) as e:   # a slow or lost node: memory is reported, never waited for
                log.debug("no memory stats from %s/%s: %s", endpoint, name, e)
                continue
            self.device_memory[f"{endpoint}/{name}"] = {k: st.get(k, 0) for k in MEMORY_STATS}

    def core_buckets(self) -> set[str]:
        """Buckets placed before the engine serves (:func:`core_buckets`;
        with nodes from a launcher, every bucket)."""
        if self.launcher is not None:
            return set(self.served.buckets)
        return core_buckets(self.cfg, self.served.buckets)

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(len(self.placed), len(self.served.buckets))

    async def place_all(self, eager: bool = True) -> None:
        """Place the reference bucket, then (``eager``) the other core
        buckets (:meth:`core_buckets`) and the rest in the background;
        otherwise the others are placed when a step first needs them (after
        a loss: the requests continue as soon as the buckets they need are
        in place, not after all of them)."""
        ref_name = self.reference_bucket()
        self.device_memory = {}   # this placement's devices only
        ref = await self._place(ref_name, {})
        homes = state_homes(self.served.graphs[ref_name], ref.plan.assignment)
        self.pins = {name: ref.routes[d][1:] for name, d in homes.items()}
        held = weight_homes(self.served.graphs[ref_name], ref.plan.assignment)
        self.weights = {name: [ref.routes[d][1:] for d in sorted(ds)] for name, ds in held.items()}
        if ref.plan.meta.get("offload"):
            # an offload plan's weights are resident, streamed or on the CPU, per bucket: the planner
            # keeps the resident ones (by name) for every bucket, and a prompt chunk may stream what
            # decode computes on the CPU - pinning weights to the reference's devices would undo that
            self.weights = {}
        self.placed = {ref_name: ref}
        self._report()
        self._placing = {}
        self._unplaceable = set()
        self.busy_s = {d: 0.0 for d in range(len(ref.plan.devices))}
        self.since = time.monotonic()
        self._busy_log.clear()
        if eager:
            core = self.core_buckets()
            later = sorted((name for name in self.served.buckets if name != ref_name and name not in core),
                           key=lambda name: _background_order(self.served.buckets[name]))
            for name in self.served.buckets:
                if name != ref_name and name in core:
                    self.placed[name] = await self._place(name, self.pins, self.weights)
                    self._report()
            after = None
            for name in later:   # one at a time: a heartbeat queues behind at most one placement
                after = self._place_soon(name, after)
        log.debug("placed %d buckets (generation %d): %s", len(self.placed), self.generation, ref.plan.name)

    async def wait_placed(self) -> None:
        """Return once no bucket is being placed (the background placements
        of :meth:`place_all`); a bucket whose placement failed stays with its
        stand-in."""
        while True:
            pending = [t for t in self._placing.values() if not t.done()]
            if not pending:
                return
            await asyncio.wait(pending)

    async def _placed(self, bucket: str) -> PlacedBucket:
        """The bucket's plan, placed now if it is not yet (one placement per
        bucket even when several steps ask at once)."""
        p = self.placed.get(bucket)
        if p is not None:
            return p
        if bucket not in self.served.buckets:
            raise StepFailed(f"no bucket {bucket!r}")
        generation = self.generation
        task = self._placing.get(bucket)
        if task is None:
            task = self._placing[bucket] = asyncio.ensure_future(self._place(bucket, self.pins, self.weights))
        try:
            p = await asyncio.shield(task)
        except Exception:
            if self._placing.get(bucket) is task:
                self._placing.pop(bucket)   # the next step that needs it tries afresh
            raise
        if generation == self.generation:
            self.placed[bucket] = p
            self._report()
        return p

    async def release_weights(self) -> bool:
        """Once every bucket is placed, give back the engine's copy of the
        weights when nothing can read it again: in-process devices (never
        lost, so never re-placed) under a planner that places buckets one
        at a time.  Returns whether it did."""
        await self.wait_placed()
        if self.cfg.nodes or self.cfg.planner == "offload" or len(self.placed) < len(self.served.buckets):
            return False
        self.served.release_weights()
        give_back_freed_memory()
        return True

    def runnable(self, want: str, bounds: tuple[int, int] | None = None) -> str:
        """The bucket a step shaped for ``want`` runs on now: ``want`` when
        it is placed, or when nothing placed can stand in (the step then
        waits for its placement); otherwise the smallest placed bucket that
        runs it padded - a prefill bucket at least as long, a decode bucket
        from the same first row with at least as many rows, inside the
        group's row ``bounds`` - with an attention window at least as wide,
        while ``want`` is placed in the background (after a loss the
        streams go on at once instead of waiting for each bucket)."""
        if want in self.placed or want not in self.served.buckets:
            return want
        b = self.served.buckets[want]
        best = None
        for name in self.placed:
            c = self.served.buckets.get(name)
            if c is None or c.kind != b.kind or c.size < b.size or c.rows != b.rows:
                continue
            if c.window and (not b.window or c.window < b.window):
                continue
            if c.kind == "decode" and (c.base != b.base or bounds is None or c.base + c.size > bounds[1]):
                continue
            key = (c.size, c.window or self.cfg.max_model_len)
            if best is None or key < best[0]:
                best = (key, name)
        if best is None:
            return want
        self._place_soon(want)
        return best[1]

    def _place_soon(self, bucket: str, after: asyncio.Future | None = None) -> asyncio.Future | None:
        """Place ``bucket`` in the background (once per generation: a bucket
        whose placement failed keeps its stand-in, it is not retried every
        step), once ``after`` (another placement) has ended; returns its task."""
        if bucket in self._placing or bucket in self._unplaceable:
            return self._placing.get(bucket)
        generation = self.generation

        async def place() -> PlacedBucket:
            if after is not None:
                await asyncio.wait([after])
            return await self._place(bucket, self.pins, self.weights)
        task = self._placing[bucket] = asyncio.ensure_future(place())

        def done(t: asyncio.Task) -> None:
            if t.cancelled():
                return
            err = t.exception()   # retrieved in every case
            if generation != self.generation:
                return
            if err is not None:
                log.warning("placing bucket %s failed: %s; its steps keep running in a larger bucket", bucket, err)
                self._unplaceable.add(bucket)
                if self._placing.get(bucket) is t:
                    self._placing.pop(bucket)
                return
            self.placed.setdefault(bucket, t.result())
            self._report()
        task.add_done_callback(done)
        return task

    async def replace(self, lost: list[str], first: Sequence[str] = ()) -> None:
        """Report ``lost`` node endpoints and place on the survivors the
        reference bucket and ``first`` (the buckets the first steps after
        the loss need); the others are placed when steps ask for them.
        With no ``lost`` (a restarted node is back), the current plans are
        uninstalled and the buckets placed on every live node the same way."""
        await self.suspect(lost)
        if not lost:   # a re-admission: nothing uninstalled the old generation's plans (their steps were dropped)
            asks = [ref.ask(Uninstall(p.plan_id), timeout=5) for p in self.placed.values() for ref in p.refs]
            for r in await asyncio.gather(*asks, return_exceptions=True):
                if isinstance(r, BaseException):
                    log.warning("could not uninstall a replaced plan: %s", r)
        self.generation += 1
        self.placed = {}
        await self._place_or_wait()
        for name in dict.fromkeys(first):
            if name in self.served.buckets:
                await self._placed(name)

    async def _place_or_wait(self) -> None:
        """Place the reference bucket; when that fails while nodes are
        suspected (none left, or none that can hold the model), wait for one
        to be re-admitted and try again, up to ``rejoin_wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.rejoin_wait_s
        while True:
            self.suspects.rejoined.clear()
            try:
                return await self.place_all(eager=False)
            except ActorError as e:
                if not self.lost or loop.time() >= deadline:
                    raise
                log.warning("cannot place on the nodes left (%s): waiting for a suspected node %s", e,
                            sorted(self.lost))
            try:
                await asyncio.wait_for(self.suspects.rejoined.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                pass

    # -- failure detection -----------------------------------------------------
    def node_endpoints(self) -> list[str]:
        eps = {ep for p in self.placed.values() for _, ep, _ in p.routes}
        return sorted(ep for ep in eps if ep and ep != self.system.address and ep not in self.lost)

    async def _ping(self, ep: str) -> bool:
        return await answers(self.system, ep, self.cfg.heartbeat_s, self.cfg.lost_after_s)

    async def _ping_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            eps = self.node_endpoints()
            if not eps:
                continue
            alive = await asyncio.gather(*(self._ping(ep) for ep in eps))
            dead = [ep for ep, ok in zip(eps, alive) if not ok and ep not in self.lost]
            if dead:
                self.on_lost(dead)
                self.suspect(dead)   # a placement under way that uses them is abandoned at once


