"""Who starts the node daemons of a deployment, and tells the engine about them.

A *launcher* is the engine's one hook into how its nodes come to be
(``serving/runtime.py`` uses nothing else of it):

* ``listen`` - where the engine's actor system listens; the nodes register
  with the scheduler there;
* ``await prepare()`` - the device specs of each node when they are known
  before the nodes start (the capture fuses CPU kernels only when every
  device is a CPU), else None;
* ``await start(scheduler)`` - start the nodes (or expect them); returns how
  many will register;
* ``await watch(lost, back)`` - runs until cancelled: ``lost(endpoint)`` at
  once when a node's process ends, ``back(endpoint)`` when the launcher has
  started it again (the engine re-admits it);
* ``await stop()``.

Launchers: :class:`LocalLauncher` (``nodes``: child processes of this one),
:class:`ExternalNodes` (``expect_nodes``: started by Slurm or torchrun,
``launch/env.py``), ``launch.ray.RayLauncher`` (``ray``: Ray actors, restarted
by Ray).  In-process devices have none.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from tessera_actors.cluster import LocalCluster

Notice = Callable[[str], None]


class LocalLauncher:
    """One node process per entry of ``nodes`` on this machine (``LocalCluster``);
    with ``watch_exits`` a node's exit is reported lost at once.  Nothing
    restarts a node."""

    listen = "tcp://127.0.0.1:0"

    def __init__(self, nodes, node_args=(), watch_exits: bool = True) -> None:
        self.nodes, self.node_args, self.watch_exits = list(nodes), list(node_args), watch_exits
        self.cluster: LocalCluster | None = None

    async def prepare(self) -> list[str]:
        return list(self.nodes)

    async def start(self, scheduler: str) -> int:
        self.cluster = LocalCluster(self.nodes, scheduler=scheduler, node_args=self.node_args)
        await self.cluster.start()
        return len(self.nodes)

    async def watch(self, lost: Notice, back: Notice) -> None:
        async def one(node) -> None:
            await node.proc.wait()
            if node.endpoint:
                lost(node.endpoint)
        if self.watch_exits and self.cluster is not None:
            await asyncio.gather(*(one(n) for n in self.cluster.nodes))

    async def stop(self) -> None:
        if self.cluster is not None:
            await self.cluster.stop()


class ExternalNodes:
    """Nodes started by someone else (``srun``, torchrun) that register at
    ``listen``; the engine waits for ``count`` of them.  Their losses are the
    failure detector's to find (pings, a refused port)."""

    def __init__(self, listen: str, count: int) -> None:
        self.listen, self.count = listen, count

    async def prepare(self) -> None:
        return None

    async def start(self, scheduler: str) -> int:
        return self.count

    async def watch(self, lost: Notice, back: Notice) -> None:
        return None

    async def stop(self) -> None:
        return None


def launcher_for(cfg):
    """The launcher of an ``EngineConfig``, or None for in-process devices."""
    if cfg.ray:
        from tessera_actors.launch.ray import RayLauncher
        return RayLauncher(cfg.ray, cfg.node_args)
    if cfg.expect_nodes:
        return ExternalNodes(cfg.listen, cfg.expect_nodes)
    if cfg.nodes:
        return LocalLauncher(cfg.nodes, cfg.node_args, cfg.watch_processes)
    return None
