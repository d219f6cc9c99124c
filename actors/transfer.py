"""The transfer actor: moves the bytes of cut edges to the device that needs them.

One per node.  ``Routes`` tells it where each plan device lives (and its
device spec): a local device actor (same process: the tensor object is
handed over, no copy) or a device actor in another process.  Bytes for
another process take the node's *data plane* (``TransferConfig``):

* ``zmq``: ``Deliver`` messages straight to the remote device actor
  (ZeroMQ frames, zero-copy on this side; CUDA bytes are staged to host
  first, off the event loop).
* ``dist``: the bytes go over a torch.distributed link to the remote node
  (``actors/links.py``: NCCL from GPU to GPU, gloo otherwise - the same
  code path), and only a header (``Incoming``) goes over ZeroMQ to the
  remote transfer actor, which receives them and hands them to its local
  device actor as ``Deliver``.  A failed link reaches the receiving device
  as a ``Deliver`` carrying the error, so its step fails at once.

Either plane sends a transfer above ``span_bytes`` as spans (``Deliver``
with a byte offset): staging of span i+1, the wire of span i and the
receiver's write of span i-1 overlap.

``Ship`` is fire-and-forget for the sending device, so its next segment can
start while the bytes travel; order between ships to one destination is kept.
Counters answer ``GetStats``: bytes and transfers (local, remote), remote
messages (``remote_spans``), bytes sent and received over links.  Link
completions come back from link threads as callbacks on the actor's event
loop (``_from_thread``); they only count and forward, never block.
"""
from __future__ import annotations

import asyncio
import logging

import torch

from tessera_actors.execution.spans import split_spans
from actors.links import LinkHub, backend_available
from tessera_actors.runtime.actor import Actor, ActorRef, handler
from tessera_actors.devices import DeviceSpec
from tessera_actors.runtime.errors import ActorError
from tessera_actors.runtime.messages import Deliver, GetStats, Incoming, Ok, Routes, Ship, Stats
from actors.transfer_config import TransferConfig

log = logging.getLogger("tessera_actors.transfer")

def _as_bytes(data: torch.Tensor) -> torch.Tensor:
    return data.reshape(-1).view(torch.uint8)


