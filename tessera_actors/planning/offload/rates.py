"""The rates the offload step model (:mod:`.model`) scores placements with:
kernel times on the GPU and on its CPU, and the hand-off between them.

:func:`estimate_rates` is a roofline per device (the H200 preset for a cuda
device, :func:`host_model` for a cpu one) with three measured corrections
for the unbudgeted CPU:

* ``cpu_bps``: its DRAM rate (a bf16 GEMV beside a pinned copy stream);
* ``cpu_rows_bps``: ``{rows: bytes/s}``, the rate at which its matmuls
  stream their weight when they multiply ``rows`` rows (a decode batch, a
  prompt chunk), measured beside the copy stream too.  A CPU matmul of
  ``M`` rows is not a GEMV whose time the roofline can scale: on one H200
  host eight rows cost 1.2x one row's time (another kernel), 512 rows about
  the same time as one (AMX); the roofline of ``cpu_bps`` and 0.75 TFLOP/s
  said 1x and 20x.  A matmul reading a weight takes its weight's bytes over
  the rate at its rows, interpolated in log2(rows) between the measured
  ones (the nearest one's outside them), or its flops at ``cpu_flops`` when
  that takes longer (rows past the measured ones);
* ``cpu_flops``: its GEMM rate in flop/s (the most the measured rows gave),
  for the flops of the other kernels.

A gather (embedding) reads what it writes, not its whole table; links cost
at least ``switch_s``.  Pure Python; no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from tessera_actors.devices import DeviceSpec
from tessera_actors.graph import KernelGraph
from tessera_actors.plan import PlanError
from tessera_actors.planning.costs import CostTable, DeviceModel, device_model
from tessera_actors.planning.offload.load import apply_load, check_load

# DESIGN.md (one H200 + 16 cores): bf16 GEMV from DRAM with a copy stream running
# beside it (12 threads 46 GB/s, 16 collapse to 14.5 GB/s); pinned H2D 55 GB/s.
CPU_GEMV_BPS = {1: 6e9, 2: 11e9, 4: 22e9, 8: 47e9, 12: 46e9, 16: 14.5e9}
PCIE_BPS = 55e9
SWITCH_S = 200e-6   # one activation hand-off between two device actors (messages, not the wire)
GATHERS = ("embedding", "index", "index_select", "gather")
ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2, "int16": 2,
            "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def host_model(threads: int | None) -> DeviceModel:
    """CPU rates at ``threads`` (None: 16) while a copy stream runs beside it."""
    t = min(threads or 16, 16)
    known = sorted(CPU_GEMV_BPS)
    lo = max(k for k in known if k <= t)
    hi = min(k for k in known if k >= t)
    bw = CPU_GEMV_BPS[lo] if lo == hi else (
        CPU_GEMV_BPS[lo] + (t - lo) / (hi - lo) * (CPU_GEMV_BPS[hi] - CPU_GEMV_BPS[lo]))
    return DeviceModel(f"cpu-t{t}", 1.0e12 * t / 16, bw, 5e-6)


def rows_rates(value: Mapping | str | None) -> dict[int, float]:
    """``{rows: bytes/s}`` from a mapping or from ``"1:3.6e10,8:3.0e10"`` (a
    ``--planner-option`` value); rows >= 1 and rates > 0, else an error."""
    if not value:
        return {}
    try:
        pairs = value.items() if isinstance(value, Mapping) else (
            p.split(":") for p in str(value).split(",") if p.strip())
        out = {int(r): float(b) for r, b in pairs}
    except (TypeError, ValueError):
        raise PlanError(f"cpu_rows_bps takes rows:bytes_per_s pairs (1:3.6e10,8:3e10), got {value!r}") from None
    if any(r < 1 or b <= 0 for r, b in out.items()):
        raise PlanError(f"cpu_rows_bps needs rows >= 1 and rates > 0, got {value!r}")
    return dict(sorted(out.items()))


def seconds_per_byte(rates: Mapping[int, float], rows: float) -> float:
    """A CPU matmul's seconds per weight byte at ``rows`` rows from the
    measured ``{rows: bytes/s}``: interpolated in log2(rows) between two
    measured row counts, the nearest one's outside them."""
    pts = sorted(rates.items())
    if rows <= pts[0][0]:
        return 1.0 / pts[0][1]
    if rows >= pts[-1][0]:
        return 1.0 / pts[-1][1]
    for (r0, b0), (r1, b1) in zip(pts, pts[1:]):
        if r0 <= rows <= r1:
            f = (math.log2(rows) - math.log2(r0)) / (math.log2(r1) - math.log2(r0))
            return (1 - f) / b0 + f / b1
    raise AssertionError("unreachable")


