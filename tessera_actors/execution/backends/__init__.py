"""The narrow device seam: streams, events, replayable segments, copies.

One implementation a device kind, chosen by the device spec (``backend_for``):
``CpuBackend`` in ``cpu.py`` and ``CudaBackend`` in ``cuda.py``.  The executor
that drives them (``tessera_actors/execution/``) is written once against this
seam, so CI on CPU runs the same ordering, event and transfer logic the GPU
runs.

CPU semantics: work runs when enqueued, on the calling thread, so streams are
trivially ordered and every event is complete once recorded; the executor
must therefore enqueue in an order that respects dependencies (it does:
global segment order).  CUDA semantics: work is queued on streams; events
order streams; nothing blocks the host until ``synchronize``.

Stamps (the step probe's clock): ``stamp(stream)`` marks the point of
``stream`` reached so far; ``stamp_s(stamp)`` is the host ``perf_counter``
time that point ran at, None while it has not (CPU: the time of the call).
"""
from __future__ import annotations

import contextlib
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
    def stamp(self, stream: Stream) -> object: ...
    def stamp_s(self, stamp: object) -> float | None: ...
    def replayable(self, fn: Callable[[], None], stream: Stream, pool=None,
                   warmup: bool = True, current: bool = False) -> Callable[[], None]: ...
    def capture_pool(self) -> object | None: ...
    def pool_bytes(self, pool: object | None) -> int: ...
    def run_on(self, stream: Stream, fn: Callable[[], None]) -> None: ...
    def scope(self) -> contextlib.AbstractContextManager: ...
    def copy(self, stream: Stream, dst: torch.Tensor, src: torch.Tensor, back: Stream | None = None) -> None: ...
    def synchronize(self) -> None: ...
    def release(self) -> None: ...   # the device stops: undo what opening it set on the process
    def time_kernel(self, fn: Callable[[], None], reps: int) -> float: ...


def backend_for(spec: DeviceSpec | str) -> DeviceBackend:
    spec = DeviceSpec.parse(spec) if isinstance(spec, str) else spec
    if spec.kind == "cpu":
        from tessera_actors.execution.backends.cpu import CpuBackend
        return CpuBackend(spec)
    from tessera_actors.execution.backends.cuda import CudaBackend
    return CudaBackend(spec)
