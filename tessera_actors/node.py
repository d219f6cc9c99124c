"""The node daemon: ``python -m tessera_actors.node --listen tcp://127.0.0.1:PORT --devices cpu,cpu?threads=1``.

Hosts the device actors (``device0``, ``device1``, ...) and the transfer
actor (``transfer``) of one machine, serves them on ``--listen``, registers
with the scheduler (``--scheduler``) and heartbeats; when the scheduler
answers no heartbeat for ``--lease`` seconds the node exits with status 3
(seconds it ran: a node paused longer than its lease asks again first),
and when the scheduler no longer knows it (restarted) it registers again.  ``--data-plane dist``
sends transfer bytes to other nodes over torch.distributed links (NCCL
between GPUs, gloo otherwise) instead of ZeroMQ; see ``actors/transfer.py``.  Prints one line
``tessera-node NAME ready ENDPOINT`` on stdout once it serves, so a parent
process can wait for it.  SIGTERM or SIGINT (or a ``Shutdown`` message to
the ``node`` actor) means orderly shutdown: actors stopped, sockets closed,
exit status 0.

``--from-env slurm|torchrun`` takes the node's name (``node<rank>``), its
scheduler, its address and the data plane's rendezvous from the variables
``srun`` or torchrun set (``tessera_actors/launch/env.py``); flags given
explicitly win.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import NoReturn

from actors.transfer_config import DATA_PLANES, TransferConfig
from tessera_actors.runtime.actor import Actor, handler
from tessera_actors.devices import DeviceSpec, parse_bytes, parse_devices
from tessera_actors.launch.env import LAUNCHERS, LaunchEnvError, job_place
from actors.lease import LEASE_SUFFIX
from tessera_actors.runtime.errors import ActorError, RemoteError
from tessera_actors.runtime.messages import Describe, Heartbeat, NodeInfo, Ok, Register, Shutdown
from transport.system import ActorSystem
from transport import auth
from transport.auth import AuthError, ClusterKeys

log = logging.getLogger("tessera_actors.node")


@dataclass
class NodeConfig:
    listen: str = "tcp://127.0.0.1:0"
    devices: list[DeviceSpec] = field(default_factory=lambda: [DeviceSpec("cpu")])
    scheduler: str = ""
    name: str = ""
    heartbeat_s: float = 1.0
    lease_s: float = 7.0   # no heartbeat answered this long: the scheduler is gone, the node exits (status 3)
    register_timeout_s: float = 30.0
    transfer: TransferConfig = field(default_factory=TransferConfig)
    recv_timeout_s: float = 60.0   # a device fails its step when a transfer's bytes stop coming this long
    keys: ClusterKeys | None = None   # None: this process's keys (transport.auth.process_keys)
    insecure: bool = False            # authentication off (--insecure)

    def __post_init__(self) -> None:
        if not self.listen.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--listen {self.listen!r}: expected a ZeroMQ endpoint such as tcp://127.0.0.1:5555")
        if self.heartbeat_s <= 0:
            raise ValueError("--heartbeat must be positive")
        if self.lease_s <= self.heartbeat_s:
            raise ValueError("--lease must be longer than --heartbeat")
        if self.recv_timeout_s <= 0:
            raise ValueError("--recv-timeout must be positive")
        if not self.devices:
            raise ValueError("a node needs at least one device")
        if not self.name:
            self.name = f"{socket.gethostname()}-{os.getpid()}"


class NodeActor(Actor):
    """Answers ``Describe`` with what this node hosts; ``Shutdown`` stops it."""

    def __init__(self, cfg: NodeConfig, stop: asyncio.Event) -> None:
        self.cfg, self.stop_event = cfg, stop

    @handler(Describe)
    def describe(self, msg: Describe) -> NodeInfo:
        return NodeInfo(self.cfg.name, self.system.address, [d.name for d in self.cfg.devices], os.getpid())

    @handler(Shutdown)
    def shutdown(self, msg: Shutdown) -> Ok:
        self.stop_event.set()
        return Ok("shutting down")


class SchedulerLost(ActorError):
    """The scheduler answered no heartbeat for a whole lease."""


async def _register_and_beat(system: ActorSystem, cfg: NodeConfig, endpoint: str) -> None:
    """Register, then heartbeat (asks) every ``heartbeat_s``.  Returns never;
    raises ``SchedulerLost`` once no heartbeat was answered for ``lease_s``
    seconds of this process's own running time, and registers again when the
    scheduler no longer knows us.  A pause of this process (SIGSTOP, a GC or
    swap stall) is not the scheduler's silence: of the time between two
    looks at the clock, at most one heartbeat round (the sleep and the ask's
    timeout) counts against the lease, so a node resumed after any pause
    asks again before it gives up."""
    register = Register(cfg.name, endpoint, [d.name for d in cfg.devices], os.getpid())
    sched = await system.remote_ref(cfg.scheduler, "scheduler")
    await sched.ask(register, timeout=cfg.register_timeout_s)
    log.info("registered with scheduler at %s", cfg.scheduler)
    lease = await system.remote_ref(cfg.scheduler, "scheduler" + LEASE_SUFFIX)
    loop = asyncio.get_running_loop()
    silent, last = 0.0, loop.time()   # seconds of the lease used up; when they were last counted
    round_s = 3 * cfg.heartbeat_s     # the longest a round takes while this process runs: a sleep and an ask

    def count() -> float:
        nonlocal silent, last
        now = loop.time()
        silent, last = silent + min(now - last, round_s), now
        return silent
    seq = 0
    while True:
        await asyncio.sleep(max(0.0, min(cfg.heartbeat_s, cfg.lease_s - silent)))
        if count() >= cfg.lease_s:
            raise SchedulerLost(f"the scheduler at {cfg.scheduler} answered no heartbeat for {cfg.lease_s:g} s")
        seq += 1
        try:
            if not lease.alive:
                lease = await system.remote_ref(cfg.scheduler, "scheduler" + LEASE_SUFFIX)
            timeout = max(0.05, min(2 * cfg.heartbeat_s, cfg.lease_s - silent))
            try:
                await lease.ask(Heartbeat(cfg.name, seq), timeout=timeout)
            except RemoteError as e:
                if e.kind != "LookupError":
                    raise
                log.warning("the scheduler at %s does not know this node (restarted?): registering again",
                            cfg.scheduler)
                sched = await system.remote_ref(cfg.scheduler, "scheduler")
                await sched.ask(register, timeout=max(0.05, cfg.lease_s - silent))
            silent, last = 0.0, loop.time()
        except ActorError as e:
            count()
            log.warning("heartbeat %d to %s failed: %s", seq, cfg.scheduler, e)


async def serve(cfg: NodeConfig, ready=None, stop: asyncio.Event | None = None) -> int:
    """Run a node until stopped (SIGTERM/SIGINT in the main thread, a
    ``Shutdown`` message, or ``stop`` set); returns the exit status.
    ``ready(endpoint)`` is called once it serves."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (ValueError: uvloop)
            pass
    status = 0
    if cfg.insecure:
        log.warning("node %s runs with --insecure: authentication is off, any local process can control it",
                    cfg.name)
    # the device and transfer actors import torch: only once a node runs (its flags parse without it)
    from actors.device import DeviceActor
    from actors.transfer import TransferActor
    async with ActorSystem(cfg.name, keys=cfg.keys, insecure=cfg.insecure) as system:
        await system.spawn(TransferActor(cfg.transfer), TransferActor.NAME)
        for i, spec in enumerate(cfg.devices):
            await system.spawn(DeviceActor(spec, TransferActor.NAME, cfg.recv_timeout_s), f"device{i}")
        endpoint = await system.listen(cfg.listen)
        await system.spawn(NodeActor(cfg, stop), "node")
        beat = None
        if cfg.scheduler:
            beat = loop.create_task(_register_and_beat(system, cfg, endpoint))
        print(f"tessera-node {cfg.name} ready {endpoint}", flush=True)
        if ready is not None:
            ready(endpoint)
        waiter = loop.create_task(stop.wait())
        waits = {waiter} | ({beat} if beat else set())
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if beat is not None and beat in done and isinstance(beat.exception(), SchedulerLost):
            log.error("leaving: %s", beat.exception())
            status = 3
        elif beat is not None and beat in done and beat.exception() is not None:
            log.error("could not register with the scheduler at %s: %s", cfg.scheduler, beat.exception())
            status = 1
        for t in waits:
            t.cancel()
        log.info("node %s shutting down", cfg.name)
    return status


