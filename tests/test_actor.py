"""Actor runtime behaviour as a caller sees it (in-process)."""
import asyncio

import pytest

from tessera_actors.runtime.actor import Actor, handler
from tessera_actors.runtime.errors import (ActorDead, AskTimeout, MailboxFull, NameTaken, NoSuchActor,
                                   RemoteError, UnknownMessage)
from tessera_actors.runtime.messages import Ok, Ping, Pong, message
from transport.system import ActorSystem


@message
class ActAdd:
    n: int = 1


@message
class ActGet:
    pass


@message
class ActBlock:
    """Handled once the actor's ``gate`` is open (the test opens it): a busy handler."""


@message
class ActFail:
    text: str = "boom"


@message
class ActNobodyHandles:
    pass


class Counter(Actor):
    def __init__(self):
        self.starts = 0
        self.stops = 0
        self.gate = asyncio.Event()       # ActBlock handlers wait for it
        self.blocked = asyncio.Event()    # set when an ActBlock handler runs

    async def on_start(self):
        self.total = 0
        self.starts += 1

    async def on_stop(self):
        self.stops += 1

    @handler(ActAdd)
    def add(self, msg):
        self.total += msg.n
        return self.total

    @handler(ActGet)
    def get(self, msg):
        return self.total

    @handler(ActBlock)
    async def block(self, msg):
        self.blocked.set()
        await self.gate.wait()
        return Ok("released")

    @handler(ActFail)
    def fail(self, msg):
        raise ValueError(msg.text)


class RestartingCounter(Counter):
    restart_policy = "restart"


class StoppingCounter(Counter):
    restart_policy = "stop"


@message
class ActWaitGate:
    pass


class TinyMailbox(Counter):
    """Mailbox of 2; ``ActWaitGate`` blocks the actor until ``gate`` is set."""
    mailbox_size = 2

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    @handler(ActWaitGate)
    async def wait_gate(self, msg):
        self.waiting.set()
        await self.gate.wait()


@pytest.fixture
async def system():
    async with ActorSystem("test") as s:
        yield s


async def test_ask_tell_and_ping(system):
    ref = await system.spawn(Counter(), "c")
    await ref.tell(ActAdd(2))
    assert await ref.ask(ActAdd(3)) == 5
    assert await ref.ask(Ping(b"hi")) == Pong(b"hi")
    assert system.ref("c") is ref and ref.alive


async def test_spawn_waits_for_on_start_and_names_are_unique(system):
    class Slow(Actor):
        def __init__(self):
            self.starting, self.gate, self.ready = asyncio.Event(), asyncio.Event(), False

        async def on_start(self):
            self.starting.set()
            await self.gate.wait()
            self.ready = True

    actor = Slow()
    spawning = asyncio.ensure_future(system.spawn(actor, "slow"))
    await asyncio.wait_for(actor.starting.wait(), 5)
    assert not spawning.done()   # on_start has not returned: neither has spawn
    actor.gate.set()
    await asyncio.wait_for(spawning, 5)
    assert actor.ready and actor.name == "slow" and actor.system is system
    with pytest.raises(NameTaken):
        await system.spawn(Counter(), "slow")
    with pytest.raises(NoSuchActor):
        system.ref("nobody")


async def test_on_start_failure_fails_spawn(system):
    class Broken(Actor):
        async def on_start(self):
            raise RuntimeError("no device")

    with pytest.raises(RuntimeError, match="no device"):
        await system.spawn(Broken(), "broken")
    assert "broken" not in system.actors()


async def test_ask_timeout(system):
    actor = Counter()
    ref = await system.spawn(actor, "c")
    with pytest.raises(AskTimeout):
        await ref.ask(ActBlock(), timeout=0.05)
    with pytest.raises(TimeoutError):   # AskTimeout is a TimeoutError; this one waits in the mailbox
        await ref.ask(ActGet(), timeout=0.01)
    actor.gate.set()
    assert await ref.ask(ActAdd(1), timeout=5) == 1   # still serving; the timed-out ask was not handled


async def test_ask_after_stop_is_actor_dead(system):
    actor = Counter()
    ref = await system.spawn(actor, "c")
    await ref.stop()
    await ref.stop()   # idempotent
    assert not ref.alive and actor.stops == 1
    with pytest.raises(ActorDead):
        await ref.ask(ActGet())
    with pytest.raises(ActorDead):
        await ref.tell(ActAdd())
    with pytest.raises(NoSuchActor):
        system.ref("c")


