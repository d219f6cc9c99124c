"""Weights homed in host memory and streamed to the device ahead of use: the
executor side of ``tessera_actors/planning/offload``.

A plan made by the offload planner says in ``meta["offload"]`` which weight
buffers the budgeted device streams (``streamed``, in the order of their
readers), into how many staging slots (``slots``) of ``slot_bytes`` each.
:func:`program_for` gives that device a :class:`StreamingProgram`: an
:class:`~tessera_actors.execution.program.AtenProgram` whose streamed weights live in
host memory (pinned on CUDA) and whose kernels read them from a slot.

Contract of a step (every method runs on the device actor's worker thread):

* copy ``i`` goes where the ring's layout puts it
  (:func:`~tessera_actors.planning.offload.staging.ring_layout`: slot ``i % slots``,
  or packed by bytes) on the ring's copy stream, after the event recorded
  behind the reader of the latest earlier copy whose bytes it overwrites (no
  byte is overwritten while a kernel may still read it);
* the kernels up to and including the reader of copy ``i`` (those after the
  previous reader: light ones) run as one piece, which waits on the compute
  stream for the event behind copy ``i``, so the copy overlaps the pieces
  before it;
* each copy is queued right after that reader, so the copy stream stays as
  far ahead as the ring allows; the reader of the last copy of a step into
  some bytes queues the next step's first copy into them (the weights do
  not change between steps), so the copy stream goes on across
  the step boundary instead of idling until the next step's first kernel
  (on an H200 at batch 1, 4.4 ms a step).  Those copies are used only when
  the next step of the ring is this program's: a step of another program of
  the share group (another bucket) takes the ring over, and this program's
  next step queues its first copies again; a load of new values into any
  program of the group drops them too (the group shares the host homes).

On CPU the copies run when queued and every event is complete at once, so CI
runs this same order.  The device's ``mem=`` budget counts the resident
buffers and the slots, not the host homes.  A streaming program splits a
run of kernels into :meth:`~StreamingProgram.pieces` ending at streamed
readers; the device's segment runner runs each piece through its one
capture/replay cache (eager the first time, one CUDA graph the second,
replayed after), so copies and events stay outside graphs and prefetch
crosses runs (copies overlap the CPU's kernels between two GPU runs).

:class:`Throttle` slows a program down by a factor (``cpu?slow=4``): every
kernel run is followed by a sleep of ``(slow - 1)`` times its duration, the
stand-in for another process taking the cores, for load-aware re-planning.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Iterator, Sequence

import torch

from tessera_actors.execution.program import AtenProgram, BackendError
from tessera_actors.graph import KernelGraph
from tessera_actors.planning.offload.staging import ring_layout, slot_pitch
from tessera_actors.plan import Plan


def streamed_buffers(plan: Plan, device: int) -> list[int]:
    """The weight buffers device ``device`` streams under ``plan`` (copy order)."""
    off = plan.meta.get("offload") or {}
    return list(off.get("streamed", ())) if off.get("device") == device else []


class Staging:
    """A device's staging ring: ``slots`` slots of ``slot_bytes`` bytes of
    device memory, each starting at a multiple of ``ALIGN`` (``nbytes``: what
    the ring allocates; ``slot``: its slots as views), the copy stream, and the event behind
    the last streamed read of the ring.  The streaming programs of one
    share group (a served model's buckets) share one ring; their steps must
    then use it one at a time (the device actor runs them under one lock):
    a step that finds no copies of its own queued ahead (``ahead``) queues
    its first copies behind that last read."""

    def __init__(self, device: torch.device, slots: int, slot_bytes: int, backend: Any) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        pitch = slot_pitch(slot_bytes)   # slots start aligned, as separate allocations would
        self.nbytes = slots * pitch
        self.buf = torch.zeros(max(slots * pitch, 1), dtype=torch.uint8, device=device)
        self.slot = [self.buf[k * pitch:k * pitch + slot_bytes] for k in range(slots)]
        self.copy_stream = backend.stream(priority=-1) if slots else None
        self.last_read: Any = None   # (event,) behind the latest streamed reader, any program's
        self.ahead: Any = None       # the program whose next step's first copies are queued in the ring


class StreamingProgram(AtenProgram):

    def __init__(self, graph: KernelGraph, device: torch.device, buffer_ids: Iterable[int],
                 streamed: Sequence[int], slots: int, slot_bytes: int, backend: Any,
                 memory_limit: int | None = None, shared: dict[int, torch.Tensor] | None = None,
                 ring: Staging | None = None,
                 homes: dict[int, torch.Tensor] | None = None, mode: str = "slots") -> None:
        """``ring``: a shared :class:`Staging` (its bytes are the caller's to
        count), else the program's own; ``homes``: host tensors that are the
        homes of streamed weights (shared by the programs of a share group),
        the others get their own; ``mode``: how copies fill the ring
        (:func:`~tessera_actors.planning.offload.staging.ring_layout`)."""
        ids = set(buffer_ids)
        self.streamed = [b for b in streamed if b in ids]
        if self.streamed and slots < 1:
            raise BackendError(f"{device}: {len(self.streamed)} streamed weights but no staging slot")
        if ring is not None and (ring.slots, ring.slot_bytes) != (slots, slot_bytes):
            raise BackendError(f"{device}: plan wants {slots} staging slots of {slot_bytes} bytes, the share "
                               f"group's ring has {ring.slots} of {ring.slot_bytes}")
        staging = slots * slot_pitch(slot_bytes) if self.streamed and ring is None else 0
        own = sum(graph.buffers[b].nbytes for b in ids - set(self.streamed) if b not in (shared or {}))
        if memory_limit is not None and own + staging > memory_limit:
            raise BackendError(f"{device}: plan needs {own} bytes of buffers and {staging} of staging, "
                               f"budget is {memory_limit} (short by {own + staging - memory_limit})")
        sizes = [graph.buffers[b].nbytes for b in self.streamed]
        try:
            self.layout = ring_layout(sizes, slots, slot_bytes, mode)
        except ValueError as e:
            raise BackendError(f"{device}: {e}") from None
        super().__init__(graph, device, ids - set(self.streamed), memory_limit, shared)
        self.nbytes = own + staging
        self.backend, self.slots = backend, slots
        pin = device.type == "cuda"
        homes = homes or {}
        self.home = {b: homes[b] if b in homes else
                     torch.zeros(max(graph.buffers[b].nbytes, 1), dtype=torch.uint8, pin_memory=pin)
                     for b in self.streamed}
        self.ring = ring if ring is not None else Staging(device, slots if self.streamed else 0, slot_bytes, backend)
        for i, (b, n) in enumerate(zip(self.streamed, sizes)):
            at = self.layout.offsets[i]
            self.arena[b] = self.ring.buf[at:at + max(n, 1)]   # views bind to the ring's own storage
        self.index = {}                             # reader kernel -> copy indices
        for k in graph.kernels:
            for a in k.accesses:
                if a.buffer in self.home:
                    i = self.streamed.index(a.buffer)
                    if i not in self.index.get(k.id, []):
                        self.index.setdefault(k.id, []).append(i)
        readers: dict[int, int] = {}
        for idx in self.index.values():
            for i in idx:
                readers[i] = readers.get(i, 0) + 1
        many = [self.streamed[i] for i, n in readers.items() if n > 1]
        if many:
            raise BackendError(f"streamed weights {many[:4]} have several reader kernels; a slot is freed after "
                               "the one reader of its weight")
        self.copy_stream = self.ring.copy_stream
        m = len(self.streamed)
        self.copied: list[Any] = [None] * m      # (event,) behind copy i of this step, once queued
        self.copy_ev: list[Any] = [None] * m     # copy i's event object, recorded again every step
        self.read_ev: list[Any] = [None] * m     # the event behind copy i's reader, likewise
        self.queued = 0                          # copies of this step queued so far (in order)
        self.queued_ahead = 0                    # copies of the next step queued by this one
        # copy i: (its bytes in the ring, its host home), views made once
        self.views = [(self.arena[b][:n], self.home[b][:n]) for b, n in zip(self.streamed, sizes)]
        self.first: int | None = None                           # first kernel of this device in a step
        self.copies = 0
        self.copied_bytes = 0
        self.ahead: dict[int, Any] = {}   # copy index -> (event,): next step's copies queued by this step
        self.ahead_used = 0               # copies a step found queued by the step before it
        self.probe: Any = None            # the step probe of a probed step (``execution/probe.py``), else None
        self.read_mark: dict[int, Any] = {}   # probed: copy index -> the stamp behind its reader

    def load(self, values: dict[int, torch.Tensor]) -> None:
        # copies queued ahead hold the old values, whichever program of the share group (they share homes)
        # queued them; and one may still be reading a home: let the copy stream finish first
        self._drain()
        self.ahead, self.ring.ahead = {}, None
        for b, v in values.items():
            if b in self.home:
                self.home[b][: v.numel()].copy_(v.reshape(-1).view(torch.uint8))
        super().load({b: v for b, v in values.items() if b not in self.home})

    def bind(self, kid: int):
        self.first = kid if self.first is None else min(self.first, kid)
        return super().bind(kid)

    def settle(self) -> None:
        """Return once the copies this program queued are done (the copies
        ahead of a next step have no reader to wait for them); they are
        dropped.  On the worker, before the program goes."""
        self._drain()
        self._drop_ahead()

    def _drain(self) -> None:
        """Return once the ring's copy stream has done what is queued on it."""
        if self.streamed and self.copy_stream is not None:
            be = self.backend
            be.host_wait(be.record(self.copy_stream))

    def _drop_ahead(self) -> None:
        self.ahead = {}
        if self.ring.ahead is self:
            self.ring.ahead = None

    def _start(self, compute) -> None:
        """A new step: its first copies, unless the step before queued them
        into the ring and no other program used the ring since; those it
        queues now wait for the ring's last read (a step that failed halfway
        or another program's may have read any of its bytes)."""
        ahead = self.ahead if self.ring.ahead is self else {}
        self.ahead, self.ring.ahead = {}, None   # this step takes the ring over
        if self.probe is None and self.read_mark:
            self.read_mark = {}   # a probed step's stamps, stale now
        self.copied = [None] * len(self.streamed)
        self.queued = self.queued_ahead = 0
        after = self.layout.after
        while self.queued < len(after) and after[self.queued] < 0:
            i = self.queued
            if i in ahead:
                self.copied[i] = ahead[i]
                self.ahead_used += 1
            else:
                self._issue(i, self.ring.last_read, compute, self.read_mark.get("last"))
            self.queued += 1

    def _issue(self, i: int, wait: Any, compute, freed: Any = None, ahead: bool = False) -> tuple:
        """Queue copy ``i`` on the copy stream behind ``wait`` ((event,) or
        None); the worker's current stream, ``compute``, is made current
        again after.  Returns the copy's (event,).  Probed: the copy is
        recorded with the stamp of the read that freed its bytes
        (``freed``) and, ``ahead``, as the next step's."""
        be, probe = self.backend, self.probe
        if wait is not None:
            be.wait(self.copy_stream, wait[0])
        dst, src = self.views[i]
        if probe is not None:
            issued, s0 = probe.now(), probe.mark(self.copy_stream)
        be.copy(self.copy_stream, dst, src, compute)
        if probe is not None:
            probe.add("copy", f"copy {i}", s0, probe.mark(self.copy_stream), probe.step + ahead, copy=i,
                      bytes=dst.numel(), issued=issued, freed=freed)
        # copy i's event, recorded again: the reader of the copy it last marked queued its wait already
        self.copy_ev[i] = (be.record(self.copy_stream, self.copy_ev[i][0] if self.copy_ev[i] else None),)
        self.copied[i] = self.copy_ev[i]
        self.copies += 1
        self.copied_bytes += dst.numel()
        return self.copy_ev[i]

    def _read(self, i: int, compute) -> None:
        """Copy ``i``'s reader is queued: record the event behind it, queue
        every copy of this step whose bytes only it held until now, and the
        next step's first copies that overwrite no byte still to be read."""
        be, lay, marks = self.backend, self.layout, self.read_mark
        self.read_ev[i] = (be.record(compute, self.read_ev[i][0] if self.read_ev[i] else None),)
        self.ring.last_read = self.read_ev[i]
        if self.probe is not None:
            marks[i] = marks["last"] = self.probe.mark(compute)
        while self.queued < len(lay.after) and lay.after[self.queued] <= i:
            self._issue(self.queued, self.read_ev[lay.after[self.queued]], compute, marks.get(lay.after[self.queued]))
            self.queued += 1
        while self.queued_ahead < len(lay.wrap) and lay.wrap[self.queued_ahead] <= i:
            j = self.queued_ahead
            self.ahead[j] = self._issue(j, self.read_ev[lay.wrap[j]], compute, marks.get(lay.wrap[j]), True)
            self.ring.ahead = self
            self.queued_ahead += 1

    def pieces(self, kernel_ids: Iterable[int]) -> Iterator[list[int]]:
        """The kernels as pieces, each ending at a streamed weight's reader
        (the last piece: the kernels after the last reader).  Before a piece
        is yielded the compute stream waits for its reader's copy (its other
        kernels are light), so a streamed weight costs one wait and one event;
        after it was queued, the copies its read frees are issued.  Whoever
        iterates runs each piece on the compute stream (the device's
        :class:`~tessera_actors.execution.segments.SegmentRunner`: eager,
        then captured and replayed as a CUDA graph); an exception thrown
        into the iteration records the ring's last read behind whatever the
        piece queued, then propagates."""
        be = self.backend
        compute = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        piece: list[int] = []
        for kid in kernel_ids:
            if kid == self.first:   # a new step: the first copies go out at once
                self._start(compute)
            piece.append(kid)
            mine = self.index.get(kid)
            if mine is None:
                continue
            for i in mine:
                if self.copied[i] is None:
                    raise BackendError(f"kernel {kid} reads streamed weight {self.streamed[i]} before its copy "
                                       "was queued (plan out of copy order, or a ring too small for it)")
                be.wait(compute, self.copied[i][0])
            try:
                yield piece
            except BaseException:
                # the reader may have queued work before it raised: the next step's first copies wait for it
                self.ring.last_read = (be.record(compute),)
                raise
            piece = []
            for i in sorted(mine):
                self._read(i, compute)
        if piece:
            yield piece

    def run(self, kernel_ids: Iterable[int]) -> None:
        """Every piece run eagerly (a device actor runs them through its
        runner's cache instead)."""
        for piece in self.pieces(kernel_ids):
            self.run_kernels(piece)


class Throttle:
    """Wraps a program's ``run``: each call takes ``slow`` times as long."""

    def __init__(self, prog: AtenProgram, slow: float) -> None:
        self.prog, self.slow = prog, slow
        self._run = prog.run_kernels
        prog.run_kernels = self.run

    def run(self, kernel_ids: Iterable[int]) -> None:
        t0 = time.perf_counter()
        self._run(kernel_ids)
        spent = time.perf_counter() - t0
        time.sleep(spent * (self.slow - 1))


def staging_of(plan: Plan, device: int) -> tuple[int, int]:
    """(slots, slot_bytes) of the staging ring ``plan`` gives ``device``."""
    off = plan.meta.get("offload") or {}
    return (int(off.get("slots", 0)), int(off.get("slot_bytes", 0))) if streamed_buffers(plan, device) else (0, 0)


def program_for(cls: type[AtenProgram], graph: KernelGraph, plan: Plan, device: int, runner: Any,
                memory_limit: int | None, shared: dict[int, torch.Tensor], slow: float = 1.0,
                ring: Staging | None = None, homes: dict[int, torch.Tensor] | None = None) -> AtenProgram:
    """The program of device ``device`` of ``plan``: a :class:`StreamingProgram`
    when it streams weights (aten graphs only; ``ring`` and ``homes`` shared
    as :class:`StreamingProgram` says), else ``cls``; throttled when
    ``slow > 1``."""
    streamed = streamed_buffers(plan, device)
    if streamed:
        if cls is not AtenProgram:
            raise BackendError("weight streaming runs aten-captured graphs only")
        off = plan.meta["offload"]
        prog = StreamingProgram(graph, runner.device, plan.resident[device], streamed, int(off["slots"]),
                                int(off["slot_bytes"]), runner.backend, memory_limit, shared,
                                ring, homes, str(off.get("ring", "slots")))
    else:
        prog = cls(graph, runner.device, plan.resident[device], memory_limit=memory_limit, shared=shared)
    if slow > 1.0:
        Throttle(prog, slow)
    return prog


__all__ = ["Staging", "StreamingProgram", "Throttle", "program_for", "staging_of", "streamed_buffers"]
