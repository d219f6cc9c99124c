"""Thread-to-thread hand-offs between co-located device actors
(tessera_actors/execution/handoff.py): each transfer is taken exactly once, by the worker or by
the event loop, and a worker that stops waiting loses nothing."""
import asyncio
import threading

import pytest
import torch

from tessera_actors.execution.handoff import Handoff


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
        # the thread starts after the wait's first step (the loop runs its callbacks in order): the loop waits first
        sender = threading.Thread(target=h.put, args=(("p", 0, 7), torch.full((3,), 5, dtype=torch.uint8)))
        asyncio.get_running_loop().call_soon(sender.start)
        data = await asyncio.wait_for(waiting, 30)
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
