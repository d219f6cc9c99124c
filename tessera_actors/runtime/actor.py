"""Actors: one asyncio task, one bounded mailbox, one handler per message type.

An actor subclass declares handlers with ``@handler(MsgType, ...)``; a handler
may be sync or async and its return value is the reply to an ``ask``.  Handlers
are looked up by the message's exact type.  The actor's state is touched only
by its own task, so handlers never race each other.

Lifecycle: ``ActorSystem.spawn`` runs ``on_start`` inside the actor's task and
returns only once it completed (if it raises, spawn raises).  ``stop`` is
immediate: a running async handler is cancelled, every pending and queued ask
fails with ``ActorDead``, queued tells are dropped, then ``on_stop`` runs.

Failure: an ask whose handler raises gets ``RemoteError`` (original exception
as ``__cause__``); then ``restart_policy`` decides: ``"resume"`` keeps state and
serves on, ``"restart"`` runs ``on_stop(); on_start()`` and serves on,
``"stop"`` stops the actor.  A message without handler answers the asker with
``UnknownMessage`` (for tells: a logged warning).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from typing import Any, Callable

from tessera_actors.runtime.errors import ActorDead, ActorError, AskTimeout, MailboxFull, RemoteError, UnknownMessage
from tessera_actors.runtime.messages import Ping, Pong

log = logging.getLogger("tessera_actors.runtime.actor")

RESTART_POLICIES = ("resume", "restart", "stop")
_YIELD_EVERY = 256   # messages handled back to back before letting other tasks run


def handler(*msg_types: type) -> Callable:
    """Mark an Actor method as the handler of ``msg_types`` (sync or async)."""
    if not msg_types or not all(isinstance(t, type) for t in msg_types):
        raise TypeError("@handler needs one or more message classes")

    def mark(fn):
        fn.__tessera_handles__ = msg_types
        return fn

    return mark


def _handler_table(cls: type) -> dict[type, tuple[Callable, bool]]:
    names: dict[type, str] = {}
    for klass in reversed(cls.__mro__):
        for attr_name, attr in vars(klass).items():
            for msg_type in getattr(attr, "__tessera_handles__", ()):
                names[msg_type] = attr_name
    table = {}
    for msg_type, attr_name in names.items():
        fn = getattr(cls, attr_name)   # an override in a subclass keeps the routing
        table[msg_type] = (fn, inspect.iscoroutinefunction(fn))
    return table


class Actor:
    """Base class of actors.  ``self.ref``, ``self.system`` and ``self.name``
    are set by ``spawn`` before ``on_start`` runs.  Every actor answers
    ``Ping`` with ``Pong``."""

    mailbox_size: int = 1024
    restart_policy: str = "resume"
    ref: "LocalRef | None" = None
    system: Any = None
    name: str = ""
    _handlers: dict[type, tuple[Callable, bool]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.restart_policy not in RESTART_POLICIES:
            raise ValueError(f"{cls.__name__}.restart_policy must be one of {RESTART_POLICIES}")
        if not isinstance(cls.mailbox_size, int) or cls.mailbox_size < 1:
            raise ValueError(f"{cls.__name__}.mailbox_size must be a positive int")
        cls._handlers = _handler_table(cls)

    async def on_start(self) -> None:
        """Set up state; runs in the actor's task before any message."""

    async def on_stop(self) -> None:
        """Release resources; runs in the actor's task after the last message."""

    @handler(Ping)
    def _answer_ping(self, msg: Ping) -> Pong:
        return Pong(msg.payload)


Actor._handlers = _handler_table(Actor)


class ActorRef:
    """Address of an actor, local or remote; both behave the same.

    * ``tell(msg)``: enqueue, no answer.  Waits while the mailbox is full
      (backpressure); ``ActorDead`` if the actor is stopped.
    * ``ask(msg, timeout)``: the handler's return value.  ``timeout`` (seconds)
      bounds the whole round trip including waiting for mailbox space;
      raises ``AskTimeout``, ``ActorDead``, ``UnknownMessage`` or ``RemoteError``.
    * ``stop()``: stop the actor; returns once it is stopped.  Idempotent.
    """

    name: str

    async def tell(self, msg: Any) -> None:
        raise NotImplementedError

    def tell_nowait(self, msg: Any) -> None:
        """Enqueue without waiting; ``MailboxFull`` instead of backpressure."""
        raise NotImplementedError

    async def ask(self, msg: Any, timeout: float = 10.0) -> Any:
        raise NotImplementedError

    def ask_soon(self, msg: Any, timeout: float = 10.0) -> asyncio.Future:
        """``ask`` sent now, its answer in the returned future (on the
        running loop; cancel it to give up): no task when the ref can send
        at once (a local actor's mailbox with room)."""
        return asyncio.ensure_future(self.ask(msg, timeout))

    async def stop(self) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {'alive' if self.alive else 'dead'}>"