def _host_copy(flat: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    return flat[offset:offset + nbytes].to("cpu")   # blocking: waits for the GPU


class TransferActor(Actor):
    NAME = "transfer"   # the name node daemons give it; peers send link headers there

    def __init__(self, cfg: TransferConfig | None = None) -> None:
        self.cfg = cfg or TransferConfig()
        self.routes: dict[str, dict[int, tuple[str, str]]] = {}
        self.devices: dict[str, list[str]] = {}
        self.refs: dict[tuple[str, str], ActorRef] = {}
        self.hub: LinkHub | None = None   # created on first use of the dist plane
        self.tasks: set[asyncio.Task] = set()
        self.counts = {"local_bytes": 0, "local_transfers": 0, "remote_bytes": 0, "remote_transfers": 0,
                       "remote_spans": 0, "link_bytes_sent": 0, "link_bytes_received": 0, "link_errors": 0}

    async def on_start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.cfg.host_rendezvous:   # up before any peer's link needs it
            await asyncio.to_thread(lambda: self._hub().store_address)

    async def on_stop(self) -> None:
        if self.hub is not None:
            await asyncio.to_thread(self.hub.close)
        for t in self.tasks:
            t.cancel()

    @handler(Routes)
    def set_routes(self, msg: Routes) -> Ok:
        self.routes[msg.plan_id] = {int(d): (ep, name) for d, ep, name in msg.routes}
        self.devices[msg.plan_id] = list(msg.devices)
        return Ok(f"{len(msg.routes)} routes")

    async def _ref(self, endpoint: str, name: str) -> ActorRef:
        key = (endpoint, name)
        ref = self.refs.get(key)
        if ref is None or not ref.alive:
            ref = await self.system.ref_at(endpoint, name)
            self.refs[key] = ref
        return ref

    def _hub(self) -> LinkHub:
        if self.hub is None:
            self.hub = LinkHub(self.cfg.dist_host, self.cfg.link_timeout_s, self.cfg.rendezvous,
                               self.cfg.host_rendezvous)
        return self.hub

    def _spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _from_thread(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the actor's loop; dropped once the loop is closed (node shutdown)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    @handler(Ship)
    async def ship(self, msg: Ship) -> None:
        try:
            endpoint, name = self.routes[msg.plan_id][msg.dst]
        except KeyError:
            log.error("no route to device %d of plan %r: transfer %d of step %d dropped",
                      msg.dst, msg.plan_id, msg.tag, msg.step)
            return
        data = msg.data
        nbytes = data.numel() * data.element_size()
        if not endpoint:
            await (await self._ref(endpoint, name)).tell(Deliver(msg.plan_id, msg.step, msg.tag, data))
            self.counts["local_bytes"] += nbytes
            self.counts["local_transfers"] += 1
            return
        spans = split_spans(nbytes, self.cfg.span_bytes)
        if self.cfg.data_plane == "dist":
            await self._ship_link(msg, endpoint, name, _as_bytes(data), spans)
        else:
            await self._ship_zmq(msg, await self._ref(endpoint, name), data, spans)
        self.counts["remote_bytes"] += nbytes
        self.counts["remote_transfers"] += 1
        self.counts["remote_spans"] += len(spans)

    async def _ship_zmq(self, msg: Ship, ref: ActorRef, data: torch.Tensor, spans: list[tuple[int, int]]) -> None:
        """Deliver messages, one per span; CUDA span i+1 is staged while span i goes out."""
        flat = _as_bytes(data)
        staged = None
        try:
            for i, (off, n) in enumerate(spans):
                if data.is_cuda:
                    piece = await (staged or asyncio.to_thread(_host_copy, flat, off, n))
                    staged = None
                    if i + 1 < len(spans):
                        staged = asyncio.ensure_future(asyncio.to_thread(_host_copy, flat, *spans[i + 1]))
                else:
                    piece = data if len(spans) == 1 else flat[off:off + n]
                await ref.tell(Deliver(msg.plan_id, msg.step, msg.tag, piece, off))
        finally:
            if staged is not None:
                staged.cancel()

    async def _ship_link(self, msg: Ship, endpoint: str, name: str, flat: torch.Tensor,
                         spans: list[tuple[int, int]]) -> None:
        """Queue each span on the link to ``endpoint`` and send its header;
        headers leave in seq order, so the receiver posts receives in send order."""
        specs = self.devices.get(msg.plan_id) or []
        dst = DeviceSpec.parse(specs[msg.dst]) if msg.dst < len(specs) else DeviceSpec("cpu")
        backend = "nccl" if flat.is_cuda and dst.kind == "cuda" and backend_available("nccl") else "gloo"
        key = (str(flat.device), dst.name) if backend == "nccl" else ()
        hub = self._hub()
        remote = await self._ref(endpoint, self.NAME)
        for off, n in spans:
            def sent(_data, error: str, off=off) -> None:   # on a link thread
                if error:
                    self._from_thread(self._failed_send, msg, endpoint, name, off, error)
            link, seq = hub.send(endpoint, backend, flat[off:off + n], flat.is_cuda and backend == "gloo", sent, key)
            await remote.tell(Incoming(link, seq, msg.plan_id, msg.step, msg.tag, name, off, n,
                                       hub.store_address, backend, dst.name))
            self.counts["link_bytes_sent"] += n

    def _failed_send(self, msg: Ship, endpoint: str, name: str, offset: int, error: str) -> None:
        self.counts["link_errors"] += 1
        self._spawn(self._report_failure(msg, endpoint, name, offset, error))

    async def _report_failure(self, msg: Ship, endpoint: str, name: str, offset: int, error: str) -> None:
        """The bytes will not arrive: tell the receiving device, so its step fails now."""
        try:
            ref = await self.system.remote_ref(endpoint, name)
            await ref.tell(Deliver(msg.plan_id, msg.step, msg.tag, None, offset, f"sender: {error}"))
        except ActorError as e:
            log.warning("could not report the failed transfer %d of step %d to %s/%s: %s",
                        msg.tag, msg.step, endpoint, name, e)

    @handler(Incoming)
    def incoming(self, msg: Incoming) -> None:
        """A header from a peer's transfer actor: post the receive on its link."""
        device = torch.device("cpu")
        if msg.backend == "nccl":
            spec = DeviceSpec.parse(msg.device)
            device = torch.device("cuda", spec.index)

        def done(data, error: str) -> None:   # on a link thread
            self._from_thread(self._landed, msg, data, error)
        self._hub().receive(msg.link, msg.seq, msg.nbytes, msg.store, msg.backend, device, done)

    def _landed(self, msg: Incoming, data, error: str) -> None:
        if error:
            self.counts["link_errors"] += 1
        else:
            self.counts["link_bytes_received"] += msg.nbytes
        self._spawn(self._deliver_local(msg.actor, Deliver(msg.plan_id, msg.step, msg.tag, data, msg.offset, error)))

    async def _deliver_local(self, name: str, msg: Deliver) -> None:
        try:
            await self.system.ref(name).tell(msg)
        except ActorError as e:
            log.warning("transfer %d of step %d for %r dropped: %s", msg.tag, msg.step, name, e)

    @handler(GetStats)
    def stats(self, msg: GetStats) -> Stats:
        values = dict(self.counts)
        values["data_plane"] = self.cfg.data_plane
        values["span_bytes"] = self.cfg.span_bytes
        values["links"] = self.hub.links() if self.hub is not None else []
        return Stats(values)
