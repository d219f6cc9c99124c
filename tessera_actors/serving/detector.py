"""The deployment's failure detector: is a node there, and is a suspected one back?

A node that misses its pings is *suspected*: the deployment reports it lost
to the scheduler and re-places on the others (its steps are re-routed), but
a pause (SIGSTOP, a GC or swap stall, a slow disk) is not a death.
:class:`Suspects` keeps knocking on every suspected node: once one answers a
ping again, the scheduler re-admits it (``Readmit``: the same process, its
stale plans uninstalled) and ``back(endpoint)`` is called - the launcher's
re-admission hook, the path a restarted node takes too.  A suspected node
that registered again elsewhere under its name (restarted by its launcher
or a job system) is handed to ``back`` at its new endpoint the same way.

Nothing here blocks the loop; every ask has a timeout.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from tessera_actors.runtime.actor import ActorRef, retrieve_error
from tessera_actors.runtime.errors import ActorError
from tessera_actors.runtime.messages import GetStats, Ping, Readmit, ReportLost

log = logging.getLogger("tessera_actors.serving")


async def refused(endpoint: str, timeout: float = 0.2) -> bool:
    """True when a TCP connection to ``endpoint`` (``tcp://host:port``) is
    refused: nothing listens on that port (other failures and non-TCP
    endpoints say nothing)."""
    if not endpoint.startswith("tcp://"):
        return False
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError, asyncio.TimeoutError):
        return False
    writer.close()
    return False


async def answers(system, endpoint: str, heartbeat_s: float, lost_after_s: float) -> bool:
    """Whether the node at ``endpoint`` answers a ping within ``lost_after_s``;
    a ping late by a heartbeat makes the detector knock on the node's TCP
    port: a refused connection means no process listens there any more (a
    killed node), a loss at once instead of at the timeout."""
    try:
        ref = await system.remote_ref(endpoint, "node")
        ask = asyncio.ensure_future(ref.ask(Ping(), timeout=lost_after_s))
        ask.add_done_callback(retrieve_error)   # a detector cancelled at shutdown leaves no unretrieved error
        done, _ = await asyncio.wait({ask}, timeout=heartbeat_s)
        if not done and await refused(endpoint):
            ask.cancel()
            await asyncio.gather(ask, return_exceptions=True)
            return False
        await ask
        return True
    except ActorError:
        return False


class Suspects:
    """Suspected node endpoints (``lost``, by the name they registered
    under), each reported to the scheduler and watched until it answers again
    or registers elsewhere.

    ``sched``: the scheduler; ``ping(endpoint)``: does it answer now;
    ``back(endpoint)``: a suspected node is re-admitted at ``endpoint``.
    ``rejoined`` is set whenever one was (a placement with no node left
    waits on it)."""

    def __init__(self, sched: ActorRef, ping: Callable[[str], Awaitable[bool]], interval_s: float,
                 back: Callable[[str], None]) -> None:
        self.sched, self.ping, self.interval_s, self.back = sched, ping, interval_s, back
        self.names: dict[str, str | None] = {}   # suspected endpoint -> the node name registered there
        self._tasks: dict[str, asyncio.Task] = {}
        self.lost: set[str] = set()
        self._reports: dict[str, asyncio.Task] = {}   # endpoint -> its suspicion's report to the scheduler
        self.rejoined = asyncio.Event()

    def lose(self, endpoints) -> asyncio.Future:
        """Count ``endpoints`` lost now, watch them and report them to the
        scheduler (``ReportLost``: it abandons the placements under way that
        use them), once per suspicion; the future is done when every one is
        reported (a re-placement waits for it, so it never places on them)."""
        for ep in endpoints:
            if ep not in self._reports:
                self.lost.add(ep)
                task = self._reports[ep] = asyncio.get_running_loop().create_task(self._report(ep))
                task.add_done_callback(retrieve_error)
        reported = asyncio.gather(*(self._reports[ep] for ep in endpoints))
        reported.add_done_callback(retrieve_error)   # callers that do not wait (the ping loop) leave no unretrieved error
        return reported

    async def _report(self, endpoint: str) -> None:
        try:
            await self.suspect(endpoint)
            await self.sched.ask(ReportLost(endpoint, "missed its heartbeats"), timeout=120)
        except ActorError as e:
            log.warning("could not report the suspected node at %s: %s", endpoint, e)
            raise

    async def suspect(self, endpoint: str) -> None:
        """Start watching ``endpoint`` (before it is reported lost: the scheduler still says whose it is)."""
        if endpoint in self._tasks:
            return
        st = (await self.sched.ask(GetStats(), timeout=10)).values
        self.names[endpoint] = next((n for n, ep in st["endpoints"].items() if ep == endpoint), None)
        self._tasks[endpoint] = asyncio.get_running_loop().create_task(self._watch(endpoint))

    async def _watch(self, endpoint: str) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                st = (await self.sched.ask(GetStats(), timeout=10)).values
                name = self.names.get(endpoint)
                now_at = st["endpoints"].get(name)
                if now_at and now_at != endpoint and name not in st["lost"]:   # restarted under its name
                    self.back(now_at)
                    return
                if not await self.ping(endpoint):
                    continue
                await self.sched.ask(Readmit(endpoint), timeout=30)
            except ActorError as e:
                log.warning("suspected node at %s not re-admitted yet: %s", endpoint, e)
                continue
            self.back(endpoint)
            return

    def forget(self, name: str | None, endpoint: str) -> list[str]:
        """Node ``name`` is back at ``endpoint``: the endpoints it was
        suspected at (``endpoint`` among them), no longer watched."""
        eps = [ep for ep, n in self.names.items() if ep == endpoint or (name is not None and n == name)]
        for ep in eps:
            self.names.pop(ep, None)
            self.lost.discard(ep)
            self._reports.pop(ep, None)
            task = self._tasks.pop(ep, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        self.rejoined.set()
        return eps

    def stop(self) -> None:
        for task in (*self._tasks.values(), *self._reports.values()):
            task.cancel()
        self._tasks.clear()
        self._reports.clear()
