"""One thread that runs a device's calls in order, for an event loop.

A device actor hands its torch work to one thread (streams and green
contexts belong to the thread that uses them) and its landing waits to
another.  :meth:`Worker.call`, made on the loop, queues ``fn(*args)`` and
gives an asyncio future the thread completes through the loop's
``call_soon_threadsafe``: one queue put and one wake-up per call, where
``loop.run_in_executor`` adds a ``concurrent.futures`` future, the
executor's lock and semaphore and a chained asyncio future (about half the
loop's CPU for each call, measured on the CPU box; a decode step makes one
or two).  :meth:`Worker.submit` is the same from any thread, with a
``concurrent.futures.Future`` (tests, and callers not on the loop).

Contract: calls run one at a time in the order queued; ``pending`` counts
those queued and not started (read by any thread; each of its two counts
is written by one side only).  ``shutdown``
(on the loop) cancels the calls not started; the one running finishes and
the thread then exits.  Not for use after ``shutdown``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from typing import Any, Callable

_STOP = object()


def _resolve(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if fut.done():   # cancelled meanwhile (the caller gave up, or shutdown)
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


def _raise(err: BaseException) -> None:
    raise RuntimeError(f"the worker thread could not start: {type(err).__name__}: {err}") from err


class Worker:
    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        """Start the thread ``name``; ``initializer()`` runs there first."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = self._started = 0   # written by the callers' side, by the thread
        self._thread = threading.Thread(target=self._run, args=(initializer,), name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return self._queued - self._started

    def call(self, fn: Callable, *args) -> asyncio.Future:
        """``fn(*args)`` on the thread; its result (or exception) in the future.
        Called on the running event loop, which the future belongs to."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queued += 1
        self._queue.put((fn, args, fut, loop))
        return fut

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """``fn(*args)`` on the thread, from any thread."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queued += 1
        self._queue.put((fn, args, fut, None))
        return fut

    def shutdown(self) -> None:
        """Cancel the calls not started; the thread ends after the running one."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                self._queued -= 1
                item[2].cancel()
        self._queue.put(_STOP)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end (after
        :meth:`shutdown`); whether it did.  A stopping device waits here, so
        that no call is still inside torch when the process exits (torch
        aborts the process: "terminate called without an active exception")."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self, initializer: Callable[[], None] | None) -> None:
        broken = None   # the initializer's error: every call fails with it
        if initializer is not None:
            try:
                initializer()
            except BaseException as e:  # noqa: BLE001 - each call reports it
                broken = e
        get = self._queue.get
        while True:
            item = get()
            if item is _STOP:
                return
            self._started += 1
            _run_one(*item, broken)
            item = None   # nothing of a call is kept while waiting for the next (an uninstalled program is freed)


def _run_one(fn: Callable, args: tuple, fut, loop, broken: BaseException | None) -> None:
    """One call on the thread: its result to ``fut`` (through ``loop`` for an asyncio future)."""
    if broken is not None:
        fn, args = _raise, (broken,)
    if loop is None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
        return
    try:
        value, ok = fn(*args), True
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        value, ok = e, False
    try:
        loop.call_soon_threadsafe(_resolve, fut, ok, value)
    except RuntimeError:   # the loop closed: nobody waits for the answer
        pass


__all__ = ["Worker"]
