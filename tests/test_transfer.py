"""Transfer pieces on their own: span arithmetic, the device's inbox, and
torch.distributed links (gloo on CPU; the NCCL path is the same code)."""
import asyncio
import os
import queue
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tessera_actors.execution.spans import split_spans, sub_ranges
from tessera_actors.execution.inbox import Inbox, TransferFailed
from actors.links import LinkHub

ROOT = Path(__file__).resolve().parent.parent


def test_split_spans_cover_the_stream_exactly():
    assert split_spans(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert split_spans(8, 4) == [(0, 4), (4, 4)]
    assert split_spans(4, 4) == [(0, 4)]
    assert split_spans(10, 0) == [(0, 10)]      # 0: never split
    assert split_spans(0, 4) == [(0, 0)]        # an empty transfer is still one message
    with pytest.raises(ValueError):
        split_spans(-1, 4)


def test_sub_ranges_map_stream_slices_to_buffer_ranges():
    ranges = [(100, 104), (200, 206), (300, 301)]   # a stream of 4 + 6 + 1 = 11 bytes
    assert sub_ranges(ranges, 0, 11) == ranges
    assert sub_ranges(ranges, 0, 4) == [(100, 104)]
    assert sub_ranges(ranges, 2, 4) == [(102, 104), (200, 202)]
    assert sub_ranges(ranges, 4, 7) == [(200, 206), (300, 301)]
    assert sub_ranges(ranges, 10, 1) == [(300, 301)]
    assert sub_ranges(ranges, 5, 0) == []
    with pytest.raises(ValueError, match="outside a stream of 11 bytes"):
        sub_ranges(ranges, 8, 4)
    # spans of every size reassemble every byte once
    for size in range(1, 12):
        covered = [b for off, n in split_spans(11, size) for s, e in sub_ranges(ranges, off, n) for b in range(s, e)]
        assert covered == [b for s, e in ranges for b in range(s, e)]


async def test_inbox_writes_spans_in_any_order_and_reports_waiting():
    inbox = Inbox()
    stream = torch.arange(10, dtype=torch.uint8)
    out = torch.zeros(10, dtype=torch.uint8)
    writes = []
    written = asyncio.Event()

    async def write(offset, data):
        writes.append(offset)
        out[offset:offset + data.numel()] = data
        written.set()
    inbox.put(3, 7, 8, stream[8:])        # a span ahead of its step, out of order
    t0 = time.perf_counter()
    task = asyncio.ensure_future(inbox.receive(3, 7, 10, write, timeout=5, what="t7"))
    await asyncio.wait_for(written.wait(), 5)
    assert writes == [8] and not task.done()   # written while the rest is still on its way
    inbox.put(3, 7, 0, stream[:4])
    inbox.put(3, 7, 4, stream[4:8])
    waited = await asyncio.wait_for(task, 5)
    assert torch.equal(out, stream) and 0 < waited <= time.perf_counter() - t0   # it waited for the rest
    assert inbox.pending() == 0


async def test_inbox_fails_on_a_reported_error_and_on_silence():
    inbox = Inbox()

    async def write(offset, data):
        pass
    inbox.put(0, 1, 0, torch.zeros(4, dtype=torch.uint8))
    inbox.put(0, 1, 0, None, "link x failed: Connection closed by peer")
    with pytest.raises(TransferFailed, match="transfer 1 of step 0 failed: link x failed: Connection closed"):
        await inbox.receive(0, 1, 8, write, timeout=5, what="transfer 1")
    t0 = time.monotonic()
    inbox.put(1, 1, 0, torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TransferFailed, match=r"step 1: 4 of 8 bytes arrived, then nothing within 0.2 s"):
        await inbox.receive(1, 1, 8, write, timeout=0.2, what="transfer 1")
    assert time.monotonic() - t0 < 2
    assert inbox.pending() == 0


class Results:
    """Completions of link jobs (they come on link threads)."""

    def __init__(self):
        self.q = queue.Queue()

    def done(self, key):
        return lambda data, error: self.q.put((key, data, error))

    def take(self, n, timeout=20):
        return dict((k, (d, e)) for k, d, e in (self.q.get(timeout=timeout) for _ in range(n)))


def test_gloo_link_pairs_sends_and_receives_by_seq_whatever_order_headers_come():
    sender, receiver = LinkHub("127.0.0.1", 20), LinkHub("127.0.0.1", 20)
    try:
        payloads = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (1000, 0, 1, 70000, 3)]
        sent, got = Results(), Results()
        headers = [sender.send("peer", "gloo", p, False, sent.done(i)) for i, p in enumerate(payloads)]
        assert [seq for _, seq in headers] == [0, 1, 2, 3, 4] and len({link for link, _ in headers}) == 1
        for i in (3, 0, 4, 2, 1):   # headers may come in any order: receives still pair by seq
            link, seq = headers[i]
            receiver.receive(link, seq, payloads[i].numel(), sender.store_address, "gloo", torch.device("cpu"),
                             got.done(i))
        arrived = got.take(5)
        assert all(arrived[i][1] == "" and torch.equal(arrived[i][0], p) for i, p in enumerate(payloads))
        assert all(e == "" for _, e in sent.take(5).values())
        assert sender.links() == ["gloo:send"] and receiver.links() == ["gloo:recv"]
    finally:
        sender.close()
        receiver.close()


def test_link_to_an_unreachable_rendezvous_fails_within_its_timeout():
    hub = LinkHub("127.0.0.1", 1.0)
    got = Results()
    t0 = time.monotonic()
    try:
        hub.receive("nowhere>here/gloo/1", 0, 8, "127.0.0.1:9", "gloo", torch.device("cpu"), got.done(0))
        data, error = got.take(1, timeout=30)[0]
    finally:
        hub.close()
    assert data is None and "could not connect link nowhere>here/gloo/1" in error
    assert time.monotonic() - t0 < 15


SENDER = textwrap.dedent("""
    import sys, threading, torch
    from actors.links import LinkHub
    hub = LinkHub("127.0.0.1", 30)
    link, seq = hub.send("test", "gloo", torch.arange(16, dtype=torch.uint8), False, lambda d, e: None)
    print(link, hub.store_address, flush=True)
    threading.Event().wait()   # alive, mid-transfer, until the test kills it
""")


def test_peer_killed_mid_transfer_fails_the_pending_receive_at_once():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", SENDER], stdout=subprocess.PIPE, text=True, env=env)
    hub = LinkHub("127.0.0.1", 30)
    try:
        link, store = proc.stdout.readline().split()
        got = Results()
        hub.receive(link, 0, 16, store, "gloo", torch.device("cpu"), got.done(0))
        hub.receive(link, 1, 16, store, "gloo", torch.device("cpu"), got.done(1))   # never sent
        data, error = got.take(1)[0]
        assert error == "" and torch.equal(data, torch.arange(16, dtype=torch.uint8))
        proc.kill()
        t0 = time.monotonic()
        data, error = got.take(1, timeout=25)[1]
        assert data is None and f"link {link} (gloo) failed at message 1" in error
        lost = "Connection closed by peer" if "Connection closed by peer" in error else "Connection reset by peer"
        assert lost in error   # (which of the two gloo sees depends on when the kill lands)
        assert time.monotonic() - t0 < 10    # the link's timeout is 30 s: the loss itself was detected
        # a broken link refuses later receives at once, with the reason
        hub.receive(link, 2, 16, store, "gloo", torch.device("cpu"), got.done(2))
        assert lost in got.take(1, timeout=5)[2][1]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        hub.close()
