"""The staging ring's layout (``tessera_actors.planning.offload.staging``) and the
order a streaming program queues its copies in.

On CPU every copy runs when queued, so a missing wait cannot show in the
outputs; here a backend that keeps the queue order (each stream's waits,
copies and event records, as CUDA would run them) checks what a GPU relies
on: no copy overwrites bytes a kernel still has to read, and every kernel
reads the latest copy into its bytes."""
import sys
from pathlib import Path

import pytest
import torch

from tessera_actors.execution.backends.cpu import CpuBackend
from tessera_actors.devices import DeviceSpec
from tessera_actors.planning.offload.staging import ALIGN, lookahead, ring_layout

sys.path.insert(0, str(Path(__file__).parent))
from test_offload_exec import _step, _streaming_pair, tiny_model  # noqa: E402


def overlaps(lay, sizes, i, j):
    return lay.offsets[i] < lay.offsets[j] + sizes[j] and lay.offsets[j] < lay.offsets[i] + sizes[i]


@pytest.mark.parametrize("mode", ["slots", "bytes"])
def test_a_copy_waits_for_every_earlier_copy_whose_bytes_it_overwrites(mode):
    sizes = [300, 5000, 700, 5000, 5000, 120, 4000, 5000, 90]
    lay = ring_layout(sizes, 3, 5000, mode)
    cap = 3 * -(-5000 // ALIGN) * ALIGN
    for i, n in enumerate(sizes):
        assert 0 <= lay.offsets[i] and lay.offsets[i] + n <= cap
        for j in range(i):
            if overlaps(lay, sizes, i, j):
                assert lay.after[i] >= j, (i, j)
    assert list(lay.after) == sorted(lay.after)
    first = [i for i, a in enumerate(lay.after) if a < 0]
    assert first == list(range(len(lay.wrap)))
    for i in first:   # the next step's copy i waits for the last reader of its bytes in this step
        assert lay.wrap[i] >= max(j for j in range(len(sizes)) if overlaps(lay, sizes, i, j))
    if mode == "slots":
        assert list(lay.after) == [i - 3 if i >= 3 else -1 for i in range(len(sizes))]
    else:   # small weights share a slot's bytes: more of them go out at the step's start
        assert len(first) > 3 and all(o % ALIGN == 0 for o in lay.offsets)


def test_the_packed_ring_runs_ahead_across_the_steps_end():
    """Llama-8B's streamed weights at b8 on an H200 (112 and 32 MiB, here in
    KiB) in a ring of three big ones: copied one after the other, every lap
    left its tail unused and the next step's first copy waited for the read
    of this step's last (no copy could run ahead at the step's end); each
    copy now goes where the bytes were read the longest ago."""
    big, small = 112 << 10, 32 << 10
    sizes = [big if c == "B" else small for c in "BBBBsBBssBBsBBssBBsBBsBBssBBsBBssBBsBBssBBsBBsBBssBBsBBssBBsBB"]
    m, cap = len(sizes), 3 * big
    lay = ring_layout(sizes, 3, big, "bytes")
    for i, n in enumerate(sizes):   # the layout's waits hold whatever the placement
        assert lay.offsets[i] % ALIGN == 0 and lay.offsets[i] + n <= cap
        for j in range(i):
            if overlaps(lay, sizes, i, j):
                assert lay.after[i] >= j, (i, j)
    for i in range(len(lay.wrap)):
        assert lay.wrap[i] >= max(j for j in range(m) if overlaps(lay, sizes, i, j))
    assert lay.wrap == (m - 3, m - 2, m - 1)   # the next step's first copies go as the last three are read
    total, least = lookahead(sizes, lay, cap)
    assert least >= big and total > 1.15 * lookahead(sizes, ring_layout(sizes, 3, big, "slots"), cap)[0]


def test_a_weight_the_ring_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        ring_layout([10, 11], 2, 10, "slots")
    with pytest.raises(ValueError, match="does not fit"):
        ring_layout([10, 21], 2, 10, "bytes")
    with pytest.raises(ValueError, match="mode"):
        ring_layout([10], 2, 10, "pages")


class _Event:
    def __init__(self):
        self.at = None   # (stream, position) of its latest record


class QueueBackend(CpuBackend):
    """The CPU seam, keeping the log a GPU would run: per stream, in order,
    its waits (on an event's record at the time of the wait), copies (the
    ring bytes written) and records."""

    def __init__(self):
        super().__init__(DeviceSpec.parse("cpu"))
        self.log = []

    def stream(self, priority=0):
        return f"stream{priority}"

    def record(self, stream, event=None):
        event = event or _Event()
        event.at = (stream or "compute", len(self.log))
        self.log.append(("record", stream or "compute", event))
        return event

    def wait(self, stream, event):
        self.log.append(("wait", stream or "compute", event.at))

    def copy(self, stream, dst, src, back=None):
        self.log.append(("copy", stream, (dst.data_ptr(), dst.data_ptr() + dst.numel())))
        super().copy(stream, dst, src, back)


def check_queue(log):
    """Every copy is queued behind a compute-stream record that follows
    every earlier read of the bytes it writes; every read (a compute wait
    on a copy's record) waits on the latest copy into its bytes."""
    copies = []        # (log position, bytes, position of the record after it)
    reads = []         # (compute position, bytes)
    waited = None      # the copy stream's latest wait: the compute position it waits for
    pending = None
    for pos, (op, stream, what) in enumerate(log):
        if op == "wait" and stream != "compute":
            waited = what[1] if what else -1
        elif op == "copy":
            lo, hi = what
            for at, (rlo, rhi) in reads:
                if rlo < hi and lo < rhi:
                    assert waited is not None and at < waited, f"copy at {pos} overwrites bytes read at {at}"
            pending = (pos, what)
            waited = None   # each copy has a wait of its own, or none
        elif op == "record" and stream != "compute" and pending is not None:
            copies.append((pending[0], pending[1], pos))
            pending = None
        elif op == "wait" and stream == "compute":
            rec = what[1]
            copy = next(c for c in copies if c[2] == rec)
            lo, hi = copy[1]
            later = [c for c in copies if c[0] > copy[0] and c[1][0] < hi and lo < c[1][1]]
            assert not later, f"a read at {pos} waits on a copy whose bytes were written again"
            reads.append((pos, copy[1]))


@pytest.mark.parametrize("mode", ["slots", "bytes"])
def test_copies_never_overwrite_bytes_still_to_be_read_across_steps_and_programs(mode):
    be = QueueBackend()
    tiny = tiny_model(torch.float32)
    g, cap, ref, a, b = _streaming_pair(tiny, mode=mode, backend=be)
    for step, p in enumerate("aaabbab"):
        want, got = _step(g, [ref, a if p == "a" else b], step)
        assert torch.equal(want, got)
    assert sum(op == "copy" for op, *_ in be.log) == a.copies + b.copies > 0
    assert a.ahead_used > 0 and b.ahead_used > 0
    check_queue(be.log)


def test_the_next_steps_first_copy_goes_out_before_the_steps_last_read():
    """The tiny model's 23 streamed weights in a packed ring of three of the
    biggest: the next step's first copy overwrites bytes read two copies
    before the step's end, so the copy stream queues it before the last read
    (wrapping onto the last copy's bytes it waited for that read); the same
    tokens as every weight resident, every copy behind the reads of its bytes."""
    from tessera_actors.execution.program import AtenProgram
    from tessera_actors.execution.streaming import StreamingProgram
    be = QueueBackend()
    cap, _, _ = tiny_model(torch.float32)
    g = cap.graph
    readers = {}
    for k in g.kernels:
        for a in k.accesses:
            if g.buffers[a.buffer].role == "weight":
                readers.setdefault(a.buffer, set()).add(k.id)
    order = sorted((b for b, ks in readers.items() if len(ks) == 1), key=lambda b: min(readers[b]))
    slot = max(g.buffers[b].nbytes for b in order)
    everything = sorted(g.buffers)
    ref = AtenProgram(g, be.device, everything)
    prog = StreamingProgram(g, be.device, everything, order, 3, slot, be, mode="bytes")
    for p in (ref, prog):
        p.load(cap.values)
        for k in range(len(g.kernels)):
            p.bind(k)
    m = len(order)
    for step in range(3):
        want, got = _step(g, [ref, prog], step)
        assert torch.equal(want, got)
    check_queue(be.log)
    copies = [pos for pos, (op, *_) in enumerate(be.log) if op == "copy"]
    reads = [pos for pos, (op, stream, _) in enumerate(be.log) if op == "wait" and stream == "compute"]
    assert len(reads) == 3 * m and prog.ahead_used == 2 * len(prog.layout.wrap)
    assert copies[2 * m] < reads[2 * m - 1]   # step 2's copy 0 queued before step 1's last read
