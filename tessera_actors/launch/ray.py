"""Node daemons as Ray actors: placed, started, supervised and restarted by Ray.

``RayLauncher`` (``EngineConfig.ray``, ``tessera serve --ray auto``) connects
to a Ray cluster and starts one node daemon per GPU (a bundle
``{"GPU": 1}`` each, packed) and, when asked, one CPU node per host (a
strictly spread placement group: a bundle per host).  Each daemon is a
:class:`NodeDaemon` actor hosting ``tessera_actors.node.serve`` on a thread
of its own, named ``ray-gpu<i>`` / ``ray-cpu<i>`` after its bundle, so a
restarted one comes back under its name and takes its old place at the
scheduler.  The CURVE keys travel as actor arguments, through Ray (never on
a command line or in an environment variable of another process).

Supervision: the daemons are restartable actors (``max_restarts``).  The
launcher keeps a call pending on each (``wait``); when the daemon's process
dies it fails at once, and the engine hears ``lost(endpoint)``.  Once Ray
has started the actor again and it serves, ``back(new endpoint)``.  A
daemon whose node loop ends by itself (its scheduler lost) exits its
process, so Ray restarts it too.

``ray`` is an optional dependency (``pip install 'tessera-actors[ray]'``);
this module imports it only when a launcher is used.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transport import auth

if TYPE_CHECKING:
    from tessera_actors.launch import Notice

log = logging.getLogger("tessera_actors.launch.ray")


@dataclass(frozen=True)
class RayNodes:
    """Which daemons to start on a Ray cluster.

    ``address``: ``auto`` (the cluster ``ray start`` made on this host, or
    ``RAY_ADDRESS``) or ``HOST:PORT`` / ``ray://HOST:PORT``.  ``gpus``: GPU
    daemons, one GPU each (None: every GPU of the cluster); ``gpu``: their
    device spec (Ray makes the GPU it gives ``cuda:0``).  ``cpu``: the device
    spec of one CPU node per host, ``""`` for none, None for ``cpu`` exactly
    when the cluster has no GPU.  ``cpus``: Ray CPUs each daemon reserves.
    ``max_restarts``: how often Ray restarts a daemon that died (-1: always).
    ``host``: the address the daemons reach the engine at (default: the
    engine's Ray node address)."""
    address: str = "auto"
    gpus: int | None = None
    gpu: str = "cuda:0"
    cpu: str | None = None
    cpus: float = 1.0
    max_restarts: int = -1
    start_timeout_s: float = 120.0
    host: str = ""

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("RayNodes: address must be 'auto' or a Ray address")
        if self.gpus is not None and self.gpus < 0:
            raise ValueError(f"RayNodes: gpus must be >= 0 or None (all), got {self.gpus}")
        if self.cpus <= 0:
            raise ValueError(f"RayNodes: cpus must be positive, got {self.cpus}")
        if self.max_restarts < -1:
            raise ValueError(f"RayNodes: max_restarts must be >= -1, got {self.max_restarts}")
        if self.start_timeout_s <= 0:
            raise ValueError("RayNodes: start_timeout_s must be positive")
        from tessera_actors.devices import parse_devices
        for spec in (self.gpu, self.cpu or ""):
            if spec:
                parse_devices(spec)   # a bad spec fails here, not inside a Ray actor


@dataclass(frozen=True)
class DaemonInfo:
    """What a :class:`NodeDaemon` answers ``info`` with."""
    name: str
    endpoint: str
    pid: int


def _ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("ray is not installed: pip install 'tessera-actors[ray]'") from None
    return ray


class NodeDaemon:
    """A node daemon inside a Ray actor (``ray.remote`` is applied by the
    launcher).  ``argv`` are node flags; ``keys`` the cluster's.  The
    constructor returns once the node serves (or raises)."""

    def __init__(self, argv: list[str], keys, timeout_s: float = 120.0) -> None:
        import ray
        from tessera_actors import node
        if keys is not None:
            auth.use_keys(keys)
        argv = list(argv)
        if "--listen" not in argv:
            argv += ["--listen", f"tcp://{ray.util.get_node_ip_address()}:0"]
        try:
            cfg = node.parse_args(argv)
        except SystemExit:
            raise ValueError(f"bad node flags {argv}") from None
        self.name, self.endpoint, self.status = cfg.name, "", None
        self._ready, self._stopping = threading.Event(), False
        self._thread = threading.Thread(target=self._run, args=(node, cfg), name="tessera-node", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or not self.endpoint:
            raise RuntimeError(f"node {cfg.name} did not start within {timeout_s:g} s (status {self.status})")

    def _run(self, node, cfg) -> None:
        loop = asyncio.new_event_loop()
        self._loop, self._stop = loop, asyncio.Event()

        def ready(endpoint: str) -> None:
            self.endpoint = endpoint
            self._ready.set()
        try:
            self.status = loop.run_until_complete(node.serve(cfg, ready, self._stop))
        except BaseException as e:   # noqa: BLE001 - reported as the status, the process then ends
            log.exception("node %s failed: %s", cfg.name, e)
            self.status = 1
        finally:
            loop.close()
            self._ready.set()
        if self.endpoint and not self._stopping:   # ended by itself: end the process so that Ray restarts it
            log.error("node %s ended with status %s: exiting for Ray to restart it", cfg.name, self.status)
            os._exit(self.status or 1)

    def info(self) -> DaemonInfo:
        return DaemonInfo(self.name, self.endpoint, os.getpid())

    def wait(self) -> int | None:
        """Blocks until the node stops; its exit status."""
        self._thread.join()
        return self.status

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Orderly shutdown of the node; its exit status."""
        self._stopping = True
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        return self.status


class RayLauncher:
    """Starts and supervises the daemons of a :class:`RayNodes` (the launcher
    contract of ``tessera_actors.launch``)."""

    def __init__(self, nodes: RayNodes, node_args=()) -> None:
        self.want, self.node_args = nodes, list(node_args)
        self.listen = ""
        self.specs: list[str] = []
        self.actors: list = []
        self.endpoints: list[str] = []
        self.groups: list = []
        self.store = None   # the data plane's rendezvous (--data-plane dist), held by this process
        self.owns_ray = False
        self.connect_s = 0.0    # prepare: connecting to Ray and reading its resources
        self.started_s = 0.0    # start: placement groups ready and every daemon serving
        self.restarts: list[float] = []   # seconds from a daemon's death notice to its restart serving

    async def prepare(self) -> list[str]:
        """Connect to Ray and work out the daemons: their device specs."""
        ray = _ray()
        t0 = time.monotonic()
        if not ray.is_initialized():
            ray.init(address=self.want.address, logging_level=logging.WARNING, log_to_driver=False)
            self.owns_ray = True
        total = int(ray.cluster_resources().get("GPU", 0))
        hosts = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= self.want.cpus]
        gpus = total if self.want.gpus is None else self.want.gpus
        if gpus > total:
            raise ValueError(f"ray: {gpus} GPU daemons asked, the cluster has {total} GPUs")
        cpu = self.want.cpu if self.want.cpu is not None else ("" if gpus else "cpu")
        self.specs = [self.want.gpu] * gpus + ([cpu] * len(hosts) if cpu else [])
        self.gpu_count = gpus
        if not self.specs:
            raise ValueError("ray: no daemon to start (no GPU asked or found, and no CPU node asked: RayNodes.cpu)")
        self.listen = f"tcp://{self.want.host or ray.util.get_node_ip_address()}:0"
        self.connect_s = time.monotonic() - t0
        return list(self.specs)

    def _placement(self):
        """Placement groups and bundle index of every daemon, in ``specs`` order."""
        from ray.util.placement_group import placement_group
        out = []
        gpus, cpus = self.gpu_count, len(self.specs) - self.gpu_count
        if gpus:
            pg = placement_group([{"GPU": 1, "CPU": self.want.cpus}] * gpus, strategy="PACK")
            self.groups.append(pg)
            out += [(pg, i, f"ray-gpu{i}", 1) for i in range(gpus)]
        if cpus:
            pg = placement_group([{"CPU": self.want.cpus}] * cpus, strategy="STRICT_SPREAD")
            self.groups.append(pg)
            out += [(pg, i, f"ray-cpu{i}", 0) for i in range(cpus)]
        return out

    async def start(self, scheduler: str) -> int:
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        t0, timeout = time.monotonic(), self.want.start_timeout_s
        placement = self._placement()
        try:
            await asyncio.wait_for(asyncio.gather(*(pg.ready() for pg in self.groups)), timeout)
        except asyncio.TimeoutError:
            raise RuntimeError(f"ray: the placement groups for {self.specs} were not ready within {timeout:g} s "
                               f"(free resources: {ray.available_resources()})") from None
        args = list(self.node_args) + ["--scheduler", scheduler] + self._rendezvous_args()
        keys = None if "--insecure" in args else auth.process_keys()
        daemon = ray.remote(NodeDaemon)
        for spec, (pg, index, name, gpus) in zip(self.specs, placement):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
            self.actors.append(daemon.options(
                num_cpus=self.want.cpus, num_gpus=gpus, max_restarts=self.want.max_restarts, max_concurrency=4,
                scheduling_strategy=strategy).remote(args + ["--devices", spec, "--name", name], keys, timeout))
        try:
            infos = await asyncio.wait_for(asyncio.gather(*(a.info.remote() for a in self.actors)), timeout)
        except asyncio.TimeoutError:
            raise RuntimeError(f"ray: the node daemons did not start within {timeout:g} s") from None
        self.endpoints = [i.endpoint for i in infos]
        self.started_s = time.monotonic() - t0
        log.info("ray: %d node daemons serving after %.1f s: %s", len(infos), self.started_s, self.endpoints)
        return len(self.actors)

    def _rendezvous_args(self) -> list[str]:
        """``--data-plane dist``: one rendezvous store for every daemon's links, held here."""
        if "dist" not in self.node_args or "--dist-rendezvous" in self.node_args:
            return []
        import torch.distributed as dist
        host = self.listen[len("tcp://"):].rpartition(":")[0]
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        return ["--dist-rendezvous", f"{host}:{self.store.port}"]

    async def watch(self, lost: Notice, back: Notice) -> None:
        await asyncio.gather(*(self._supervise(i, lost, back) for i in range(len(self.actors))))

    async def _supervise(self, i: int, lost: Notice, back: Notice) -> None:
        """Report daemon ``i``'s deaths and returns until it stops for good."""
        ray = _ray()
        actor = self.actors[i]
        while True:
            try:
                await actor.wait.remote()
                return   # stopped in order
            except ray.exceptions.RayActorError:
                pass
            log.warning("ray: node daemon %d at %s died", i, self.endpoints[i])
            died = time.monotonic()
            lost(self.endpoints[i])
            info = await self._when_back(actor)
            if info is None:
                log.error("ray: node daemon %d is dead for good (max_restarts %d)", i, self.want.max_restarts)
                return
            self.endpoints[i] = info.endpoint
            self.restarts.append(time.monotonic() - died)
            log.warning("ray: node daemon %s restarted at %s", info.name, info.endpoint)
            back(info.endpoint)

    async def _when_back(self, actor) -> DaemonInfo | None:
        """The restarted daemon's info once it serves; None if Ray gave up on it."""
        ray = _ray()
        deadline = time.monotonic() + self.want.start_timeout_s
        while time.monotonic() < deadline:
            try:
                return await actor.info.remote()
            except ray.exceptions.ActorUnavailableError:
                await asyncio.sleep(0.1)   # restarting: Ray refuses calls until its constructor returned
            except ray.exceptions.RayActorError:
                return None
        return None

    async def stop(self) -> None:
        if self.actors:
            ray = _ray()
            stops = [a.stop.remote() for a in self.actors]
            done, _ = await asyncio.wait([asyncio.ensure_future(asyncio.wrap_future(s.future())) for s in stops],
                                         timeout=15)
            for t in done:
                t.exception()   # a daemon that was dead has nothing to stop
            for a in self.actors:
                ray.kill(a, no_restart=True)
            self.actors = []
        if self.groups:
            from ray.util.placement_group import remove_placement_group
            for pg in self.groups:
                remove_placement_group(pg)
            self.groups = []
        self.store = None
        if self.owns_ray:
            _ray().shutdown()
            self.owns_ray = False
