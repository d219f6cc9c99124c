"""The cost table: how long every kernel takes on every device, and what a
link costs between every pair of devices.

Contract: ``times[k][d]`` is the time in seconds of kernel ``k`` on device
``d`` inside a replayed segment (launch overhead included); a transfer of
``n`` bytes from ``a`` to ``b`` takes ``latency[a][b] + n / bandwidth[a][b]``
seconds and occupies the ``a -> b`` direction of the link for that long
(links are full duplex, one transfer at a time per direction).  ``mem[d]``
is the byte budget of device ``d`` (``None``: unbounded).

Two constructors: :meth:`CostTable.from_profiles` takes measured per-kernel
times (one list per device, as the runtime's profiler produces them) and
:meth:`CostTable.estimate` derives a roofline estimate from each kernel's
``flops``/``bytes`` and a :class:`DeviceModel` per device, so graphs without
profiles can be planned.

Every source of kernel times is a :class:`CostModel` (``table(graph,
devices) -> CostTable``): :class:`Roofline` (the presets here),
``registry.Measured`` (profiled tables by graph, a roofline for the others),
``offload.rates.HostRoofline`` (CPU rates while a copy stream runs, gathers
read what they write) and ``whatif.Fitted`` (the fitted what-if roofline of
simulated GPUs).  Pure Python; no torch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

from tessera_actors.devices import DeviceSpec
from tessera_actors.graph import KernelGraph
from tessera_actors.plan import PlanError

FORMAT_VERSION = 1


@dataclass(frozen=True)
class DeviceModel:
    """Peak rates of a device for the roofline estimate
    ``launch_s + max(flops / flops_per_s, bytes / bytes_per_s)``."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    launch_s: float


# Measured on one H200 (DESIGN.md): bf16 GEMM rate and copy bandwidth per SM
# limit; ~2.3 us per kernel inside a CUDA-graph replay.
_H200_BY_SMS = {132: (789e12, 4.19e12), 66: (485e12, 3.75e12), 32: (220e12, 2.25e12),
                16: (111e12, 1.23e12), 8: (56e12, 0.65e12)}
PRESETS: dict[str, DeviceModel] = {
    "h200": DeviceModel("h200", 789e12, 4.19e12, 2.3e-6),
    **{f"h200-sms{s}": DeviceModel(f"h200-sms{s}", f, b, 2.3e-6)
       for s, (f, b) in _H200_BY_SMS.items() if s != 132},
    # A server CPU core group doing bf16/fp32 math through oneDNN: order of
    # magnitude only; per-call overhead of an eager aten op.
    "cpu": DeviceModel("cpu", 1.0e12, 1.0e11, 5e-6),
}


def device_model(spec: DeviceSpec | str) -> DeviceModel:
    """The preset that best describes a device spec: ``cuda:i`` -> h200,
    ``cuda:i?sms=N`` -> H200 rates interpolated linearly in SMs between the
    measured points, ``cpu?threads=T`` -> the cpu preset scaled by T/16."""
    spec = DeviceSpec.parse(spec) if isinstance(spec, str) else spec
    if spec.kind == "cpu":
        base = PRESETS["cpu"]
        if spec.threads is None:
            return base
        f = min(spec.threads, 16) / 16
        return DeviceModel(f"cpu-t{spec.threads}", base.flops_per_s * f,
                           base.bytes_per_s * max(f, 0.25), base.launch_s)
    if spec.sms is None or spec.sms >= 132:
        return PRESETS["h200"]
    pts = sorted(_H200_BY_SMS.items())
    sms = max(spec.sms, 1)
    lo = max([p for p in pts if p[0] <= sms], default=pts[0], key=lambda p: p[0])
    hi = min([p for p in pts if p[0] >= sms], default=pts[-1], key=lambda p: p[0])
    if lo[0] == hi[0]:
        fl, bw = lo[1] if sms >= lo[0] else (lo[1][0] * sms / lo[0], lo[1][1] * sms / lo[0])
    else:
        w = (sms - lo[0]) / (hi[0] - lo[0])
        fl = lo[1][0] + w * (hi[1][0] - lo[1][0])
        bw = lo[1][1] + w * (hi[1][1] - lo[1][1])
    return DeviceModel(f"h200-sms{spec.sms}", fl, bw, 2.3e-6)


