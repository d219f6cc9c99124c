"""The arrivals of one installed plan on a device: transfer bytes that came
in as ``Deliver`` messages, possibly ahead of their step, possibly in spans.

Owned by the device actor and touched only from its event loop.  ``put``
never waits; ``receive`` waits for the spans of one transfer and hands each
to ``write`` as it arrives, so span i is written while span i+1 is still
on the wire.  A span carrying an error (the data plane lost its peer) fails
the receive at once; silence for ``timeout`` seconds fails it too.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable


log = logging.getLogger("tessera_actors.inbox")


class TransferFailed(RuntimeError):
    """A transfer's bytes did not arrive (timeout) or its sender reported a failure."""


class Inbox:
    """``max_early`` transfers may wait for a step that has not asked for
    them yet, each at most ``ttl`` seconds: spans for steps that never come
    (a peer's stray or hostile ``Deliver``) are dropped, logged, instead of
    piling up.  A dropped transfer that was real fails its step by timeout."""

    def __init__(self, max_early: int = 4096, ttl: float = 300.0) -> None:
        self._queues: dict[tuple[int, int], asyncio.Queue] = {}
        self._early: dict[tuple[int, int], float] = {}   # key -> when its first span came, unclaimed
        self.max_early, self.ttl = max_early, ttl
        self.dropped = 0

    def _queue(self, step: int, tag: int) -> asyncio.Queue:
        q = self._queues.get((step, tag))
        if q is None:
            q = self._queues[(step, tag)] = asyncio.Queue()
        return q

    def put(self, step: int, tag: int, offset: int, data: Any, error: str = "") -> None:
        """One span (``offset`` into the transfer's byte stream) or an error."""
        key = (step, tag)
        if key not in self._queues:
            self._expire()
            if len(self._early) >= self.max_early:
                self.dropped += 1
                log.warning("inbox full (%d early transfers): dropped transfer %d of step %d", self.max_early,
                            tag, step)
                return
            self._early[key] = time.monotonic()
        self._queue(step, tag).put_nowait((offset, data, error))

    def _expire(self) -> None:
        """Drop the early transfers older than ``ttl`` (oldest first; amortised O(1))."""
        limit = time.monotonic() - self.ttl
        early = self._early
        while early:
            key, born = next(iter(early.items()))
            if born >= limit:
                return
            del early[key]
            self._queues.pop(key, None)
            self.dropped += 1
            log.warning("dropped transfer %d of step %d: its step did not come within %g s", key[1], key[0],
                        self.ttl)

    def pending(self) -> int:
        """Transfers with spans waiting for their step."""
        return len(self._queues)

    async def receive(self, step: int, tag: int, nbytes: int,
                      write: Callable[[int, Any], Awaitable[None]], timeout: float,
                      what: str) -> float:
        """Write the ``nbytes`` of transfer ``tag`` of ``step`` span by span
        through ``write(offset, data)``; returns the seconds spent waiting for
        bytes (not writing).  ``what`` names the transfer in errors."""
        q = self._queue(step, tag)
        self._early.pop((step, tag), None)   # claimed: no longer subject to the early-transfer bounds
        got, waited = 0, 0.0
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    # wait_for wraps the get in a task: only when nothing has arrived yet
                    offset, data, error = q.get_nowait() if not q.empty() else await asyncio.wait_for(q.get(), timeout)
                except asyncio.TimeoutError:
                    raise TransferFailed(f"{what} of step {step}: {got} of {nbytes} bytes arrived, then nothing "
                                         f"within {timeout:g} s") from None
                waited += time.perf_counter() - t0
                if error:
                    raise TransferFailed(f"{what} of step {step} failed: {error}")
                await write(offset, data)
                got += data.numel() * data.element_size()
                if got >= nbytes:
                    return waited
        finally:
            if self._queues.get((step, tag)) is q:
                del self._queues[(step, tag)]