async def test_pending_and_queued_asks_fail_on_stop(system):
    actor = Counter()
    ref = await system.spawn(actor, "c")
    running = asyncio.ensure_future(ref.ask(ActBlock()))
    queued = [asyncio.ensure_future(ref.ask(ActAdd())) for _ in range(3)]
    await asyncio.wait_for(actor.blocked.wait(), 5)   # the first ask is being handled, the others queue
    await ref.stop()
    for fut in [running, *queued]:
        with pytest.raises(ActorDead):
            await fut


async def test_shutdown_fails_pending_asks(system):
    actor = Counter()
    await system.spawn(actor, "c")
    pending = asyncio.ensure_future(system.ref("c").ask(ActBlock()))
    await asyncio.wait_for(actor.blocked.wait(), 5)
    await system.shutdown()
    await system.shutdown()   # idempotent
    with pytest.raises(ActorDead):
        await pending


async def test_unknown_message(system, caplog):
    ref = await system.spawn(Counter(), "c")
    with pytest.raises(UnknownMessage, match="ActNobodyHandles"):
        await ref.ask(ActNobodyHandles())
    await ref.tell(ActNobodyHandles())
    assert await ref.ask(ActAdd()) == 1
    assert "no handler for ActNobodyHandles" in caplog.text


async def test_handler_exception_resume_keeps_state(system):
    ref = await system.spawn(Counter(), "c")
    await ref.ask(ActAdd(5))
    with pytest.raises(RemoteError) as info:
        await ref.ask(ActFail("bad input"))
    err = info.value
    assert err.kind == "ValueError" and err.message == "bad input"
    assert str(err) == "ValueError: bad input"
    assert isinstance(err.__cause__, ValueError)
    assert await ref.ask(ActGet()) == 5


async def test_handler_exception_restart_resets_state(system):
    actor = RestartingCounter()
    ref = await system.spawn(actor, "c")
    await ref.ask(ActAdd(5))
    with pytest.raises(RemoteError):
        await ref.ask(ActFail())
    assert await ref.ask(ActGet()) == 0
    assert (actor.starts, actor.stops) == (2, 1) and ref.alive


async def test_handler_exception_stop_policy(system):
    actor = StoppingCounter()
    ref = await system.spawn(actor, "c")
    failing = asyncio.ensure_future(ref.ask(ActFail()))
    queued = asyncio.ensure_future(ref.ask(ActGet()))
    with pytest.raises(RemoteError):
        await failing
    with pytest.raises(ActorDead):   # was queued behind the failure
        await queued
    assert not ref.alive and actor.stops == 1
    with pytest.raises(ActorDead):
        await ref.ask(ActGet())


async def test_failing_tell_is_logged_and_actor_serves_on(system, caplog):
    ref = await system.spawn(Counter(), "c")
    await ref.tell(ActFail("told"))
    assert await ref.ask(ActAdd()) == 1
    assert "told" in caplog.text


async def busy_with_full_mailbox(system, add=ActAdd()):
    """A TinyMailbox actor stuck in a handler, its mailbox (2) full of ``add``."""
    actor = TinyMailbox()
    ref = await system.spawn(actor, "c")
    blocker = asyncio.ensure_future(ref.ask(ActWaitGate()))
    await actor.waiting.wait()   # the actor is busy; its mailbox is empty
    await ref.tell(add)
    await ref.tell(add)         # mailbox (2) now full
    return actor, ref, blocker


async def test_bounded_mailbox_backpressure(system):
    actor, ref, blocker = await busy_with_full_mailbox(system)
    with pytest.raises(MailboxFull):
        ref.tell_nowait(ActAdd())
    third = asyncio.ensure_future(ref.tell(ActAdd()))
    with pytest.raises(TimeoutError):   # waits for space
        await asyncio.wait_for(asyncio.shield(third), 0.02)
    actor.gate.set()
    await blocker
    await third
    assert await ref.ask(ActGet()) == 3


async def test_ask_timeout_while_mailbox_full(system):
    actor, ref, blocker = await busy_with_full_mailbox(system)
    with pytest.raises(AskTimeout):
        await ref.ask(ActGet(), timeout=0.02)
    actor.gate.set()
    await blocker
    assert await ref.ask(ActGet()) == 2


async def test_blocked_senders_fail_when_the_actor_stops(system):
    actor, ref, blocker = await busy_with_full_mailbox(system)
    blocked_tell = asyncio.ensure_future(ref.tell(ActAdd()))
    blocked_ask = asyncio.ensure_future(ref.ask(ActGet()))
    done, _ = await asyncio.wait({blocked_tell, blocked_ask}, timeout=0.02)
    assert not done   # both wait for space
    await ref.stop()
    for fut in (blocker, blocked_tell, blocked_ask):
        with pytest.raises(ActorDead):
            await asyncio.wait_for(fut, 1)