def default_link(a: DeviceSpec, b: DeviceSpec) -> tuple[float, float]:
    """(latency s, bandwidth B/s) between two devices, from DESIGN.md numbers:
    two partitions of one GPU share memory (an event wait and a device copy),
    two GPUs use NVLink (~24 us, 385 GB/s), GPU<->CPU pinned copies
    (~10 us, 55 GB/s), CPU<->CPU in one host a memcpy."""
    if a.kind == "cuda" and b.kind == "cuda":
        return (5e-6, 2.0e12) if a.index == b.index else (24e-6, 385e9)
    if a.kind == "cpu" and b.kind == "cpu":
        return (5e-6, 20e9)
    return (10e-6, 55e9)


def kernel_bytes(graph: KernelGraph, k: int) -> float:
    """The kernel's ``bytes`` feature, or the bytes of its access ranges
    (a read-modify-write range counts twice)."""
    kern = graph.kernels[k]
    if kern.bytes > 0:
        return kern.bytes
    return float(sum(a.nbytes * (a.reads + a.writes) for a in kern.accesses))


def link_matrices(n: int, link: Callable[[int, int], tuple[float, float]]
                  ) -> tuple[list[list[float]], list[list[float]]]:
    """(latency s, bandwidth B/s) between every two of ``n`` devices, as
    ``link(a, b)`` gives them; a device to itself: 0 s, unbounded."""
    lat = [[0.0] * n for _ in range(n)]
    bw = [[float("inf")] * n for _ in range(n)]
    for a in range(n):
        for b in range(n):
            if a != b:
                lat[a][b], bw[a][b] = link(a, b)
    return lat, bw


