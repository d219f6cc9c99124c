"""Rates for offload planning, measured on the machine: the CPU's matmul
rates (a GEMV's DRAM rate, and by rows: each decode batch, each prompt
chunk) beside a pinned host-to-device copy stream and that copy's rate
(GPU machines), and the cost of one activation hand-off between two device
actors (through ``AsyncEngine``).  Called by ``tessera bench offload``
before any memory budget caps the GPU's allocator."""
from __future__ import annotations

import threading
import time

import torch

from tessera_actors.bench.offload_engine import time_decode
from tessera_actors.devices import DeviceSpec
from tessera_actors.serving import AsyncEngine
from tessera_actors.serving.config import EngineConfig


def measure_rates(threads: int | None, gpu_index: int, seconds: float = 0.6, windows: int = 3,
                  shapes: list[tuple[int, int]] | None = None, dtype: torch.dtype = torch.bfloat16,
                  rows: tuple[int, ...] = (1,)) -> dict:
    """CPU matmul rates at ``threads`` while a pinned host-to-device copy
    stream runs beside it, and that copy's rate (DESIGN.md's method:
    matrices cycled so none stays in cache), each the best of ``windows``
    windows of ``seconds`` per row count (a shared machine's neighbours once
    halved one window).  The matmul is the op the captured graphs run for a
    linear layer - ``mm(x, W.t())`` with ``W`` [out, in] contiguous - whose
    rate differs from ``x @ M`` (on a 2-core box: 13.7 against 10.9 GB/s),
    on ``shapes`` (the model's own weight shapes, e.g. one layer's; default
    4096 x 4096), repeated to about 1.3 GB, with ``x`` of each of ``rows``
    rows (a decode batch, a prompt chunk: on one H200 host 8 rows took
    1.2x one row's time, another kernel than the GEMV).  Returns
    ``cpu_gemv_bps`` (one row), ``cpu_rows_bps`` ({rows: weight bytes/s}),
    ``cpu_flops`` (the most flop/s any row count reached) and ``pcie_bps``."""
    shapes = list(shapes or [(4096, 4096)])
    per = sum(o * i for o, i in shapes) * torch.finfo(dtype).bits // 8
    reps = max(1, -(-(1300 << 20) // max(per, 1)))
    mats = [torch.full(shape, 0.01, dtype=dtype) for _ in range(reps) for shape in shapes]
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(256 << 20, dtype=torch.uint8, device=f"cuda:{gpu_index}")
    by_rows, pcie = {}, 0.0
    for m in sorted(set(rows) | {1}):
        xs = {i: torch.full((m, i), 0.5, dtype=dtype) for _, i in shapes}
        for _ in range(windows):
            got = _window(mats, xs, host, dev, gpu_index, threads, seconds)
            by_rows[m] = max(by_rows.get(m, 0.0), got["cpu_bps"])
            pcie = max(pcie, got["pcie_bps"])
    elt = torch.finfo(dtype).bits // 8
    flops = max(2.0 * m * b / elt for m, b in by_rows.items())   # 2 flops per weight element and row
    return {"cpu_gemv_bps": by_rows[1], "cpu_rows_bps": by_rows, "cpu_flops": flops, "pcie_bps": pcie,
            "windows": windows}


def _window(mats: list, xs: dict, host, dev, gpu_index: int, threads: int | None, seconds: float) -> dict:
    """One window: the matmuls over ``mats`` (weight bytes/s) beside the
    pinned copy loop (bytes/s), both until the window ends (checked after
    every matrix, so a slow many-row matmul does not run on alone)."""
    stop = time.perf_counter() + seconds
    res = {}

    def gemm() -> None:
        if threads:
            torch.set_num_threads(threads)
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() < stop:
            for m in mats:
                torch.mm(xs[m.shape[1]], m.t())
                done += m.numel() * m.element_size()
                if time.perf_counter() >= stop:
                    break
        res["cpu_bps"] = done / (time.perf_counter() - t0)

    def copy() -> None:
        s = torch.cuda.Stream(gpu_index)
        n, t0 = 0, time.perf_counter()
        with torch.cuda.stream(s):
            while time.perf_counter() < stop:
                dev.copy_(host, non_blocking=True)
                s.synchronize()
                n += 1
        res["pcie_bps"] = n * host.numel() / (time.perf_counter() - t0)
    ts = [threading.Thread(target=gemm), threading.Thread(target=copy)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return res


async def measure_switch(model: str, dtype: str, gpu: DeviceSpec, cpu: DeviceSpec, steps: int = 20) -> float:
    """Seconds one activation hand-off between the two device actors costs,
    through ``AsyncEngine``: the tiny model's batch-1 decode step on each
    device alone and split by the ``af`` planner (attention on one device,
    the rest on the other: two device changes a layer); the extra time of
    the split over the kernel-weighted mean of the two, per device change."""
    plain = DeviceSpec(gpu.kind, gpu.index, gpu.sms, gpu.threads).name
    fields = dict(model=model, size="tiny", dtype=dtype, max_seqs=1, max_model_len=64, decode_buckets=(1,),
                  prefill_buckets=(8,), kv_windows=(), mode="latency", embeddings=False,
                  capture="aten")   # one capture for the three engines: only the hand-offs differ
    times, split = [], None
    for devices, planner in ((plain, "contiguous"), (cpu.name, "contiguous"), (f"{plain},{cpu.name}", "af")):
        async with AsyncEngine(config=EngineConfig(devices=devices, planner=planner, **fields)) as eng:
            await eng.wait_placed()
            times.append((await time_decode(eng, 1, steps))["step_s"])
            split = eng.deployment.placed["decode:1@0"].plan
    assign = list(split.assignment)
    switches = sum(assign[k] != assign[k - 1] for k in range(1, len(assign)))
    f = assign.count(1) / len(assign)
    return max(times[2] - ((1 - f) * times[0] + f * times[1]), 0.0) / max(switches, 1)


__all__ = ["measure_rates", "measure_switch"]
