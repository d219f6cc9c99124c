"""The narrow device seam: streams, events, replayable segments, copies.

Two implementations, chosen by the device spec's kind (``backend_for``):
``CpuBackend`` here and ``CudaBackend`` in ``cuda.py``.  The executor that
drives them (``tessera_actors/pipeline.py``) is written once against this
seam, so CI on CPU runs the same ordering, event and transfer logic the GPU
runs.

CPU semantics: work runs when enqueued, on the calling thread, so streams are
trivially ordered and every event is complete once recorded; the executor
must therefore enqueue in an order that respects dependencies (it does:
global segment order).  CUDA semantics: work is queued on streams; events
order streams; nothing blocks the host until ``synchronize``.
"""
from __future__ import annotations

import contextlib

import time
from typing import Callable, Protocol

import torch

from tessera_actors.devices import DeviceSpec


class Stream(Protocol):
    ...


class Event(Protocol):
    ...


class DeviceBackend(Protocol):
    spec: DeviceSpec
    device: torch.device

    def stream(self, priority: int = 0) -> Stream: ...
    def record(self, stream: Stream, event: Event | None = None) -> Event: ...
    def wait(self, stream: Stream, event: Event) -> None: ...
    def host_wait(self, event: Event) -> None: ...
    def replayable(self, fn: Callable[[], None], stream: Stream, pool=None,
                   warmup: bool = True, current: bool = False) -> Callable[[], None]: ...
    def run_on(self, stream: Stream, fn: Callable[[], None]) -> None: ...
    def scope(self) -> contextlib.AbstractContextManager: ...
    def copy(self, stream: Stream, dst: torch.Tensor, src: torch.Tensor, back: Stream | None = None) -> None: ...
    def synchronize(self) -> None: ...
    def time_kernel(self, fn: Callable[[], None], reps: int) -> float: ...


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

    def replayable(self, fn: Callable[[], None], stream: _CpuStream, pool=None,
                   warmup: bool = True, current: bool = False) -> Callable[[], None]:
        return fn

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


def backend_for(spec: DeviceSpec | str) -> DeviceBackend:
    spec = DeviceSpec.parse(spec) if isinstance(spec, str) else spec
    if spec.kind == "cpu":
        return CpuBackend(spec)
    from .cuda import CudaBackend
    return CudaBackend(spec)
