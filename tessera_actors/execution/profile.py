"""Per-kernel profiling on a device: the cost table's measured input.

Kernels are timed in program order during one run of the graph, each when
its inputs hold the values a real step gives them (buffers are reused, so
timing a kernel later could feed it another kernel's bytes - e.g. indices
out of range).  On CUDA each kernel is timed as a CUDA graph of ``reps``
launches on the device's own (possibly SM-limited) stream; on CPU by wall
clock.  Progress is shown for long graphs.
"""
from __future__ import annotations

import sys
import time
from typing import Sequence

import torch

from tessera_actors.execution.program import AtenProgram
from tessera_actors.execution.backends import DeviceBackend
from tessera_actors.graph import KernelGraph
from tessera_actors.execution.inputs import write_inputs


def profile_kernels(graph: KernelGraph, values: dict[int, torch.Tensor], inputs: dict[str, torch.Tensor],
                    backend: DeviceBackend, reps: int = 10, progress: bool | None = None,
                    program_cls=AtenProgram) -> list[float]:
    """Seconds per launch of every kernel of ``graph`` on ``backend``."""
    prog = program_cls(graph, backend.device, graph.buffers)
    prog.load(values)
    write_inputs(prog, graph, inputs)
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from tqdm import tqdm
        bar = tqdm(total=len(graph.kernels), desc=f"profile {backend.spec.name}", unit="kernel", leave=False)
    times: list[float] = []
    stream = backend.stream()   # the device's own context (a partition's green context)
    for k in graph.kernels:
        fn = prog.bind(k.id)
        # timing runs the kernel many times; an in-place kernel (a cache
        # update, an accumulation) would drift its outputs - and later
        # kernels' indices - so its written bytes are restored and it runs
        # once more for the values the rest of the program reads
        saved = [(a.buffer, a.start, a.end, prog.arena[a.buffer][a.start:a.end].clone())
                 for a in k.accesses if a.writes and a.end > a.start]
        times.append(backend.time_kernel(fn, reps))
        for b, s, e, v in saved:
            prog.arena[b][s:e].copy_(v)
        with backend.scope():
            backend.run_on(stream, fn)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    backend.synchronize()
    return times


def profile_link(src: DeviceBackend, dst: DeviceBackend, sizes: tuple[int, int] = (1 << 12, 1 << 24),
                 reps: int = 5) -> tuple[float, float]:
    """(latency seconds, bytes per second) of copying from ``src`` to
    ``dst`` in this process: a line through the mean times of a small and a
    large copy, each timed by wall clock up to completion (launch and wait
    included, as the runtime pays them)."""
    small, large = sizes
    if not 0 < small < large:
        raise ValueError(f"sizes must be 0 < small < large, got {sizes}")
    times = []
    for n in sizes:
        a = torch.ones(n, dtype=torch.uint8, device=src.device)
        b = torch.empty(n, dtype=torch.uint8, device=dst.device)
        b.copy_(a)                      # warm-up (peer access, allocator)
        src.synchronize()
        dst.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            b.copy_(a)
        src.synchronize()
        dst.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    slope = (times[1] - times[0]) / (large - small)
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    latency = max(times[0] - small * slope, 0.0)
    return latency, bandwidth


def measured_links(backends: Sequence[DeviceBackend]) -> dict[tuple[int, int], tuple[float, float]]:
    """``profile_link`` for every ordered pair of devices."""
    return {(a, b): profile_link(backends[a], backends[b])
            for a in range(len(backends)) for b in range(len(backends)) if a != b}
