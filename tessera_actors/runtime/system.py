"""LocalSystem: spawns and names the actors of one process.

A system owns its actors (by unique name).  ``shutdown`` stops every actor
(their pending asks fail with ``ActorDead``); it is idempotent.  Use it as
``async with LocalSystem() as system: ...``.  Reaching actors in other
processes is the networked subclass's job
(:class:`transport.system.ActorSystem`: the same actors, plus a listening
endpoint and remote refs); this module knows nothing of sockets.
"""
from __future__ import annotations

import asyncio

from tessera_actors.runtime.actor import Actor, ActorRef, LocalRef
from tessera_actors.runtime.errors import ActorError, NameTaken, NoSuchActor


class LocalSystem:
    def __init__(self, name: str = "local") -> None:
        self.name = name
        self._actors: dict[str, LocalRef] = {}
        self._closed = False

    # --- local ---------------------------------------------------------------
    async def spawn(self, actor: Actor, name: str) -> ActorRef:
        """Start ``actor`` under ``name``; returns once its ``on_start`` completed.

        Raises ``NameTaken`` for a name in use, or whatever ``on_start`` raised.
        """
        if self._closed:
            raise ActorError(f"system {self.name!r} is shut down")
        if not isinstance(actor, Actor):
            raise TypeError(f"spawn needs an Actor, got {type(actor).__name__}")
        if actor.ref is not None:
            raise ActorError(f"{type(actor).__name__} instance was already spawned as {actor.name!r}")
        if name in self._actors:
            raise NameTaken(f"an actor named {name!r} already exists in system {self.name!r}")
        ref = LocalRef(actor, name, on_exit=self._forget)
        actor.ref, actor.system, actor.name = ref, self, name
        self._actors[name] = ref
        try:
            await ref.start()
        except BaseException:
            actor.ref, actor.system, actor.name = None, None, ""
            raise
        return ref

    def ref(self, name: str) -> ActorRef:
        """Ref to the live local actor ``name``; ``NoSuchActor`` (an ``ActorDead``) if none."""
        ref = self._actors.get(name)
        if ref is None:
            raise NoSuchActor(f"no actor named {name!r} in system {self.name!r}")
        return ref

    def actors(self) -> list[str]:
        """Names of the live local actors."""
        return list(self._actors)

    def _forget(self, ref: LocalRef) -> None:
        if self._actors.get(ref.name) is ref:
            del self._actors[ref.name]

    @property
    def address(self) -> str:
        """The listening address: "" (a local system does not listen)."""
        return ""

    async def remote_ref(self, endpoint: str, name: str) -> ActorRef:
        raise ActorError(f"system {self.name!r} is local: it cannot reach {name!r} at {endpoint!r}")

    async def ref_at(self, endpoint: str, name: str) -> ActorRef:
        """Ref to actor ``name`` at ``endpoint``: the local actor when
        ``endpoint`` is "" or this system's own address, else
        :meth:`remote_ref`."""
        if not endpoint or endpoint == self.address:
            return self.ref(name)
        return await self.remote_ref(endpoint, name)

    # --- lifecycle -----------------------------------------------------------
    async def shutdown(self) -> None:
        """Stop all actors; idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._stop_actors()

    async def _stop_actors(self) -> None:
        refs = list(self._actors.values())
        if refs:
            await asyncio.gather(*(ref.stop() for ref in refs), return_exceptions=True)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()
