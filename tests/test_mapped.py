"""A GPU that streams weights reads a co-located CPU's hand-offs from pinned
host memory with its SMs (``execution/mapped.py``), not through its copy
engine, which runs queued weight copies first; whatever the SMs cannot read
(pageable bytes, a CPU arena) is copied as before, with the same bytes."""
import pytest
import torch

from tessera_actors.execution.mapped import MappedWriter


def _writer(device):
    arena = torch.zeros(64, dtype=torch.uint8, device=device)
    ranges = [(4, 20), (40, 56)]
    copied = []

    def copy(data):
        copied.append(data)
        pos = 0
        for s, e in ranges:
            arena[s:e].copy_(data[pos:pos + e - s])
            pos += e - s
    return arena, ranges, MappedWriter(arena, ranges, copy), copied


def _expect(ranges, data):
    want = torch.zeros(64, dtype=torch.uint8)
    pos = 0
    for s, e in ranges:
        want[s:e] = data[pos:pos + e - s]
        pos += e - s
    return want


def test_a_cpu_arena_is_written_by_its_copy():
    arena, ranges, w, copied = _writer("cpu")
    data = torch.arange(32, dtype=torch.uint8)
    w(data)
    assert torch.equal(arena, _expect(ranges, data))
    assert w.reads == 0 and len(copied) == 1


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_bytes_are_read_by_the_gpu_and_pageable_ones_copied(pinned):
    arena, ranges, w, copied = _writer("cuda:0")
    data = torch.empty(32, dtype=torch.uint8, pin_memory=pinned)
    for step in range(3):   # a sender's buffer, written again every step: its device view is made once
        data.copy_(torch.arange(32, dtype=torch.uint8) * (step + 1))
        w(data)
        torch.cuda.synchronize()
        assert torch.equal(arena.cpu(), _expect(ranges, data)), step
    assert (w.reads, len(copied)) == ((3, 0) if pinned else (0, 3))
    assert len(w.aliases) == (1 if pinned else 0)
