"""A CUDA device, or an SM-limited partition of one (``cuda:1?sms=32``).

Streams: a partition's streams come from its green context, and segments
are captured as CUDA graphs *on those streams* - a graph keeps the SM limit
of the context it was captured in (see DESIGN.md), so a partition's work
really runs on its SMs.  Memory: the device's buffers are held to ``mem=``
by the arena (a plan that does not fit is refused by name), and the caching
allocator of the process on that GPU is capped
(``set_per_process_memory_fraction``) at the budget plus what the process
already held when the device started plus ``ALLOCATOR_SLACK`` (the
allocator's 2 MiB segments, cuBLAS workspaces), so runaway allocations fail
there, as they would on a smaller GPU, while a budget of a few MiB (a tiny
model split for a test) still fits its own segments.

Nothing here blocks the host except ``synchronize`` and ``time_kernel``.

Stamps (the step probe's clock): a timing event on the stream, measured
from an *anchor*: an event recorded on a stream of its own that runs
nothing else, so it completes as it is queued (a few us after the host
time taken beside it); a new anchor every ``ANCHOR_S`` seconds keeps the
two clocks' drift out of the numbers.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from typing import Callable, Iterator

import torch

from tessera_actors.devices import DeviceSpec

log = logging.getLogger("tessera_actors.cuda")
_CAPTURE_LOCK = threading.Lock()
ANCHOR_S = 0.05

_GREEN: contextvars.ContextVar = contextvars.ContextVar("tessera_green_context", default=None)
_GREEN_CONTEXTS: dict[tuple[int, int], object] = {}
_GREEN_LOCK = threading.Lock()


def green_context(index: int, sms: int):
    """The process's green context of ``sms`` SMs on GPU ``index``: made once
    and kept for the life of the process.  Pinned host blocks record an event
    on every stream that copied through them when they are freed, which may be
    long after the partition's backend is gone (a plan's persistent buffers,
    collected with it); a context destroyed by then makes that record fail
    inside a destructor, and the process aborts ("context is destroyed")."""
    with _GREEN_LOCK:
        ctx = _GREEN_CONTEXTS.get((index, sms))
        if ctx is None:
            from torch.cuda.green_contexts import GreenContext
            ctx = _GREEN_CONTEXTS[(index, sms)] = GreenContext.create(num_sms=sms, device_id=index)
        return ctx


def current_green():
    """The green context whose scope the caller runs in (None: a primary
    context). Kernel modules loaded by the driver API (Triton's) belong to
    one context; a kernel first launched here is loaded into this one."""
    return _GREEN.get()


# the allocator's own bytes a budgeted device needs beyond its arena: cuBLAS workspaces (32 MiB per stream that
# runs a matmul on an H200) and cached, not yet released segments; 64 MiB failed a tiny bf16 split's first
# prompt chunk (770 MiB allocated + 31 MiB cached + a 32 MiB workspace over an 832 MiB cap)
ALLOCATOR_SLACK = 128 << 20


class CudaBackend:
    def __init__(self, spec: DeviceSpec) -> None:
        if spec.kind != "cuda":
            raise ValueError(f"CudaBackend needs a cuda device, got {spec.name}")
        if not torch.cuda.is_available():
            raise RuntimeError(f"{spec.name}: CUDA is not available on this machine")
        if spec.index >= torch.cuda.device_count():
            raise RuntimeError(f"{spec.name}: only {torch.cuda.device_count()} CUDA device(s) here")
        self.spec = spec
        self.device = torch.device("cuda", spec.index)
        props = torch.cuda.get_device_properties(self.device)
        self.sm_count = props.multi_processor_count
        self.green = None
        if spec.sms is not None:
            if spec.sms > self.sm_count:
                raise ValueError(f"{spec.name}: asks for {spec.sms} SMs, the GPU has {self.sm_count}")
            self.green = green_context(spec.index, spec.sms)
        if spec.mem is not None:
            if spec.mem > props.total_memory:
                raise ValueError(f"{spec.name}: budget {spec.mem} bytes exceeds the GPU's {props.total_memory}")
            cap = torch.cuda.memory_allocated(self.device) + spec.mem + ALLOCATOR_SLACK
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / props.total_memory), self.device)
        self.capped = spec.mem is not None
        self._streams: list[torch.cuda.Stream] = []
        self._anchor: tuple | None = None   # (host time, its event) that stamps are measured from
        self._anchor_stream: torch.cuda.Stream | None = None

    def release(self) -> None:
        """Lift this device's cap on the process's allocator (the device is
        stopping): the cap is the process's, and would otherwise hold every
        later engine of the process on this GPU to the stopped one's budget."""
        if self.capped:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self.capped = False

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Make this partition's green context current (no-op on a whole GPU).
        Eager first runs go through it, so kernels loaded lazily by the driver
        API (Triton modules) land in the context whose streams launch them;
        captured graphs and replays need no scope."""
        if self.green is None:
            yield
            return
        with torch.cuda.device(self.device):
            token = _GREEN.set(self.green)
            self.green.set_context()
            try:
                yield
            finally:
                self.green.pop_context()
                _GREEN.reset(token)

    # -- streams and events ---------------------------------------------
    def stream(self, priority: int = 0) -> torch.cuda.Stream:
        """A new stream; on a partition it belongs to the green context
        (priorities are then not available)."""
        if self.green is not None:
            s = self.green.Stream()
        else:
            lo, hi = torch.cuda.Stream.priority_range()  # (lowest, highest): e.g. (0, -5)
            p = max(hi, min(lo, priority))
            s = torch.cuda.Stream(self.device, priority=p)
        self._streams.append(s)
        return s

    def record(self, stream: torch.cuda.Stream, event: torch.cuda.Event | None = None) -> torch.cuda.Event:
        """An event behind the work queued on ``stream``: ``event`` recorded
        again (a wait queued earlier keeps the record it saw) or a new one."""
        ev = event if event is not None else torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def host_wait(self, event: torch.cuda.Event) -> None:
        """Block the calling thread until ``event`` completed (and nothing else)."""
        event.synchronize()

    def stamp(self, stream: torch.cuda.Stream) -> tuple:
        """A timing event behind what is queued on ``stream``, with its anchor."""
        now = time.perf_counter()
        if self._anchor is None or now - self._anchor[0] > ANCHOR_S:
            if self._anchor_stream is None:
                self._anchor_stream = self.stream()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self._anchor_stream)
            self._anchor = (time.perf_counter(), ev)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return self._anchor, ev

    def stamp_s(self, stamp: tuple) -> float | None:
        (t, anchor), ev = stamp
        if not (ev.query() and anchor.query()):
            return None
        return t + anchor.elapsed_time(ev) / 1e3

    # -- work -------------------------------------------------------------
    def replayable(self, fn: Callable[[], None], stream: torch.cuda.Stream, pool=None,
                   warmup: bool = True, current: bool = False) -> Callable[[], None]:
        """Capture ``fn`` as a CUDA graph on ``stream`` and return a replay
        bound to that stream.  ``warmup`` runs ``fn`` once first (lazy library
        initialisation); callers whose buffers do not hold valid inputs yet
        warm up themselves and pass False.  Capture runs nothing: the caller
        replays to execute.  ``current``: every replay is called with
        ``stream`` current (a device actor's worker, whose current stream is
        its compute stream), so it launches there without a stream context
        (on an H200: 2.4 us a launch, against 12 us with one).

        Several device actors of one process may capture and launch from
        their own threads: capture is ``thread_local`` (another thread's
        allocations do not invalidate it) and one capture at a time per
        process (``torch.cuda.graph`` synchronises the device on entry)."""
        if warmup:
            with torch.cuda.device(self.device), self.scope(), torch.cuda.stream(stream):
                fn()
        with _CAPTURE_LOCK:
            stream.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.device(self.device):
                with torch.cuda.graph(g, pool=self._pool_id(pool), stream=stream, capture_error_mode="thread_local"):
                    fn()

        if current:
            replay = g.replay
        else:
            def replay() -> None:
                with torch.cuda.stream(stream):
                    g.replay()
            replay.graph = g  # keep the graph alive with the callable
        return replay

    def capture_pool(self):
        """A memory pool for graphs captured on this device, to pass to
        every :meth:`replayable` of one stream; it lives as long as the
        object returned (a ``torch.cuda.MemPool``: a pool whose graphs were
        all dropped is still there for the next capture, as a re-placed
        deployment's).  A graph keeps the blocks its capture allocated for
        as long as it lives: each graph in a pool of its own holds at least
        one 2 MiB segment however small its transient results (an offload
        plan's hundreds of streamed pieces held 98 to 124 MiB that way on an
        H200 and ran out of the budget).  Graphs of one pool reuse the
        blocks each freed during its capture; that is safe where every
        graph frees its allocations within itself (kernels write into
        arenas; a result is a transient) and the graphs replay one at a time
        on one stream: the pool then holds what the largest one needs."""
        make = getattr(torch.cuda, "MemPool", None)
        if make is None:   # a torch without MemPool
            return torch.cuda.graph_pool_handle()
        with torch.cuda.device(self.device):
            return make()

    @staticmethod
    def _pool_id(pool):
        return getattr(pool, "id", pool)

    def pool_bytes(self, pool) -> int:
        """Device bytes the caching allocator holds for ``pool`` (its
        segments, used or free); 0 for None."""
        if pool is None:
            return 0
        pid = tuple(self._pool_id(pool))
        try:
            segments = torch.cuda.memory_snapshot(pid, include_traces=False)
        except TypeError:   # a torch whose snapshot takes no pool: every segment, those of the pool picked
            segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pid]
        return sum(int(s["total_size"]) for s in segments if s.get("device", self.device.index) == self.device.index)

    def run_on(self, stream: torch.cuda.Stream, fn: Callable[[], None]) -> None:
        """Run ``fn`` on ``stream`` after the work the caller already queued on
        its current stream (e.g. the host-to-device copy of an input)."""
        with torch.cuda.device(self.device):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                fn()

    def copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor,
             back: torch.cuda.Stream | None = None) -> None:
        """Queue ``dst.copy_(src)`` on ``stream``; ``back``: the caller's
        current stream, made current again after (two stream switches, not a
        stream context's four calls)."""
        if back is None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            return
        torch.cuda.set_stream(stream)
        try:
            dst.copy_(src, non_blocking=True)
        finally:
            torch.cuda.set_stream(back)

    def synchronize(self) -> None:
        # a green context's streams live in their own context: wait on each
        for s in self._streams:
            s.synchronize()
        torch.cuda.synchronize(self.device)

    def time_kernel(self, fn: Callable[[], None], reps: int = 20) -> float:
        """Seconds per call of ``fn``, measured as a CUDA graph of ``reps``
        calls replayed on this device's compute context (launch overhead
        excluded, as in a segment replay)."""
        s = self._timing_stream = getattr(self, "_timing_stream", None) or self.stream()
        s.wait_stream(torch.cuda.current_stream(self.device))   # inputs prepared by the caller

        def many() -> None:
            for _ in range(reps):
                fn()
        replay = self.replayable(many, s)
        replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(s)
        replay()
        replay()
        end.record(s)
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / (2 * reps)
