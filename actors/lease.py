"""Heartbeat leases between nodes and their scheduler, answered off the
scheduler's mailbox.

The scheduler actor handles one message at a time and may spend a minute
in one (planning, installing a plan), so heartbeats go to a companion
actor, ``LeaseActor`` (named ``<scheduler>-lease``, spawned by the
scheduler), that only stamps them into ``Leases`` and answers at once.  A
node asks a heartbeat every ``--heartbeat`` seconds; no answer for
``--lease`` seconds means its scheduler is gone and the node exits (the
scheduler's lease, the other way, is ``heartbeat_timeout``).  A heartbeat
from a node the scheduler does not know (it restarted) is answered with a
``LookupError``: the node registers again.
"""
from __future__ import annotations

import time

from tessera_actors.runtime.actor import Actor, handler
from tessera_actors.runtime.messages import Heartbeat, Ok

LEASE_SUFFIX = "-lease"


class Leases:
    """Last heartbeat time per registered node (monotonic seconds).

    Written by the scheduler (``grant`` at registration, ``revoke``) and by
    its ``LeaseActor`` (``renew``); both run on one event loop, so no lock."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    def grant(self, node: str) -> None:
        self._seen[node] = time.monotonic()

    def revoke(self, node: str) -> None:
        self._seen.pop(node, None)

    def renew(self, node: str) -> bool:
        if node not in self._seen:
            return False
        self._seen[node] = time.monotonic()
        return True

    def age(self, node: str) -> float:
        """Seconds since the node's last heartbeat (inf when it holds no lease)."""
        seen = self._seen.get(node)
        return float("inf") if seen is None else time.monotonic() - seen


class LeaseActor(Actor):
    """Answers ``Heartbeat`` with ``Ok`` (lease renewed) or ``LookupError`` (register again)."""

    mailbox_size = 4096

    def __init__(self, leases: Leases) -> None:
        self.leases = leases

    @handler(Heartbeat)
    def heartbeat(self, msg: Heartbeat) -> Ok:
        if not self.leases.renew(msg.node):
            raise LookupError(f"node {msg.node!r} is not registered with this scheduler")
        return Ok("renewed")
