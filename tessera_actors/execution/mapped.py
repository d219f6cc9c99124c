"""A GPU reading a hand-off's bytes out of pinned host memory with its own
SMs (a kernel's loads over PCIe) instead of a copy engine.

Why: a GPU that streams weights keeps its host-to-device copy engine busy
with them, and the copy engine runs the copies of all streams in the order
they were queued, each whole: a hand-off's 64 KB of activations, queued on
the compute stream behind a 112 MiB weight copy on the ring's stream, waited
for all of it (up to 2 ms on an H200; 14 to 21 ms of each Llama-8B batch-8
step, on the step's critical path).  Under unified addressing pinned host
memory is mapped into the GPU's address space at the same address, so an
elementwise kernel on the compute stream reads it directly and waits only
for the stream's earlier work.

Contract (on the device's worker, like every writer): :class:`MappedWriter`
writes a pinned host tensor into ranges of a device buffer on the current
stream; anything else (a device tensor, pageable memory, a torch that
cannot view host memory as a device tensor) goes through the copy it was
given.  As with an asynchronous copy from pinned memory, the sender must
leave the bytes alone until the stream ran the read: the writer keeps the
latest tensor it read until its next call (a sender's pinned ring of two is
reused two sends later, after the step landed).
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

log = logging.getLogger("tessera_actors.device")
_WARNED = False
ALIASES = 4   # host addresses whose device views a writer keeps (a sender's ring of two, reallocated now and then)


class _HostBytes:
    """``n`` bytes at host address ``ptr`` described as device memory
    (``__cuda_array_interface__``); it holds no reference to their owner."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A uint8 tensor on ``device`` over the bytes of pinned ``host`` (no
    copy), or None where this torch or GPU gives none."""
    global _WARNED
    n = host.numel() * host.element_size()
    try:
        view = torch.as_tensor(_HostBytes(host.data_ptr(), n), device=device)
    except (RuntimeError, TypeError, ValueError) as exc:
        if not _WARNED:   # once a process: hand-offs are then copied, behind the weight copies queued before them
            log.warning("%s: no device view of pinned host memory, hand-offs are copied (%s)", device, exc)
            _WARNED = True
        return None
    return view if view.device == device and view.data_ptr() == host.data_ptr() else None


class MappedWriter:
    def __init__(self, arena: torch.Tensor, ranges: Sequence[Sequence[int]],
                 copy: Callable[[torch.Tensor], None]) -> None:
        """``arena``: the device buffer's bytes; ``copy``: the writer that
        copies (used for whatever the SMs cannot read)."""
        self.views = [arena[s:e] for s, e in ranges]
        self.n = sum(e - s for s, e in ranges)
        self.device, self.copy = arena.device, copy
        self.aliases: dict[int, torch.Tensor] = {}   # host address -> its device view
        self.kept: torch.Tensor | None = None        # the bytes read last: unchanged until the stream ran it
        self.reads = 0                               # writes read by the SMs
        self.able = arena.is_cuda

    def __call__(self, data: torch.Tensor) -> None:
        src = self._view(data) if self.able else None
        if src is None:
            self.copy(data)
            return
        pos = 0
        for v in self.views:
            # an elementwise kernel: ``copy_`` between two device tensors would be a memcpy, on a copy engine
            torch.bitwise_or(src[pos:pos + v.numel()], 0, out=v)
            pos += v.numel()
        self.kept = data
        self.reads += 1

    def _view(self, data: torch.Tensor) -> torch.Tensor | None:
        """``data``'s bytes as a device tensor when it is pinned host memory of the right size."""
        if data.is_cuda or not data.is_contiguous() or data.numel() * data.element_size() != self.n:
            return None
        if not data.is_pinned():   # pinned at this address now: a view made of it earlier is valid again
            return None
        ptr = data.data_ptr()
        view = self.aliases.get(ptr)
        if view is None:
            view = device_view(data, self.device)
            if view is None:
                self.able = False   # this torch cannot: copy from now on
                return None
            if len(self.aliases) >= ALIASES:
                self.aliases.pop(next(iter(self.aliases)))
            self.aliases[ptr] = view
        return view


__all__ = ["MappedWriter", "device_view"]