def listen_host(listen: str) -> str:
    """The host of a tcp ``--listen`` endpoint when it names one, else this machine's name."""
    if listen.startswith("tcp://"):
        host = listen[len("tcp://"):].rpartition(":")[0].strip("[]")
        if host and host not in ("*", "0.0.0.0", "::"):
            return host
    return socket.gethostname()


def parse_args(argv: list[str] | None = None) -> NodeConfig:
    ap = argparse.ArgumentParser(prog="python -m tessera_actors.node", description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", default="", help="ZeroMQ endpoint to serve on (port 0: any; default "
                                                 "tcp://127.0.0.1:0, or this host's address with --from-env)")
    ap.add_argument("--devices", default="cpu", help="comma-separated device specs, e.g. cpu,cpu?threads=1 or cuda:0,cuda:1?sms=32")
    ap.add_argument("--scheduler", default="", help="scheduler endpoint to register with (optional)")
    ap.add_argument("--name", default="", help="node name (default: host-pid)")
    ap.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    ap.add_argument("--lease", type=float, default=7.0,
                    help="seconds without an answered heartbeat after which the scheduler counts as gone and "
                         "the node exits with status 3")
    ap.add_argument("--register-timeout", type=float, default=30.0,
                    help="seconds to wait for the scheduler to answer the registration (then exit 1)")
    ap.add_argument("--data-plane", default="zmq", choices=DATA_PLANES,
                    help="how transfer bytes reach other nodes: zmq (ZeroMQ frames) or dist (torch.distributed "
                         "point-to-point: NCCL between GPUs, gloo otherwise; headers still go over ZeroMQ)")
    ap.add_argument("--span-bytes", default="4MiB",
                    help="transfers above this size go in spans of it, pipelined (0: never split)")
    ap.add_argument("--dist-host", default="",
                    help="address other nodes reach this node's data-plane links at (default: the --listen host)")
    ap.add_argument("--dist-rendezvous", default="",
                    help="HOST:PORT of one TCPStore all nodes' data-plane links meet in (default: each sending "
                         "node hosts its own; --from-env: the launcher's MASTER_ADDR:MASTER_PORT)")
    ap.add_argument("--from-env", default="", choices=("",) + LAUNCHERS,
                    help="take name, scheduler, address and rendezvous from the job's environment (srun: slurm; "
                         "torchrun or a torchrun-style launcher: torchrun)")
    ap.add_argument("--link-timeout", type=float, default=60.0,
                    help="seconds to connect a data-plane link and for each operation on it")
    ap.add_argument("--recv-timeout", type=float, default=60.0,
                    help="seconds a device waits for the next bytes of a transfer before failing its step")
    ap.add_argument("--keys", default="", help="cluster key directory (from `tessera keys DIR`; or $TESSERA_KEYS)")
    ap.add_argument("--secret", default="", help="a shared secret file all cluster members read (>= 16 bytes)")
    ap.add_argument("--insecure", action="store_true", help="turn authentication off (any local process can "
                                                            "control the node); logged as a warning")
    ap.add_argument("--log-level", default="WARNING")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        hosting = _from_env(a)
        keys = None
        if a.keys or a.secret:
            keys = ClusterKeys.from_dir(a.keys) if a.keys else ClusterKeys.from_secret_file(a.secret)
            auth.use_keys(keys)
        elif not a.insecure and auth.generated_here:
            raise ValueError("no cluster keys: pass --keys DIR (create it with `tessera keys DIR`) or --secret FILE, "
                             "set TESSERA_KEYS, or turn authentication off with --insecure")
        transfer = TransferConfig(a.data_plane, parse_bytes(a.span_bytes), a.dist_host or listen_host(a.listen),
                                  a.link_timeout, a.dist_rendezvous, hosting)
        return NodeConfig(a.listen, parse_devices(a.devices), a.scheduler, a.name, a.heartbeat, a.lease,
                          a.register_timeout, transfer, a.recv_timeout, keys, a.insecure)
    except (ValueError, AuthError) as e:
        ap.error(str(e))
        raise


def _from_env(a: argparse.Namespace) -> bool:
    """Fill the flags left out from ``--from-env``'s job place; returns whether
    this node hosts the data plane's rendezvous store."""
    if not a.from_env:
        a.listen = a.listen or "tcp://127.0.0.1:0"
        return False
    try:
        place = job_place(a.from_env)
    except LaunchEnvError as e:
        raise ValueError(str(e)) from None
    a.name = a.name or place.node_name
    a.scheduler = a.scheduler or place.scheduler
    a.listen = a.listen or f"tcp://{place.host}:0"
    if a.dist_rendezvous:
        return False
    a.dist_rendezvous = place.rendezvous
    return place.hosts_rendezvous


def main(argv: list[str] | None = None) -> NoReturn:
    """Run a node daemon in this process and end the process with its exit status."""
    cfg = parse_args(argv)
    try:
        import uvloop
        status = uvloop.run(serve(cfg))
    except ImportError:
        status = asyncio.run(serve(cfg))
    # Everything of ours is closed (actors stopped, sockets, shared memory, links): leave without the
    # interpreter's teardown.  Tearing torch and the installed plans down took 0.5 s on a loaded CPU box
    # (SIGTERM should exit at once, and a node whose engine is gone within its lease + 1 s), and a
    # data-plane link thread blocked in torch.distributed's C++ (connecting to a store some header named)
    # cannot be stopped: the teardown under it aborted the process.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
