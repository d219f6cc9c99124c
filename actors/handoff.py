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

Two hand-offs skip the host waits of the plain one:

* :class:`Settling` - a sender whose device queues work (a GPU) puts the
  snapshot as soon as its copy is *queued*, with the event behind it; the
  receiver's worker waits on that event (the driver spins, the GIL is
  released) before it writes the bytes, so the sender's worker does not
  stop for its device and no thread is woken when the bytes are ready.
* :class:`Mailbox` - a receiver whose device can wait on host memory (a
  GPU stream, ``backend.wait_value``) queues, at the receive, a wait on a
  word in pinned memory, the copy from a pinned landing buffer and a write
  of a second word after the copy, and goes on queueing; the sender copies
  its bytes into the landing buffer and writes the first word (``post``),
  then puts a marker so the receiver's worker knows, before any host wait
  of its own, that its device will not wait for ever.  Both words hold
  ``step + 1``: the device waits for "posted >= its step", the sender waits
  for "taken >= its previous post" before overwriting the landing buffer.
  A receiver whose step fails writes the posted word itself (``release``)
  so its stream runs on; its results for that step are thrown away.
"""
from __future__ import annotations

import asyncio
import threading
import time
import weakref
from typing import Any, Callable

import torch


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
        self.mailboxes: dict[tuple, Mailbox] = {}          # (plan_id, tag) -> device-side receive
        # ints only, updated under the lock
        self.counts = {"direct_transfers": 0, "direct_bytes": 0, "taken_on_worker": 0, "taken_on_loop": 0,
                       "device_side_receives": 0}

    def put(self, key: tuple, data: Any) -> None:
        """From any thread: the bytes of transfer ``key``."""
        nbytes = _nbytes(data)
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

    def drop(self, plan_id: str) -> None:
        """Drop everything held for ``plan_id`` (uninstalled), its mailboxes too."""
        with self._lock:
            for key in [k for k in self._data if k[0] == plan_id]:
                del self._data[key]
            for key in [k for k in self.mailboxes if k[0] == plan_id]:
                del self.mailboxes[key]

    def held(self) -> int:
        with self._lock:
            return len(self._data)


class Settling:
    """Bytes whose copy is queued on the sender's device, with the wait
    (``host_wait`` on the event behind the copy) that makes them readable."""

    __slots__ = ("data", "_wait", "_event")

    def __init__(self, data: Any, host_wait: Callable[[Any], None], event: Any) -> None:
        self.data, self._wait, self._event = data, host_wait, event

    def settle(self) -> Any:
        if self._event is not None:
            self._wait(self._event)
            self._event = None
        return self.data


def settled(data: Any) -> Any:
    """The bytes of a hand-off, waited for when they are still being copied."""
    return data.settle() if isinstance(data, Settling) else data


class Posted:
    """The marker a sender puts after :meth:`Mailbox.post` (its bytes went to the landing buffer)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _nbytes(data: Any) -> int:
    if isinstance(data, Settling):
        data = data.data
    if isinstance(data, Posted):
        return data.nbytes
    return data.numel() * data.element_size() if hasattr(data, "numel") else 0


STEP_LIMIT = 2 ** 31 - 2


class Mailbox:
    """One transfer of one plan into a device that waits on host memory (see
    the module's text).  Made by the receiver; ``post`` runs on the sender's
    worker, ``queue`` and ``release`` on the receiver's."""

    POSTED, TAKEN = 0, 16    # int32 words, 64 bytes apart

    def __init__(self, nbytes: int, backend: Any, pinned: bool) -> None:
        self.nbytes = nbytes
        self.landing = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)[:nbytes]
        self.flags = backend.flag_words(32)
        self.words = self.flags.numpy()
        self.backend = backend
        self.last_post = 0       # sender side: value of its last post
        self.last_queued = 0     # receiver side: value its device last waited for

    @staticmethod
    def value(step: int) -> int:
        if not 0 <= step <= STEP_LIMIT:
            raise ValueError(f"step {step} is outside the device-side hand-off's range 0..{STEP_LIMIT}")
        return step + 1

    def post(self, step: int, data: Any, timeout: float) -> None:
        """Sender: the bytes of ``step`` into the landing buffer, then the
        posted word; waits first (up to ``timeout`` s) until the receiver's
        device has copied the previous post out."""
        v = self.value(step)
        if v <= self.last_post:
            raise RuntimeError(f"step {step} posted after step {self.last_post - 1}: a device-side hand-off "
                               "needs the steps of a plan in increasing order")
        deadline = time.monotonic() + timeout
        while int(self.words[self.TAKEN]) < self.last_post:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the receiving device did not copy step {self.last_post - 1}'s bytes "
                                   f"out within {timeout:g} s")
            time.sleep(20e-6)
        src = data.reshape(-1).view(torch.uint8) if data.dtype != torch.uint8 or data.dim() != 1 else data
        if src.numel() != self.nbytes:
            raise ValueError(f"posted {src.numel()} bytes into a landing buffer of {self.nbytes}")
        self.landing.copy_(src)
        self.words[self.POSTED] = v      # after the bytes (x86 stores are seen in order)
        self.last_post = v

    def queue(self, stream: Any, step: int, write: Callable[[Any], None]) -> None:
        """Receiver: queue on ``stream`` the wait for ``step``'s post, the
        copy out of the landing buffer (``write``) and the taken word."""
        v = self.value(step)
        if v <= self.last_queued:
            raise RuntimeError(f"step {step} queued after step {self.last_queued - 1}: a device-side hand-off "
                               "needs the steps of a plan in increasing order")
        be = self.backend
        self.last_queued = v     # first: release() lets this wait pass too
        be.wait_value(stream, self.flags, self.POSTED, v)
        write(self.landing)
        be.write_value(stream, self.flags, self.TAKEN, v)

    def release(self) -> None:
        """Receiver, its step failed: let its device's queued waits pass."""
        if int(self.words[self.POSTED]) < self.last_queued:
            self.words[self.POSTED] = self.last_queued

    def reset(self) -> None:
        """Receiver, after ``release`` and once its device finished: count
        every post as copied out (a sender waiting for it goes on)."""
        self.words[self.TAKEN] = max(int(self.words[self.TAKEN]), int(self.words[self.POSTED]))


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
    """The hub of ``system`` (an :class:`~tessera_actors.runtime.system.ActorSystem`),
    made on first use and gone with the system."""
    hub = _HUBS.get(system)
    if hub is None:
        hub = _HUBS[system] = HandoffHub()
    return hub
