"""ActorSystem: a :class:`~tessera_actors.runtime.system.LocalSystem` that
also reaches actors in other processes.

It owns at most one listening ROUTER endpoint and one DEALER connection per
remote endpoint, and the ZeroMQ context they share (created lazily).
``shutdown`` stops every actor (their pending asks fail with ``ActorDead``),
fails pending remote asks, closes the sockets and terminates the context; it
is idempotent.  Use it as ``async with ActorSystem() as system: ...``.
"""
from __future__ import annotations

import asyncio
import logging

from tessera_actors.runtime.actor import ActorRef
from tessera_actors.runtime.errors import ActorError
from tessera_actors.runtime.system import LocalSystem
from transport import auth

log = logging.getLogger("tessera_actors.runtime.system")
if not auth.insecure_from_environment():
    # settle this process's default keys now, so that children started before
    # the first system (with this environment) share them
    auth.process_keys()
_ANSWER_FLUSH_SECONDS = 0.02


class ActorSystem(LocalSystem):
    """``shm`` configures the shared-memory path for large tensors to peers on
    this host (``transport.shm.ShmConfig``; default on, 1 MiB threshold).

    Every socket is authenticated (ZeroMQ CURVE, ``transport.auth``): with
    ``keys`` (a ``ClusterKeys``) or by default with this process's keys
    (``auth.process_keys()``: the environment's, else ephemeral ones shared
    with the processes this one starts).  ``insecure=True`` (or
    ``TESSERA_INSECURE=1``) turns authentication off and logs a warning."""

    def __init__(self, name: str = "local", shm=None, keys=None, insecure: bool | None = None):
        super().__init__(name)
        self._shm = shm
        if insecure is None:
            insecure = auth.insecure_from_environment()
        self.keys = None if insecure else (keys or auth.process_keys())
        self._authenticator = None
        self._warned_insecure = False
        self._ctx = None
        self._server = None
        self._peers: dict = {}

    # --- remote --------------------------------------------------------------
    def _context(self):
        if self._closed:
            raise ActorError(f"system {self.name!r} is shut down")
        if self._ctx is None:
            import zmq
            self._ctx = zmq.Context()
        if self.keys is None and not self._warned_insecure:
            self._warned_insecure = True
            log.warning("system %r: authentication is OFF (insecure): any process that reaches its sockets "
                        "can control it", self.name)
        return self._ctx

    async def listen(self, endpoint: str = "tcp://127.0.0.1:0") -> str:
        """Serve local actors to other processes; returns the bound address
        (port resolved).  One listening endpoint per system."""
        from transport.endpoint import Server
        if self._server is not None:
            raise ActorError(f"system {self.name!r} already listens on {self._server.address}")
        ctx = self._context()
        if self.keys is not None and self._authenticator is None:
            self._authenticator = auth.Authenticator(ctx, self.keys)
        self._server = Server(ctx, self._actors.get, shm_config=self._shm, keys=self.keys)
        return self._server.bind(endpoint)

    @property
    def address(self) -> str:
        """The listening address, or "" when not listening."""
        return self._server.address if self._server else ""

    async def remote_ref(self, endpoint: str, name: str) -> ActorRef:
        """Ref to actor ``name`` served at ``endpoint``.  Does not contact the
        peer: an unknown name shows as ``ActorDead`` on the first ask, an
        unreachable peer as ``AskTimeout``."""
        from transport.endpoint import Peer, RemoteRef
        peer = self._peers.get(endpoint)
        if peer is None or peer.closed:
            peer = self._peers[endpoint] = Peer(self._context(), endpoint, shm_config=self._shm, keys=self.keys)
        return RemoteRef(peer, name)

    # --- lifecycle -----------------------------------------------------------
    async def shutdown(self) -> None:
        """Stop all actors, close all sockets, terminate the context; idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._stop_actors()
        if self._server is not None:
            # let the ActorDead answers of remote asks reach the wire before linger-0 close
            await asyncio.sleep(0)
            await asyncio.sleep(_ANSWER_FLUSH_SECONDS)
            self._server.close()
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