def retrieve_error(fut: asyncio.Future) -> None:
    """A done callback for a future nobody awaits (a fire-and-forget report,
    a cancelled gather): its error is retrieved, so asyncio logs no "exception
    was never retrieved"."""
    if not fut.cancelled():
        fut.exception()


def _forward(src: asyncio.Future, dst: asyncio.Future) -> None:
    """Complete ``dst`` (an ask) as ``src`` (a deferred reply) completed;
    a failure reaches the asker as ``RemoteError`` like any handler error."""
    if dst.done():
        return
    if src.cancelled():
        dst.set_exception(ActorDead("the deferred reply was cancelled"))
    elif src.exception() is not None:
        exc = src.exception()
        err = exc if isinstance(exc, ActorError) else RemoteError(type(exc).__name__, str(exc) or repr(exc))
        if err is not exc:
            err.__cause__ = exc
        dst.set_exception(err)
    else:
        dst.set_result(src.result())


def _expire(fut: asyncio.Future, name: str, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(AskTimeout(f"ask to {name!r} got no answer within {timeout:g} s"))


class LocalRef(ActorRef):
    """Ref to an actor in this process; owns its mailbox and task.

    Messages are passed as objects: nothing is encoded, tensors are not copied.
    The mailbox is a bounded deque of ``(msg, answer)``; the actor's task waits
    on a future only while the deque is empty, and senders blocked on a full
    mailbox wait in ``_putters`` (first come, first served).
    """

    def __init__(self, actor: Actor, name: str, on_exit: Callable[["LocalRef"], None] | None = None):
        self.name = name
        self._actor = actor
        self._mailbox: deque = deque()
        self._capacity = actor.mailbox_size
        self._waiter: asyncio.Future | None = None   # the actor's task, waiting for a message
        self._putters: deque = deque()   # futures of senders waiting for space
        self._task: asyncio.Task | None = None
        self._dead = False
        self._cleaning = False
        self._current: asyncio.Future | None = None
        self._on_exit = on_exit

    @property
    def alive(self) -> bool:
        return not self._dead

    # --- mailbox -------------------------------------------------------------
    def _offer(self, item: tuple) -> bool:
        """Enqueue ``item`` unless the mailbox is full; wakes the idle actor."""
        mailbox = self._mailbox
        if len(mailbox) >= self._capacity:
            return False
        mailbox.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
        return True

    async def _put(self, item: tuple) -> None:
        """Enqueue ``item``, waiting while the mailbox is full; ``ActorDead``
        if the actor stops meanwhile (the item is then not enqueued)."""
        while len(self._mailbox) >= self._capacity:
            putter = asyncio.get_running_loop().create_future()
            self._putters.append(putter)
            try:
                await putter
            except BaseException:
                putter.cancel()
                try:
                    self._putters.remove(putter)
                except ValueError:
                    pass
                if not putter.cancelled():
                    self._wake_putter()   # woken, but leaves the free slot to the next sender
                raise
            if self._dead:
                raise ActorDead(f"actor {self.name!r} stopped before taking the message")
        self._offer(item)

    def _wake_putter(self) -> None:
        putters = self._putters
        while putters:
            putter = putters.popleft()
            if not putter.done():
                putter.set_result(None)
                return

    # --- sending -------------------------------------------------------------
    async def tell(self, msg: Any) -> None:
        if self._dead:
            raise ActorDead(f"actor {self.name!r} is stopped")
        if not self._offer((msg, None)):
            await self._put((msg, None))

    def tell_nowait(self, msg: Any) -> None:
        if self._dead:
            raise ActorDead(f"actor {self.name!r} is stopped")
        if not self._offer((msg, None)):
            raise MailboxFull(f"mailbox of {self.name!r} is full ({self._capacity})")

    async def ask(self, msg: Any, timeout: float = 10.0) -> Any:
        return await self.ask_soon(msg, timeout)

    def ask_soon(self, msg: Any, timeout: float = 10.0) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self._dead:
            fut.set_exception(ActorDead(f"actor {self.name!r} is stopped"))
            return fut
        if not self._offer((msg, fut)):
            return asyncio.ensure_future(self._ask_when_full(msg, fut, timeout))
        timer = loop.call_later(timeout, _expire, fut, self.name, timeout)
        fut.add_done_callback(lambda _: timer.cancel())
        return fut

    async def _ask_when_full(self, msg, fut, timeout):
        try:
            async with asyncio.timeout(timeout):
                await self._put((msg, fut))
                return await fut
        except TimeoutError as exc:
            if isinstance(exc, AskTimeout):
                raise
            raise AskTimeout(f"ask to {self.name!r} got no answer within {timeout:g} s") from None

    def try_deliver(self, msg: Any, fut: asyncio.Future | None) -> bool:
        """Enqueue ``msg`` without waiting; False when the mailbox is full.

        ``fut`` receives the answer: an ``asyncio.Future`` or any object with
        ``done()``, ``set_result()`` and ``set_exception()`` (the transport's
        answer slot); None for a tell.  Used by the transport."""
        if self._dead:
            raise ActorDead(f"actor {self.name!r} is stopped")
        return self._offer((msg, fut))

    async def deliver(self, msg: Any, fut: asyncio.Future | None) -> None:
        """Like ``try_deliver`` but waits while the mailbox is full."""
        if self._dead:
            raise ActorDead(f"actor {self.name!r} is stopped")
        if not self._offer((msg, fut)):
            await self._put((msg, fut))

    # --- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        """Start the actor's task; returns once ``on_start`` completed."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        self._task = loop.create_task(self._run(ready), name=f"actor:{self.name}")
        try:
            await ready
        except asyncio.CancelledError:
            await self.stop()
            raise

    async def stop(self) -> None:
        self._dead = True
        task = self._task
        if task is None or task is asyncio.current_task():
            return   # called from a handler: the loop exits once it returns
        if not self._cleaning and not task.done():
            task.cancel()   # interrupts on_start or a running async handler
        await asyncio.wait([task])

    async def _run(self, ready: asyncio.Future) -> None:
        actor = self._actor
        try:
            await actor.on_start()
        except BaseException as exc:
            self._dead = self._cleaning = True
            if not ready.done():
                ready.set_exception(ActorDead(f"{self.name!r} stopped while starting")
                                    if isinstance(exc, asyncio.CancelledError) else exc)
            self._exit()
            return
        if not ready.done():
            ready.set_result(None)
        try:
            await self._loop(actor)
        except asyncio.CancelledError:
            pass   # stop() cancelled us; clean up below
        finally:
            self._cleaning = True
            self._dead = True
            self._fail_pending()
            try:
                await actor.on_stop()
            except Exception:
                log.exception("on_stop of %r raised", self.name)
            self._exit()

    async def _loop(self, actor: Actor) -> None:
        handlers = type(actor)._handlers
        mailbox = self._mailbox
        take = mailbox.popleft
        loop = asyncio.get_running_loop()
        handled = 0
        while not self._dead:
            while not mailbox:
                self._waiter = waiter = loop.create_future()
                await waiter
            msg, fut = take()
            if self._putters:
                self._wake_putter()
            if fut is not None and fut.done():
                continue   # the asker gave up (timeout or cancel)
            entry = handlers.get(type(msg))
            if entry is None:
                self._unknown(msg, fut)
                continue
            fn, is_async = entry
            self._current = fut
            try:
                result = fn(actor, msg)
                if is_async:
                    result = await result
            except Exception as exc:
                self._current = None
                await self._handler_failed(actor, msg, fut, exc)
                continue
            self._current = None
            if isinstance(result, asyncio.Future):
                # deferred reply: the handler returned a future it resolves
                # later; the mailbox keeps serving meanwhile
                if fut is not None:
                    result.add_done_callback(lambda r, fut=fut: _forward(r, fut))
            elif fut is not None and not fut.done():
                fut.set_result(result)
            handled += 1
            if handled % _YIELD_EVERY == 0:
                await asyncio.sleep(0)   # fairness: sync handlers never suspend

    def _unknown(self, msg: Any, fut: asyncio.Future | None) -> None:
        text = f"actor {self.name!r} ({type(self._actor).__name__}) has no handler for {type(msg).__name__}"
        if fut is None:
            log.warning("dropped tell: %s", text)
        elif not fut.done():
            fut.set_exception(UnknownMessage(text))

    async def _handler_failed(self, actor: Actor, msg: Any, fut, exc: Exception) -> None:
        if fut is None:
            log.error("handler of %r for %s raised", self.name, type(msg).__name__, exc_info=exc)
        else:
            log.debug("handler of %r for %s raised %r", self.name, type(msg).__name__, exc)
            if not fut.done():
                err = RemoteError(type(exc).__name__, str(exc) or repr(exc))
                err.__cause__ = exc
                fut.set_exception(err)
        policy = actor.restart_policy
        if policy == "stop":
            self._dead = True
        elif policy == "restart":
            try:
                await actor.on_stop()
                await actor.on_start()
            except Exception:
                log.exception("restart of %r failed; stopping it", self.name)
                self._dead = True

    def _fail_pending(self) -> None:
        dead = f"actor {self.name!r} stopped"
        if self._current is not None and not self._current.done():
            self._current.set_exception(ActorDead(dead))
        self._current = None
        self._waiter = None
        mailbox = self._mailbox
        while mailbox:
            _, fut = mailbox.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(ActorDead(dead))
        putters = self._putters
        while putters:   # blocked senders: they raise ActorDead
            putter = putters.popleft()
            if not putter.done():
                putter.set_result(None)

    def _exit(self) -> None:
        if self._on_exit is not None:
            self._on_exit(self)
