"""Host memory a plan's steps copy through, made once per plan and device.

On a GPU a copy between pageable host memory and the device synchronizes
the stream (the host would wait for the kernels queued before it), so a
step's small inputs go up, and its sampled tokens come down, through pinned
memory.  Pinning memory every step costs tens of microseconds a call; these
buffers are pinned once and reused:

* :class:`Uploads` - a ring of pinned slots that host values are written
  into and copied from to the device, queued on the compute stream; a slot
  is written again only once the event after its last copy has passed
  (which, a slot holding many steps' values, it long has);
* :class:`Landings` - the pinned buffers the sampled tokens' copies land
  in, one per step that can be unanswered at once (``slots``): a step's
  buffer is read when the step is answered, before a later step takes it.

On a CPU the values are the device's already: an upload is a tensor of
them, a landing the device tensor itself (no copy).  Blocking: the calling
thread (the device actor's worker) only; not thread-safe.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_ALIGN = 64


class Uploads:
    def __init__(self, device: torch.device, backend: Any, stream: Any, slots: int = 4,
                 nbytes: int = 1 << 16) -> None:
        self.device, self.backend, self.stream = device, backend, stream
        self.pinned = device.type == "cuda"
        self.slots: list[torch.Tensor | None] = [None] * slots
        self.events: list[Any] = [None] * slots   # each slot's event, recorded again after each copy from it
        self.pending = [False] * slots            # whether that record may not have passed yet
        self.nbytes = nbytes
        self.i, self.used = 0, 0

    def put(self, values: Sequence | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """``values`` (a list or a numpy array) in a new 1-D tensor of
        ``dtype`` on the device, its copy queued on the compute stream."""
        if not self.pinned:
            return torch.tensor(values, dtype=dtype, device=self.device)
        n = len(values)
        host = self._take(n * dtype.itemsize).view(dtype)
        host.numpy()[:] = values
        out = torch.empty(n, dtype=dtype, device=self.device)
        out.copy_(host, non_blocking=True)
        self._queued()
        return out

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` for a host tensor ``src``: through a pinned slot
        (queued) when ``dst`` is on a GPU."""
        if not (self.pinned and dst.is_cuda) or src.is_cuda:
            dst.copy_(src)
            return
        nbytes = src.numel() * src.element_size()
        host = self._take(nbytes).view(src.dtype)[:src.numel()].view(src.shape)
        host.copy_(src)
        dst.copy_(host, non_blocking=True)
        self._queued()

    def _queued(self) -> None:
        self.events[self.i] = self.backend.record(self.stream, self.events[self.i])
        self.pending[self.i] = True

    def _take(self, nbytes: int) -> torch.Tensor:
        size = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        slot = self.slots[self.i]
        if slot is None or self.used + size > slot.numel():
            self.i = (self.i + 1) % len(self.slots)
            if self.pending[self.i]:
                self.backend.host_wait(self.events[self.i])   # its last copy, many steps back, has passed
                self.pending[self.i] = False
            slot = self.slots[self.i]
            if slot is None or slot.numel() < size:
                self.nbytes = max(self.nbytes, size)
                slot = self.slots[self.i] = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            self.used = 0
        out = slot[self.used:self.used + nbytes]
        self.used += size
        return out


class Landings:
    def __init__(self, device: torch.device, slots: int) -> None:
        self.pinned = device.type == "cuda"
        self.slots: list[torch.Tensor | None] = [None] * slots
        self.i = 0

    def land(self, src: torch.Tensor) -> torch.Tensor:
        """A host tensor that holds ``src`` once the compute stream got past
        this call (its copy is queued there); the next ``slots - 1`` calls do
        not touch it."""
        if not (self.pinned and src.is_cuda):
            return src if src.device.type == "cpu" else src.cpu()
        n = src.numel()
        self.i = (self.i + 1) % len(self.slots)
        slot = self.slots[self.i]
        if slot is None or slot.numel() < n or slot.dtype != src.dtype:
            slot = self.slots[self.i] = torch.empty(max(n, 1024), dtype=src.dtype, pin_memory=True)
        host = slot[:n].view(src.shape)
        host.copy_(src, non_blocking=True)
        return host
