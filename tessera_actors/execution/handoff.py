"""Transfers between device actors of one process, handed over thread to
thread.

A transfer whose sender and receiver are device actors of the same process
skips the transfer actor: the sender's worker thread puts the bytes into
the receiver's :class:`Handoff` (``put``), and the receiver takes them on
its worker thread - which, having run the kernels before the receive, waits
there (``take``: up to a bound, and only while no other work wants the
thread) and goes straight on to the kernels after it - or, once that wait
is over, on its event loop (``wait``).  Each transfer
is handed over exactly once, to whichever asks first; nothing goes through
the event loop unless the worker stopped waiting.

The hand-offs of one actor system live in its :class:`HandoffHub`
(:func:`hub_for`), by actor name: a device actor registers its own when it
starts and puts a transfer into the one its peer registered, so no actor
touches another's state.

Keys are ``(plan_id, step, tag)``.  Bytes for a step that ends without
taking them (it failed) are dropped with the step (``discard``) or the plan
(``drop``).
"""
from __future__ import annotations

import asyncio
import threading
import time
import weakref
from typing import Any, Callable


def _resolve(fut: asyncio.Future, data: Any) -> None:
    if not fut.done():
        fut.set_result(data)


class Handoff:
    """Wake-ups go straight to the one thread waiting for a key: a worker in
    :meth:`take` sleeps on a lock of its own that :meth:`put` releases after
    leaving the shared lock, so the woken thread has nothing to contend for
    (one futex wake-up per hand-off, not a notify and then the condition's
    lock)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._data: dict[tuple, Any] = {}
        self._waiters: dict[tuple, asyncio.Future] = {}    # keys the event loop waits for
        self._sleepers: dict[tuple, Any] = {}              # keys a worker waits for: its held lock
        # ints only, updated under the lock
        self.counts = {"direct_transfers": 0, "direct_bytes": 0, "taken_on_worker": 0, "taken_on_loop": 0}

    def put(self, key: tuple, data: Any) -> None:
        """From any thread: the bytes of transfer ``key``."""
        nbytes = data.numel() * data.element_size() if hasattr(data, "numel") else 0
        sleeper = None
        with self._lock:
            self.counts["direct_transfers"] += 1
            self.counts["direct_bytes"] += nbytes
            fut = self._waiters.pop(key, None)
            if fut is None:
                self._data[key] = data
                sleeper = self._sleepers.pop(key, None)
        if sleeper is not None:
            sleeper.release()
        if fut is not None:
            self._loop.call_soon_threadsafe(_resolve, fut, data)

    def take(self, key: tuple, timeout: float, give_up: Callable[[], bool] = lambda: False,
             poll: float = 0.0005) -> Any | None:
        """On a worker thread: the bytes of ``key``, waiting at most
        ``timeout`` seconds for them, and no longer once ``give_up()`` says
        so (checked every ``poll`` seconds: other work wants the thread);
        None: not here yet."""
        with self._lock:
            if key in self._data:
                self.counts["taken_on_worker"] += 1
                return self._data.pop(key)
            gate = threading.Lock()
            gate.acquire()
            self._sleepers[key] = gate
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or give_up():
                with self._lock:
                    if self._sleepers.get(key) is gate:
                        del self._sleepers[key]
                    if key not in self._data:
                        return None
                break   # put between the last wait and the lock
            if gate.acquire(timeout=min(left, poll)):
                break
        with self._lock:
            self.counts["taken_on_worker"] += 1
            return self._data.pop(key)

    async def wait(self, key: tuple, timeout: float) -> Any:
        """On the event loop: the bytes of ``key``; ``asyncio.TimeoutError``
        after ``timeout`` seconds."""
        with self._lock:
            if key in self._data:
                self.counts["taken_on_loop"] += 1
                return self._data.pop(key)
            fut = self._loop.create_future()
            self._waiters[key] = fut
        try:
            data = await asyncio.wait_for(fut, timeout)
        finally:
            with self._lock:
                if self._waiters.get(key) is fut:
                    del self._waiters[key]
        with self._lock:
            self.counts["taken_on_loop"] += 1
        return data

    def discard(self, plan_id: str, step: int) -> None:
        """Drop what is held for one step of ``plan_id`` (the step ended)."""
        with self._lock:
            for key in [k for k in self._data if k[0] == plan_id and k[1] == step]:
                del self._data[key]

    def prune(self, plan_id: str, tag: str, below: int) -> None:
        """Drop what is held as ``(plan_id, tag, n)`` for every ``n < below``
        (per-step hand-offs that live outside a step's keys, never taken)."""
        with self._lock:
            for key in [k for k in self._data if k[0] == plan_id and k[1] == tag and k[2] < below]:
                del self._data[key]

    def drop(self, plan_id: str) -> None:
        """Drop everything held for ``plan_id`` (uninstalled)."""
        with self._lock:
            for key in [k for k in self._data if k[0] == plan_id]:
                del self._data[key]

    def held(self) -> int:
        with self._lock:
            return len(self._data)


class HandoffHub:
    """The :class:`Handoff` of each device actor of one actor system, by name."""

    def __init__(self) -> None:
        self._by_name: dict[str, Handoff] = {}

    def register(self, name: str, loop: asyncio.AbstractEventLoop) -> Handoff:
        h = self._by_name[name] = Handoff(loop)
        return h

    def unregister(self, name: str, handoff: Handoff) -> None:
        if self._by_name.get(name) is handoff:
            del self._by_name[name]

    def get(self, name: str) -> Handoff | None:
        return self._by_name.get(name)


_HUBS: "weakref.WeakKeyDictionary[Any, HandoffHub]" = weakref.WeakKeyDictionary()


def hub_for(system: Any) -> HandoffHub:
    """The hub of ``system`` (an :class:`~transport.system.ActorSystem`),
    made on first use and gone with the system."""
    hub = _HUBS.get(system)
    if hub is None:
        hub = _HUBS[system] = HandoffHub()
    return hub