def matmul_rows(graph: KernelGraph, k: int) -> tuple[float, int] | None:
    """(rows, weight bytes) of a kernel that multiplies rows by a weight
    (``flops`` = 2 x rows x the weight's elements), None for any other."""
    kern = graph.kernels[k]
    if kern.name in GATHERS:
        return None
    ws = [a for a in kern.accesses if graph.buffers[a.buffer].role == "weight" and a.reads]
    size = {a.buffer: ITEMSIZE.get(graph.buffers[a.buffer].dtype) for a in ws}
    if not ws or None in size.values():
        return None
    nbytes = sum(a.nbytes for a in ws)
    elements = sum(a.nbytes / size[a.buffer] for a in ws)
    rows = kern.flops / (2.0 * elements) if elements else 0.0
    return (rows, nbytes) if rows >= 1.0 - 1e-9 else None


def estimate_rates(graph: KernelGraph, devices: Sequence[str], switch_s: float = SWITCH_S,
                   cpu_bps: float | None = None, cpu_rows_bps: Mapping | str | None = None,
                   cpu_flops: float | None = None, expert_load: Mapping | None = None) -> CostTable:
    """Roofline kernel times (module docstring): cuda devices from the H200
    preset, cpu devices from :func:`host_model` at their thread count, the
    unbudgeted cpu device with the measured ``cpu_bps``, ``cpu_rows_bps``
    and ``cpu_flops`` where given; kernels reading a routed expert weight
    of ``expert_load`` scaled by the share of it a step reads
    (:func:`~.load.apply_load`).  Links: ``switch_s`` latency."""
    specs = [DeviceSpec.parse(d) for d in devices]
    models = [host_model(s.threads) if s.kind == "cpu" else device_model(s) for s in specs]
    rows_bps = rows_rates(cpu_rows_bps)
    host = [i for i, s in enumerate(specs) if s.kind == "cpu" and s.mem is None]
    for i in host:
        m = models[i]
        bps = cpu_bps or rows_bps.get(1) or m.bytes_per_s
        if cpu_bps or rows_bps or cpu_flops:
            models[i] = DeviceModel(f"cpu-measured-t{specs[i].threads}", max(cpu_flops or 0.0, m.flops_per_s), bps,
                                    m.launch_s)
    costs = CostTable.estimate(graph, list(devices), models)
    for k in graph.kernels:
        if k.name in GATHERS:
            nb = 2.0 * sum(a.nbytes for a in k.accesses if a.writes)
            costs.times[k.id] = [m.launch_s + nb / m.bytes_per_s for m in models]
        elif rows_bps and (mm := matmul_rows(graph, k.id)) is not None:
            for i in host:   # past the rows measured, the flops at the CPU's rate
                m = models[i]
                streamed = mm[1] * seconds_per_byte(rows_bps, mm[0])
                costs.times[k.id][i] = m.launch_s + max(streamed, k.flops / m.flops_per_s)
    apply_load(costs.times, graph, [m.launch_s for m in models], check_load(expert_load))
    n = len(specs)
    costs.latency = [[0.0 if a == b else max(costs.latency[a][b], switch_s) for b in range(n)] for a in range(n)]
    return costs


@dataclass(frozen=True)
class HostRoofline:
    """The :class:`~tessera_actors.planning.costs.CostModel` of
    :func:`estimate_rates` (CPU rates while a copy stream runs, gathers read
    what they write, links of at least ``switch_s``)."""
    switch_s: float = SWITCH_S
    cpu_bps: float | None = None
    cpu_rows_bps: Mapping | str | None = None
    cpu_flops: float | None = None
    expert_load: Mapping | None = None

    def table(self, graph: KernelGraph, devices: Sequence[str]) -> CostTable:
        return estimate_rates(graph, devices, self.switch_s, self.cpu_bps, self.cpu_rows_bps, self.cpu_flops,
                              self.expert_load)


__all__ = ["CPU_GEMV_BPS", "GATHERS", "HostRoofline", "PCIE_BPS", "SWITCH_S", "estimate_rates", "host_model",
           "matmul_rows", "rows_rates", "seconds_per_byte"]
