"""The transfer actor: moves the bytes of cut edges to the device that needs them.

One per node.  ``Routes`` tells it where each plan device lives: a local
device actor (same process: the tensor object is handed over, no copy) or a
device actor in another process (ZeroMQ frames, zero-copy on this side).
``Ship`` is fire-and-forget for the sending device, so its next segment can
start while the bytes travel; order between ships to one destination is kept.
Counters (bytes and transfers, local and remote) answer ``GetStats``.
"""
from __future__ import annotations

import asyncio
import logging

from tessera_actors.actor import Actor, ActorRef, handler
from tessera_actors.messages import Deliver, GetStats, Ok, Routes, Ship, Stats

log = logging.getLogger("tessera_actors.transfer")


class TransferActor(Actor):
    def __init__(self) -> None:
        self.routes: dict[str, dict[int, tuple[str, str]]] = {}
        self.refs: dict[tuple[str, str], ActorRef] = {}
        self.counts = {"local_bytes": 0, "local_transfers": 0, "remote_bytes": 0, "remote_transfers": 0}

    @handler(Routes)
    def set_routes(self, msg: Routes) -> Ok:
        self.routes[msg.plan_id] = {int(d): (ep, name) for d, ep, name in msg.routes}
        return Ok(f"{len(msg.routes)} routes")

    async def _ref(self, endpoint: str, name: str) -> ActorRef:
        key = (endpoint, name)
        ref = self.refs.get(key)
        if ref is None or not ref.alive:
            ref = self.system.ref(name) if not endpoint else await self.system.remote_ref(endpoint, name)
            self.refs[key] = ref
        return ref

    @handler(Ship)
    async def ship(self, msg: Ship) -> None:
        try:
            endpoint, name = self.routes[msg.plan_id][msg.dst]
        except KeyError:
            log.error("no route to device %d of plan %r: transfer %d of step %d dropped",
                      msg.dst, msg.plan_id, msg.tag, msg.step)
            return
        ref = await self._ref(endpoint, name)
        data = msg.data
        if endpoint and getattr(data, "is_cuda", False):
            # the wire carries host bytes: stage off the event loop (the copy waits for the GPU)
            data = await asyncio.to_thread(data.to, "cpu")
        await ref.tell(Deliver(msg.plan_id, msg.step, msg.tag, data))
        kind = "remote" if endpoint else "local"
        self.counts[f"{kind}_bytes"] += msg.data.numel() * msg.data.element_size()
        self.counts[f"{kind}_transfers"] += 1

    @handler(GetStats)
    def stats(self, msg: GetStats) -> Stats:
        return Stats(dict(self.counts))
