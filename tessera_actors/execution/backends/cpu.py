"""A CPU device behind the seam (:mod:`tessera_actors.execution.backends`):
work runs when enqueued, on the calling thread; events are complete once
recorded."""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from tessera_actors.devices import DeviceSpec


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

    def time_kernel(self, fn: Callable[[], None], reps: int) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
