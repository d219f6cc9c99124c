"""How a device actor's worker thread runs its share of a step: on the
device seam (``tessera_actors/execution/backends/``), with one compute stream
(sends and outputs are copied there too) and one capture/replay cache.

A *segment* is a run of kernels the device executes without a transfer in
between (``(plan_id, program step)`` names it; a program that streams
weights splits it further into pieces ending at streamed readers, each its
own unit).  The first time a unit runs it runs eagerly on the compute
stream: the warm-up that lets libraries initialise and Triton compile, on a
real step with valid inputs.  The second time it is captured once through
``backend.replayable`` (a CUDA graph on the compute stream, which keeps a
green context's SM limit) and replayed, and from then on only replayed; a
unit whose capture fails stays eager.  Every unit of the runner, whatever
its plan, is captured into one memory pool (``backend.capture_pool``): the
transient results of each graph's capture stay the pool's, and in one pool
the graphs reuse each other's blocks, so the device holds what its largest
unit needs rather than a segment per graph (``pool_bytes``, which the
offload planner's reserve covers).  Capture records pointers: every
kernel reads and writes the fixed arena of its
:class:`~tessera_actors.execution.program.AtenProgram`, which step inputs,
received bytes and loaded values are copied into, so a replay sees them.
Counts (``captures``, ``replays``, ``eager_runs``, ``capture_failures``)
are kept per device and per plan.

Ordering: the worker thread's current stream *is* the compute stream, so
everything the actor runs there (input writes, received bytes, loads,
segments) is stream-ordered without host waits.  The host waits only where
bytes leave the device - before a send or the step's outputs - on an event,
never per kernel.  On CPU the seam runs everything at once and
``replayable`` returns the function itself, so CI runs this same logic.

Blocking: every method runs on the calling thread (the actor's worker);
nothing here is thread-safe, and nothing else may call it.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Sequence

import torch

from tessera_actors.execution.program import AtenProgram
from tessera_actors.execution.backends import backend_for
from tessera_actors.devices import DeviceSpec
from tessera_actors.graph import KernelGraph

log = logging.getLogger("tessera_actors.device")

GRAPHS_ENV = "TESSERA_CUDA_GRAPHS"
PLAN_COUNTS = ("captures", "replays", "eager_runs", "capture_failures")


def graphs_from_env() -> bool:
    """``TESSERA_CUDA_GRAPHS``: ``0``/``off``/``false``/``no`` run every segment
    eagerly (debugging); unset or ``1``/``on``/``true``/``yes`` capture."""
    text = os.environ.get(GRAPHS_ENV, "1").strip().lower()
    if text in ("1", "on", "true", "yes", ""):
        return True
    if text in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{GRAPHS_ENV}={text!r}: expected 1/on/true/yes or 0/off/false/no")


def program_class(graph: KernelGraph) -> type[AtenProgram]:
    """``TritonProgram`` for graphs captured by inductor (any ``ptx``
    kernel), else ``AtenProgram``."""
    if any(k.kind == "ptx" for k in graph.kernels):
        from tessera_actors.execution.triton import TritonProgram
        return TritonProgram
    return AtenProgram


class SegmentRunner:
    def __init__(self, spec: DeviceSpec, graphs: bool = True) -> None:
        """Open the device (``backend_for``: green context, ``mem=`` cap) and
        its streams, and make the compute stream current on this thread."""
        self.backend = be = backend_for(spec)
        self.device = be.device
        self.graphs = graphs
        self.compute = be.stream(priority=0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.compute)
        self._units: dict[tuple[str, int], Callable[[], None] | None] = {}   # None: warmed up, eager
        self._eager_only: set[tuple[str, int]] = set()                      # capture failed
        # ints only: the actor copies them from the event loop while the worker counts
        self.counts = {"captures": 0, "replays": 0, "eager_runs": 0, "capture_failures": 0, "units": 0}
        self.last_capture_error = ""
        self.per_plan: dict[str, dict[str, int]] = {}   # plan -> PLAN_COUNTS
        self.pool = be.capture_pool() if graphs else None   # every capture's transient results, all plans'
        self.pool_bytes = 0   # device bytes of that pool, as of the last capture or forget

    def run(self, key: tuple, prog: AtenProgram, kernels: Sequence[int], probe: Any = None) -> None:
        """Queue segment ``key`` (``kernels`` of ``prog``; ``key[0]`` is the
        plan) on the compute stream: eagerly the first time, captured and
        replayed from the second on.  A program that streams weights splits
        the segment into pieces ending at streamed readers
        (``prog.pieces``), each its own unit of this one cache, so its
        copies and events stay between graphs.  ``probe``
        (:class:`~.probe.Probe`): each unit recorded between two stamps of
        the compute stream, with the streamed copies it waited for."""
        pieces = getattr(prog, "pieces", None)
        if pieces is None:
            s0 = probe.mark(self.compute) if probe is not None else None
            self._unit(key, prog, kernels)
            if probe is not None:
                probe.add("kernels", f"k{kernels[0]}-k{kernels[-1]}", s0, probe.mark(self.compute))
            return
        parts = pieces(kernels)
        for piece in parts:
            try:
                s0 = probe.mark(self.compute) if probe is not None else None
                self._unit((key[0], "piece", piece[0], len(piece)), prog, piece)
                if probe is not None:
                    probe.add("kernels", f"k{piece[0]}-k{piece[-1]}", s0, probe.mark(self.compute),
                              waits=list(prog.index.get(piece[-1], ())))
            except BaseException as e:
                parts.throw(e)

    def _unit(self, key: tuple, prog: AtenProgram, kernels: Sequence[int]) -> None:
        replay = self._units.get(key)
        if replay is not None:
            replay()
            self._count(key, "replays")
            return
        warmed = key in self._units

        def segment() -> None:
            prog.run_kernels(kernels)

        def eager() -> None:
            if warmed and self.backend.spec.sms is None:
                # warmed up on a whole GPU: nothing left to load lazily, and the worker's current
                # stream is the compute stream (no scope, no stream context: on an H200 one is 13 us)
                segment()
                return
            # a partition's Triton kernels load into its green context at their first launch
            with self.backend.scope(), self._on(self.compute):
                segment()
        if not self.graphs or not warmed or key in self._eager_only or not prog.capturable:
            eager()
            self._units.setdefault(key, None)
            self._count(key, "eager_runs")
            return
        try:
            replay = self.backend.replayable(segment, self.compute, pool=self.pool, warmup=False, current=True)
        except Exception as e:   # e.g. a kernel that syncs with the host: this segment stays eager
            self.pool_bytes = self.backend.pool_bytes(self.pool)
            self._eager_only.add(key)
            self._count(key, "capture_failures")
            self.last_capture_error = f"{key}: {type(e).__name__}: {e}"
            log.warning("%s: segment %s cannot be captured, it runs eagerly: %s", self.backend.spec.name, key, e)
            eager()
            self._count(key, "eager_runs")
            return
        self._units[key] = replay
        self.pool_bytes = self.backend.pool_bytes(self.pool)
        self._count(key, "captures")
        self.counts["units"] += 1
        replay()
        self._count(key, "replays")

    def _count(self, key: tuple, what: str) -> None:
        self.counts[what] += 1
        self.per_plan.setdefault(key[0], dict.fromkeys(PLAN_COUNTS, 0))[what] += 1

    def read(self, readers: Sequence[Callable[[], Any]]) -> list[Any]:
        """The snapshots ``readers`` take (:meth:`AtenProgram.reader
        <tessera_actors.execution.program.AtenProgram.reader>`: a transfer's bytes, into
        pinned host memory when they cross PCIe to a co-located peer, or a
        step's outputs) once everything queued so far has produced them;
        returns after those bytes are settled.  The copies queue on the
        compute stream behind the kernels and the host waits on one event
        after them: the wait that every send needs anyway, with no second
        stream to order (on an H200 a pinned hand-off's receiver then copies
        with a queued DMA or a plain memcpy, not a synchronous pageable
        transfer: that was 70 to 110 us per hand-off)."""
        out = [r() for r in readers]
        be = self.backend
        be.host_wait(be.record(self.compute))
        return out

    def _on(self, stream):
        return torch.cuda.stream(stream) if self.device.type == "cuda" else contextlib.nullcontext()

    def forget(self, plan_id: str, *keep_alive: Any) -> None:
        """Drop the replayable units of ``plan_id`` once the device finished
        what is queued (``keep_alive``: e.g. the plan's program, so its
        arena outlives the work that uses it; one that queues work on other
        streams - a streaming program's copies queued ahead of a next step
        that will not come - is settled too, ``settle()``)."""
        self.synchronize()
        for p in keep_alive:
            settle = getattr(p, "settle", None)
            if settle is not None:
                settle()
        for key in [k for k in self._units if k[0] == plan_id]:
            self.counts["units"] -= self._units.pop(key) is not None
        self._eager_only = {k for k in self._eager_only if k[0] != plan_id}
        self.per_plan.pop(plan_id, None)
        self.pool_bytes = self.backend.pool_bytes(self.pool)   # the graphs gone: the pool may have shrunk

    def recapture(self) -> None:
        """Forget every captured CUDA graph (their units stay warmed up: the
        next run of each captures it again), once the device finished what
        is queued: memory they recorded the address of is about to move
        (the device's scratch grows, ``execution/sharing.py``).  On a CPU a
        replayable unit is the function itself and records no address."""
        if self.device.type != "cuda":
            return
        self.synchronize()
        for key, unit in self._units.items():
            if unit is not None:
                self._units[key] = None
                self.counts["units"] -= 1

    def synchronize(self) -> None:
        be = self.backend
        be.host_wait(be.record(self.compute))

    def stats(self) -> dict[str, Any]:
        return {"graphs": self.graphs, **self.counts, "last_capture_error": self.last_capture_error,
                "capture_pool_bytes": self.pool_bytes}

