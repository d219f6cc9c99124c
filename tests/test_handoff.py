"""Thread-to-thread hand-offs between co-located device actors
(actors/handoff.py): each transfer is taken exactly once, by the worker or by
the event loop, and a worker that stops waiting loses nothing."""
import asyncio
import threading

import pytest
import torch

from actors.handoff import Handoff


def test_a_waiting_worker_gets_the_bytes_put_from_another_thread():
    h = Handoff(asyncio.new_event_loop())
    got = {}
    started = threading.Event()

    def worker():
        started.set()
        got["data"] = h.take(("p", 0, 1), timeout=30)

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    h.put(("p", 0, 1), torch.arange(4, dtype=torch.uint8))
    t.join(30)
    assert torch.equal(got["data"], torch.arange(4, dtype=torch.uint8))
    assert h.counts["taken_on_worker"] == 1 and h.counts["direct_bytes"] == 4 and h.held() == 0


def test_bytes_put_before_the_take_are_taken_at_once():
    h = Handoff(asyncio.new_event_loop())
    h.put(("p", 3, 2), torch.ones(8, dtype=torch.uint8))
    assert h.take(("p", 3, 2), timeout=0).sum() == 8
    assert h.take(("p", 3, 2), timeout=0) is None   # handed over once


def test_a_worker_that_gives_up_leaves_the_bytes_to_the_event_loop():
    async def main():
        h = Handoff(asyncio.get_running_loop())
        assert h.take(("p", 0, 7), timeout=5, give_up=lambda: True) is None
        assert h.take(("p", 0, 7), timeout=0.001) is None
        waiting = asyncio.ensure_future(h.wait(("p", 0, 7), timeout=30))
        await asyncio.sleep(0)   # the loop registers its wait first
        threading.Thread(target=h.put, args=(("p", 0, 7), torch.full((3,), 5, dtype=torch.uint8))).start()
        data = await waiting
        assert data.tolist() == [5, 5, 5]
        assert h.counts["taken_on_loop"] == 1 and h.counts["taken_on_worker"] == 0 and h.held() == 0
    asyncio.run(main())


def test_the_event_loop_wait_times_out_when_nothing_comes():
    async def main():
        h = Handoff(asyncio.get_running_loop())
        with pytest.raises(asyncio.TimeoutError):
            await h.wait(("p", 0, 9), timeout=0.01)
        h.put(("p", 0, 9), torch.zeros(2, dtype=torch.uint8))   # late bytes are held, then dropped with the step
        assert h.held() == 1
        h.discard("p", 0)
        assert h.held() == 0
    asyncio.run(main())


def test_many_hand_offs_ping_pong_between_two_threads_in_order():
    h_a, h_b = Handoff(asyncio.new_event_loop()), Handoff(asyncio.new_event_loop())
    n = 300
    seen = []

    def a():
        for i in range(n):
            h_b.put(("p", i, 0), torch.tensor([i % 256], dtype=torch.uint8))
            seen.append(int(h_a.take(("p", i, 1), timeout=30)[0]))

    def b():
        for i in range(n):
            x = h_b.take(("p", i, 0), timeout=30)
            h_a.put(("p", i, 1), x + 1)

    ts = [threading.Thread(target=f) for f in (a, b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert seen == [(i + 1) % 256 for i in range(n)]
    assert h_a.held() == h_b.held() == 0


# -- device-side hand-offs (CPU backend: its "stream" is the calling thread) ----------------------------
from actors.backends.base import CpuBackend  # noqa: E402
from actors.handoff import Mailbox, Settling, settled  # noqa: E402
from tessera_actors.devices import DeviceSpec  # noqa: E402


def mailbox(nbytes=16):
    return Mailbox(nbytes, CpuBackend(DeviceSpec.parse("cpu")), pinned=False)


def test_a_queued_receive_waits_for_the_post_then_copies_the_bytes_and_marks_them_taken():
    mb = mailbox()
    got = {}
    started = threading.Event()

    def receiver():
        started.set()
        mb.queue(None, 5, lambda landing: got.setdefault("bytes", landing.clone()))

    t = threading.Thread(target=receiver)
    t.start()
    started.wait()
    assert "bytes" not in got or got["bytes"] is None
    mb.post(5, torch.arange(16, dtype=torch.uint8), timeout=30)
    t.join(30)
    assert torch.equal(got["bytes"], torch.arange(16, dtype=torch.uint8))
    assert int(mb.words[Mailbox.TAKEN]) == 6 == int(mb.words[Mailbox.POSTED])


def test_a_post_waits_until_the_previous_one_was_copied_out():
    mb = mailbox()
    mb.post(0, torch.zeros(16, dtype=torch.uint8), timeout=30)
    with pytest.raises(TimeoutError, match="did not copy step 0"):
        mb.post(1, torch.ones(16, dtype=torch.uint8), timeout=0.05)
    assert int(mb.landing.sum()) == 0   # not overwritten
    mb.queue(None, 0, lambda landing: None)
    mb.post(1, torch.ones(16, dtype=torch.uint8), timeout=30)
    assert int(mb.landing.sum()) == 16


def test_steps_out_of_order_and_wrong_sizes_are_refused():
    mb = mailbox()
    mb.post(3, torch.zeros(16, dtype=torch.uint8), timeout=1)
    mb.queue(None, 3, lambda landing: None)
    with pytest.raises(RuntimeError, match="increasing order"):
        mb.post(2, torch.zeros(16, dtype=torch.uint8), timeout=1)
    with pytest.raises(RuntimeError, match="increasing order"):
        mb.queue(None, 1, lambda landing: None)
    with pytest.raises(ValueError, match="landing buffer of 16"):
        mb.post(4, torch.zeros(8, dtype=torch.uint8), timeout=1)
    with pytest.raises(ValueError, match="outside"):
        mb.post(-1, torch.zeros(16, dtype=torch.uint8), timeout=1)


def test_a_released_receive_runs_on_and_a_reset_lets_the_next_post_go():
    mb = mailbox()
    mb.post(0, torch.zeros(16, dtype=torch.uint8), timeout=1)   # the receiver never queued step 0
    done = threading.Event()

    def receiver():   # step 1 queued; its sender failed before posting
        mb.queue(None, 1, lambda landing: None)
        done.set()

    t = threading.Thread(target=receiver)
    t.start()
    assert not done.wait(0.05)
    mb.release()
    t.join(30)
    assert done.is_set()
    mb.reset()
    mb.post(2, torch.ones(16, dtype=torch.uint8), timeout=1)   # not held up by the lost steps
    mb.queue(None, 2, lambda landing: None)
    assert int(mb.words[Mailbox.TAKEN]) == 3


def test_settling_bytes_are_waited_for_once_before_they_are_read():
    waits = []
    s = Settling(torch.ones(2), waits.append, "event")
    assert torch.equal(settled(s), torch.ones(2)) and waits == ["event"]
    assert torch.equal(settled(s), torch.ones(2)) and waits == ["event"]
    plain = torch.zeros(1)
    assert settled(plain) is plain
    h = Handoff(asyncio.new_event_loop())
    h.put(("p", 0, 1), Settling(torch.zeros(6, dtype=torch.uint8), waits.append, None))
    assert h.counts["direct_bytes"] == 6
