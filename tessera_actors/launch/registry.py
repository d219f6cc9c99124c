"""What the scheduler knows of a launcher's nodes: waits on its registrations.

Both poll the scheduler actor's ``GetStats`` (nodes, their endpoints, the
lost ones) every 20 ms; neither blocks the loop.
"""
from __future__ import annotations

import asyncio
import time

from tessera_actors.runtime.actor import ActorRef
from tessera_actors.runtime.messages import GetStats

POLL_S = 0.02


async def registered(sched: ActorRef, count: int, timeout: float = 60.0) -> None:
    """Return once ``count`` nodes are registered; ``TimeoutError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while len((await sched.ask(GetStats())).values["nodes"]) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} nodes did not register within {timeout:g} s")
        await asyncio.sleep(POLL_S)


async def rejoined(sched: ActorRef, endpoint: str, timeout: float = 60.0) -> bool:
    """Whether a node registers at ``endpoint`` (a restarted node taking its old
    place) and is not lost, within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = (await sched.ask(GetStats())).values
        name = next((n for n, ep in st["endpoints"].items() if ep == endpoint), None)
        if name is not None and name not in st["lost"]:
            return True
        await asyncio.sleep(POLL_S)
    return False