@dataclass
class CostTable:
    """Kernel times, links and memory budgets for one graph on ``devices``."""

    devices: list[str]
    times: list[list[float]]          # [kernel][device] seconds
    latency: list[list[float]]        # [src][dst] seconds
    bandwidth: list[list[float]]      # [src][dst] bytes/s
    mem: list[int | None]             # [device] byte budget
    source: str = "estimate"          # "estimate" | "profile"

    def __post_init__(self) -> None:
        n = len(self.devices)
        if any(len(row) != n for row in self.times):
            raise PlanError(f"cost table: every kernel needs a time on each of {n} devices")
        if len(self.latency) != n or len(self.bandwidth) != n or len(self.mem) != n:
            raise PlanError("cost table: link matrices and budgets must have one entry per device")
        for row in self.times:
            for t in row:
                if not t >= 0:
                    raise PlanError(f"cost table: kernel time {t!r} is not a non-negative number")

    @property
    def ndev(self) -> int:
        return len(self.devices)

    def comm_s(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds to move ``nbytes`` from ``src`` to ``dst`` (0 on one device)."""
        if src == dst:
            return 0.0
        return self.latency[src][dst] + nbytes / self.bandwidth[src][dst]

    def device_total(self, d: int) -> float:
        """Time of the whole graph on device ``d`` alone."""
        return sum(row[d] for row in self.times)

    def check_graph(self, graph: KernelGraph) -> None:
        if len(self.times) != len(graph.kernels):
            raise PlanError(f"cost table has {len(self.times)} kernels, graph has {len(graph.kernels)}")

    # -- constructors -----------------------------------------------------
    @classmethod
    def _links(cls, specs: Sequence[DeviceSpec], links: dict | None):
        return link_matrices(len(specs), lambda a, b: (links or {}).get((a, b)) or default_link(specs[a], specs[b]))

    @classmethod
    def from_profiles(cls, graph: KernelGraph, devices: Sequence[str],
                      profiles: Sequence[Sequence[float]],
                      links: dict[tuple[int, int], tuple[float, float]] | None = None) -> "CostTable":
        """Measured times: ``profiles[d][k]`` seconds of kernel ``k`` on device
        ``d``. ``links[(a, b)] = (latency_s, bytes_per_s)`` overrides the
        default link model for that direction."""
        specs = [DeviceSpec.parse(d) for d in devices]
        if len(profiles) != len(specs):
            raise PlanError(f"{len(profiles)} profiles for {len(specs)} devices")
        for d, prof in enumerate(profiles):
            if len(prof) != len(graph.kernels):
                raise PlanError(f"profile of {devices[d]} has {len(prof)} kernels, graph has {len(graph.kernels)}")
        times = [[float(profiles[d][k]) for d in range(len(specs))] for k in range(len(graph.kernels))]
        lat, bw = cls._links(specs, links)
        return cls(list(devices), times, lat, bw, [s.mem for s in specs], "profile")

    @classmethod
    def estimate(cls, graph: KernelGraph, devices: Sequence[str],
                 models: Sequence[DeviceModel | str] | None = None,
                 links: dict[tuple[int, int], tuple[float, float]] | None = None) -> "CostTable":
        """Roofline estimate from kernel flops/bytes. ``models`` gives a
        :class:`DeviceModel` (or preset name) per device; default
        :func:`device_model` of each spec."""
        specs = [DeviceSpec.parse(d) for d in devices]
        if models is None:
            ms = [device_model(s) for s in specs]
        else:
            if len(models) != len(specs):
                raise PlanError(f"{len(models)} device models for {len(specs)} devices")
            try:
                ms = [PRESETS[m] if isinstance(m, str) else m for m in models]
            except KeyError as e:
                raise PlanError(f"unknown device model {e.args[0]!r}; presets: {sorted(PRESETS)}") from None
        times = []
        for k in graph.kernels:
            nb = kernel_bytes(graph, k.id)
            times.append([m.launch_s + max(k.flops / m.flops_per_s, nb / m.bytes_per_s) for m in ms])
        lat, bw = cls._links(specs, links)
        return cls(list(devices), times, lat, bw, [s.mem for s in specs], "estimate")

    # -- serialisation ------------------------------------------------------
    def to_dict(self) -> dict:
        inf = lambda v: None if v == float("inf") else v  # noqa: E731
        return {"version": FORMAT_VERSION, "devices": self.devices, "times": self.times,
                "latency": self.latency, "bandwidth": [[inf(v) for v in r] for r in self.bandwidth],
                "mem": self.mem, "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        if d.get("version") != FORMAT_VERSION:
            raise PlanError(f"cost table format version {d.get('version')!r}, expected {FORMAT_VERSION}")
        bw = [[float("inf") if v is None else float(v) for v in r] for r in d["bandwidth"]]
        return cls(list(d["devices"]), d["times"], d["latency"], bw, list(d["mem"]), d.get("source", "profile"))

    def save(self, path: str | Path) -> None:
        """JSON (readable, diffable; a 1000x4 table is ~100 kB), stamped with
        where it was measured (``git_commit``, ``command``: ignored on load)."""
        from tessera_actors.provenance import provenance
        Path(path).write_text(json.dumps({**self.to_dict(), **provenance()}))

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (ValueError, KeyError, TypeError) as e:
            raise PlanError(f"{path}: not a cost table ({e})") from e


class CostModel(Protocol):
    """Where a plan's kernel times come from."""

    def table(self, graph: KernelGraph, devices: Sequence[str]) -> CostTable:
        """The cost table of ``graph`` on ``devices`` (device spec strings)."""
        ...


@dataclass(frozen=True)
class Roofline:
    """Roofline estimates from each device's :class:`DeviceModel`
    (``models``: one per device, or preset names; None: :func:`device_model`
    of each spec)."""
    models: tuple | None = None

    def table(self, graph: KernelGraph, devices: Sequence[str]) -> CostTable:
        return CostTable.estimate(graph, devices, self.models)


def costs_path_for(graph_path: str | Path) -> Path:
    """Where the cost table of a graph file lives: ``model.tgraph`` ->
    ``model.costs.json`` next to it."""
    p = Path(graph_path)
    return p.with_name(p.stem + ".costs.json")