async def test_blocked_senders_keep_order_and_a_cancelled_one_gives_way(system):
    actor, ref, blocker = await busy_with_full_mailbox(system, ActAdd(1))
    first = asyncio.ensure_future(ref.tell(ActAdd(100)))
    second = asyncio.ensure_future(ref.tell(ActAdd(10)))
    done, _ = await asyncio.wait({first, second}, timeout=0.02)
    assert not done   # both wait for space, first in line
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)   # its cancellation is done: it gave way
    actor.gate.set()
    await blocker
    await asyncio.wait_for(second, 1)
    assert first.cancelled()
    assert await ref.ask(ActGet()) == 12


async def test_local_ask_passes_objects_without_copy(system):
    torch = pytest.importorskip("torch")

    @message
    class ActHold:
        tensor: object = None

    class Holder(Actor):
        @handler(ActHold)
        def hold(self, msg):
            return msg.tensor

    ref = await system.spawn(Holder(), "h")
    t = torch.ones(4)
    assert await ref.ask(ActHold(t)) is t


async def test_stop_from_own_handler(system):
    @message
    class ActQuit:
        pass

    class Quitter(Actor):
        def __init__(self):
            self.stopped = asyncio.Event()

        @handler(ActQuit)
        async def quit(self, msg):
            await self.ref.stop()
            return "bye"

        async def on_stop(self):
            self.stopped.set()

    actor = Quitter()
    ref = await system.spawn(actor, "q")
    assert await ref.ask(ActQuit()) == "bye"
    await asyncio.wait_for(actor.stopped.wait(), 5)   # its loop ended after the answer, and on_stop ran
    assert not ref.alive and "q" not in system.actors()


# --- deferred replies (a handler returns a future it completes later) -------

class _Later(Actor):
    """Answers ``Ping`` only when released by an ``Ok`` message: the mailbox
    must keep serving while the first ask waits."""

    def __init__(self):
        self.pending = []
        self.taken = asyncio.Event()   # a Ping was handled (its answer deferred)

    @handler(Ping)
    def later(self, msg):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((fut, msg.payload))
        self.taken.set()
        return fut

    @handler(Ok)
    def release(self, msg):
        for fut, payload in self.pending:
            if msg.detail == "fail":
                fut.set_exception(ValueError("released with failure"))
            else:
                fut.set_result(Pong(payload))
        self.pending.clear()
        return Ok("released")


async def test_deferred_reply_keeps_the_mailbox_serving():
    async with ActorSystem() as system:
        actor = _Later()
        ref = await system.spawn(actor, "later")
        first = asyncio.ensure_future(ref.ask(Ping(b"a"), timeout=5))
        await asyncio.wait_for(actor.taken.wait(), 5)
        assert not first.done()
        assert (await ref.ask(Ok("go"), timeout=5)).detail == "released"
        assert (await first).payload == b"a"
        actor.taken.clear()
        failing = asyncio.ensure_future(ref.ask(Ping(b"b"), timeout=5))
        await asyncio.wait_for(actor.taken.wait(), 5)
        await ref.ask(Ok("fail"), timeout=5)
        with pytest.raises(RemoteError, match="released with failure"):
            await failing


async def test_ask_soon_answers_like_ask_times_out_and_fails_on_a_stopped_actor(system):
    actor = Counter()
    ref = await system.spawn(actor, "c")
    sent = [ref.ask_soon(ActAdd(1)) for _ in range(3)]   # sent at once, answered in mailbox order
    assert [await f for f in sent] == [1, 2, 3]
    with pytest.raises(RemoteError):
        await ref.ask_soon(ActFail())
    with pytest.raises(AskTimeout):
        await ref.ask_soon(ActBlock(), timeout=0.05)
    actor.gate.set()
    assert await ref.ask_soon(ActGet(), timeout=5) == 3   # still serving
    await ref.stop()
    with pytest.raises(ActorDead):
        await ref.ask_soon(ActGet())


async def test_ask_soon_waits_for_room_in_a_full_mailbox(system):
    actor, ref, blocker = await busy_with_full_mailbox(system)
    later = ref.ask_soon(ActGet(), timeout=5)
    assert not later.done()
    actor.gate.set()
    await blocker
    assert await later == 2
