"""Rates for offload planning, measured on the machine: the CPU's GEMV
DRAM rate beside a pinned host-to-device copy stream and that copy's rate
(GPU machines), and the cost of one activation hand-off between two device
actors.  Called by ``tessera bench offload`` before any memory budget caps
the GPU's allocator."""
from __future__ import annotations

import threading
import time

import torch

from tessera_actors import models
from tessera_actors.capture import capture_module
from tessera_actors.devices import DeviceSpec
from tessera_actors.bench.offload_run import deploy
from tessera_actors.plan import single_device_plan
from transport.system import ActorSystem


def measure_rates(threads: int | None, gpu_index: int, seconds: float = 0.6, windows: int = 3,
                  shapes: list[tuple[int, int]] | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """CPU GEMV DRAM rate at ``threads`` while a pinned host-to-device copy
    stream runs beside it, and that copy's rate (DESIGN.md's method:
    matrices cycled so none stays in cache), each the best of ``windows``
    windows of ``seconds`` (a shared machine's neighbours once halved one
    window).  The GEMV is the op the captured graphs run for a linear
    layer - ``mm(x, W.t())`` with ``W`` [out, in] contiguous - whose rate
    differs from ``x @ M`` (on a 2-core box: 13.7 against 10.9 GB/s), on
    ``shapes`` (the model's own weight shapes, e.g. one layer's; default
    4096 x 4096), repeated to about 1.3 GB."""
    shapes = list(shapes or [(4096, 4096)])
    per = sum(o * i for o, i in shapes) * torch.finfo(dtype).bits // 8
    reps = max(1, -(-(1300 << 20) // max(per, 1)))
    mats = [torch.full(shape, 0.01, dtype=dtype) for _ in range(reps) for shape in shapes]
    xs = {i: torch.full((1, i), 0.5, dtype=dtype) for _, i in shapes}
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(256 << 20, dtype=torch.uint8, device=f"cuda:{gpu_index}")
    best = {"cpu_gemv_bps": 0.0, "pcie_bps": 0.0}
    for _ in range(windows):
        stop = time.perf_counter() + seconds
        res = {}

        def gemv() -> None:
            if threads:
                torch.set_num_threads(threads)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() < stop:
                for m in mats:
                    torch.mm(xs[m.shape[1]], m.t())
                n += 1
            res["cpu_gemv_bps"] = n * sum(m.numel() * 2 for m in mats) / (time.perf_counter() - t0)

        def copy() -> None:
            s = torch.cuda.Stream(gpu_index)
            n, t0 = 0, time.perf_counter()
            with torch.cuda.stream(s):
                while time.perf_counter() < stop:
                    dev.copy_(host, non_blocking=True)
                    s.synchronize()
                    n += 1
            res["pcie_bps"] = n * host.numel() / (time.perf_counter() - t0)
        ts = [threading.Thread(target=gemv), threading.Thread(target=copy)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for k in best:
            best[k] = max(best[k], res.get(k, 0.0))
    return {**best, "windows": windows}


def alternating_split(model: str, dtype: torch.dtype, devices: list[str], run: int = 6):
    """A tiny model's decode graph (captured on the meta device: device-
    neutral kernels - a CPU capture would record CPU-only fused ops), its
    weight and state values, and a plan over ``devices`` (two) that changes
    device after every ``run`` kernels where a cut is legal; returns
    ``(graph, values, plan, assignment)``."""
    from tessera_actors.plan import build_plan, legal_cuts
    from tessera_actors.capture.aten import storage_bytes
    m = models.get(model, "tiny", dtype=dtype, seed=0, max_seq=64)
    meta = models.get(model, "tiny", dtype=dtype, seed=0, max_seq=64, device="meta")
    g = capture_module(meta, {k: v.to("meta") for k, v in m.example_inputs("decode", batch=1).items()}).graph
    named = dict(m.named_parameters())
    named.update(dict(m.named_buffers()))
    values = {b.id: storage_bytes(named[b.name]) for b in g.buffers.values()
              if b.role in ("weight", "state") and b.name in named}
    ok = legal_cuts(g)
    assign, d, n = [], 0, 0
    for k in range(len(g.kernels)):
        if n >= run and ok[k]:
            d, n = 1 - d, 0
        assign.append(d)
        n += 1
    return g, values, build_plan(g, list(devices), assign, name="switch"), assign


async def measure_switch(model: str, dtype: torch.dtype, gpu: DeviceSpec, cpu: DeviceSpec, steps: int = 20) -> float:
    """Seconds one activation hand-off between the two device actors costs:
    a tiny model's decode step alone on each device and split into many
    alternating runs (:func:`alternating_split`); the extra time of the
    split over the kernel-weighted mean of the two, per device change."""
    plain = DeviceSpec(gpu.kind, gpu.index, gpu.sms, gpu.threads).name
    g, values, split, assign = alternating_split(model, dtype, [plain, cpu.name])
    switches = sum(assign[k] != assign[k - 1] for k in range(1, len(assign)))
    times = []
    for plan in (single_device_plan(g, plain), single_device_plan(g, cpu.name), split):
        async with ActorSystem("offload-switch") as system:
            dep = await deploy(system, g, plan, values)
            for i in range(3 + steps):
                if i == 3:
                    dep.reset_counters()
                await dep.step({"input_ids": torch.tensor([[1 + i % 7]]), "positions": torch.tensor([i])},
                               outputs=False)
            times.append(dep.wall_s / dep.counted)
            await dep.close()
    f = assign.count(1) / len(assign)
    return max(times[2] - ((1 - f) * times[0] + f * times[1]), 0.0) / max(switches, 1)


__all__ = ["alternating_split", "measure_rates", "measure_switch"]
