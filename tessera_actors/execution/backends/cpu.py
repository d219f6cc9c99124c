"""A CPU device behind the seam (:mod:`tessera_actors.execution.backends`):
work runs when enqueued, on the calling thread; events are complete once
recorded."""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from tessera_actors.devices import DeviceSpec


# torch's intra-op thread count at start-up: a thread begins with the count last set in the process,
# so a device without threads= is given this one (not whatever a cpu?threads=1 device set before it)
INITIAL_THREADS = torch.get_num_threads()
PREFILL_TOKENS = 32   # a step of this many tokens or more (a prompt chunk) runs at a CPU's prefill_threads


def device_threads(spec: DeviceSpec) -> int:
    """The intra-op threads a CPU device's worker starts with."""
    return spec.threads or INITIAL_THREADS


def step_threads(spec: DeviceSpec, tokens: int) -> int | None:
    """The intra-op threads a step of ``tokens`` tokens runs at on ``spec``:
    with ``prefill_threads`` (``cpu?threads=1&prefill_threads=2``) a prompt
    chunk's long matrix products take every core given while a decode
    step's hundreds of short kernels, each an OpenMP fork and barrier, stay
    on ``threads`` (beside the serving loop's thread); None: the worker's
    count as it started (no per-step change)."""
    if spec.kind != "cpu" or spec.prefill_threads is None:
        return None
    return spec.prefill_threads if tokens >= PREFILL_TOKENS else device_threads(spec)


class _CpuStream:
    __slots__ = ("priority",)

    def __init__(self, priority: int) -> None:
        self.priority = priority


class CpuBackend:
    """A CPU device; ``threads`` (from ``cpu?threads=N``) is applied by
    whoever owns the thread that runs the work (the device actor's worker)."""

    def __init__(self, spec: DeviceSpec) -> None:
        if spec.kind != "cpu":
            raise ValueError(f"CpuBackend needs a cpu device, got {spec.name}")
        self.spec = spec
        self.device = torch.device("cpu")

    def stream(self, priority: int = 0) -> _CpuStream:
        return _CpuStream(priority)

    def record(self, stream: _CpuStream, event: None = None) -> None:
        return None

    def wait(self, stream: _CpuStream, event: None) -> None:
        return None

    def host_wait(self, event: None) -> None:
        return None

    def stamp(self, stream: _CpuStream) -> float:
        """The host time now: what was queued on ``stream`` has run."""
        return time.perf_counter()

    def stamp_s(self, stamp: float) -> float:
        return stamp

    def replayable(self, fn: Callable[[], None], stream: _CpuStream, pool=None,
                   warmup: bool = True, current: bool = False) -> Callable[[], None]:
        return fn

    def capture_pool(self) -> None:
        return None   # nothing is captured: a replay is the function itself, its results come and go

    def pool_bytes(self, pool: None) -> int:
        return 0

    def run_on(self, stream: _CpuStream, fn: Callable[[], None]) -> None:
        fn()

    def scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def copy(self, stream: _CpuStream, dst: torch.Tensor, src: torch.Tensor, back: None = None) -> None:
        dst.copy_(src)

    def synchronize(self) -> None:
        return None

    def release(self) -> None:
        """Nothing to lift: a CPU device puts no cap on the process."""
        return None

    def time_kernel(self, fn: Callable[[], None], reps: int) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
