"""What-if kernel costs: predict a graph's per-kernel times on GPUs we do not have.

Per kernel, features come from the graph alone (:mod:`.whatif_features`):
FLOPs and whether they run on tensor cores and in which dtype (library
kernels: the aten schema in the payload; Triton kernels: their PTX's
``mma``/``wgmma`` count), the bytes it moves (the access sets, tightened by
the launch: a Triton kernel touches at most ``numel`` elements of each
pointer argument, a gather reads the rows it outputs), the part of those
bytes that is activations (may hit L2) and the launch geometry (CTAs: GEMM
output tiles with split-K, Triton grids, elementwise blocks; CTAs resident
per SM from ``num_warps``).  Classes: ``gemm`` (tensor-core library kernels
and Triton kernels with MMA), ``attention`` (fused SDPA with query tiles),
``attn_decode`` (fused SDPA with a few query rows per KV head: CUDA-core
rates, since they fill a sliver of a tensor-core tile), ``gather``, ``pointwise``, ``strided``
(pointwise over a non-contiguous view: a transposing copy) and ``reduction``
(library/aten kernels), ``t_pointwise`` and ``t_reduction`` (Triton).

The time of kernel ``k`` of class ``c`` on ``s`` SMs of GPU ``G`` (model
:class:`Params`, fitted by :func:`fit`)::

    t = G.launch_s + (floor[c] + wave_s * (waves - 1)) * 1.98 / G.boost_ghz + max(t_compute, t_memory)
    t_compute = flops / (peak(G, unit, dtype) * s / G.sms * eff_c[c] * wave_eff / (1 + power * s / G.sms))
    t_memory  = (bytes - l2) / bw + l2 / (bw * l2_gain)
    bw = ((G.mem_bw * eff_m[c])^-p + (min(s, ctas) * bw_sm * sm_eff[c] * G.boost_ghz)^-p)^(-1/p)

``waves = ceil(ctas / (s * resident))`` and ``wave_eff = ctas / (waves * s *
resident)`` quantise the launch over the SMs (the floor and the wave tails
are fixed cycle counts, so they shrink with the clock); ``bw`` saturates in the SMs
that have work (a few SMs cannot pull HBM's bandwidth); ``l2`` is the
activation bytes when they fit in half the L2.  :func:`fit` adds per-kernel
corrections (median log residual of each kernel signature per fitted
SM count, interpolated in log SMs), applied by :func:`predict` to kernels whose
signature was profiled.  Torch-free (numpy + scipy).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tessera_actors.graph import KernelGraph
from tessera_actors.planning.costs import CostTable, link_matrices
from tessera_actors.planning.specs import GpuSpec, get_spec, link_between
from tessera_actors.planning.whatif_features import CLASSES, KernelFeatures, graph_features, kernel_features

TILED = ("gemm", "attention", "attn_decode")   # classes launched as output tiles, one CTA resident per SM
REF_GHZ = 1.98          # clock the floor and wave terms are expressed at (H100/H200 SXM boost)


@dataclass
class Params:
    """Fitted terms of the cost model (module docstring); defaults are a
    neutral start (fit them with :func:`fit`)."""

    eff_c: dict[str, float] = field(default_factory=lambda: {c: 0.8 for c in CLASSES})
    eff_m: dict[str, float] = field(default_factory=lambda: {c: 0.85 for c in CLASSES})
    floor: dict[str, float] = field(default_factory=lambda: {c: 1e-6 for c in CLASSES})
    sm_eff: dict[str, float] = field(default_factory=lambda: {c: 1.0 for c in CLASSES})
    bw_sm: float = 40e9          # bytes/s one SM pulls per GHz (H200 copy at 8 SMs, DESIGN.md: 0.65 TB/s)
    # sharpness of the bandwidth saturation, held near 2 by the fit's bounds: the knee of
    # H200's copy bandwidth vs SM count (DESIGN.md: 0.65/1.23/2.25/3.75/4.19 TB/s at
    # 8/16/32/66/132 SMs is p ~ 2); fitted freely on partitions up to 64 SMs it goes sharp
    # (8) and the model then saturates every kernel too early (leave-132-out step +30..45%)
    p: float = 2.0
    power: float = 0.15          # clock loss at full occupancy of the chip
    l2_gain: float = 2.0         # L2 bandwidth over HBM bandwidth for activations
    wave_s: float = 0.5e-6       # extra seconds per additional wave
    corrections: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.sm_eff, dict):     # positional construction without sm_eff
            raise TypeError("Params.sm_eff must be a dict of per-class factors")

    _SCALARS = ("bw_sm", "p", "power", "l2_gain", "wave_s")

    def vector(self) -> np.ndarray:
        v = [self.eff_c[c] for c in CLASSES] + [self.eff_m[c] for c in CLASSES]
        v += [self.floor[c] * 1e6 for c in CLASSES]
        v += [self.sm_eff[c] for c in CLASSES]
        v += [self.bw_sm / 1e9, self.p, self.power, self.l2_gain, self.wave_s * 1e6]
        return np.array(v, dtype=float)

    @classmethod
    def from_vector(cls, v: Sequence[float], corrections: dict | None = None) -> "Params":
        n = len(CLASSES)
        return cls({c: float(v[i]) for i, c in enumerate(CLASSES)},
                   {c: float(v[n + i]) for i, c in enumerate(CLASSES)},
                   {c: float(v[2 * n + i]) * 1e-6 for i, c in enumerate(CLASSES)},
                   {c: float(v[3 * n + i]) for i, c in enumerate(CLASSES)},
                   float(v[4 * n]) * 1e9, float(v[4 * n + 1]), float(v[4 * n + 2]), float(v[4 * n + 3]),
                   float(v[4 * n + 4]) * 1e-6, dict(corrections or {}))

    def to_dict(self) -> dict:
        return {"eff_c": self.eff_c, "eff_m": self.eff_m, "floor": self.floor, "sm_eff": self.sm_eff,
                **{k: getattr(self, k) for k in self._SCALARS},
                "corrections": {k: [list(x) for x in v] for k, v in self.corrections.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Params":
        base = cls()          # a class missing from an older file keeps the neutral start
        return cls({**base.eff_c, **d["eff_c"]}, {**base.eff_m, **d["eff_m"]}, {**base.floor, **d["floor"]},
                   {**base.sm_eff, **(d.get("sm_eff") or {})},
                   *[float(d[k]) for k in cls._SCALARS],
                   {k: [(int(s), float(r)) for s, r in v] for k, v in d.get("corrections", {}).items()})


_NC = len(CLASSES)
_LO = np.array([0.05] * _NC + [0.05] * _NC + [0.0] * _NC + [0.02] * _NC + [1.0, 1.9, 0.0, 1.0, 0.0])
_HI = np.array([1.0] * _NC + [1.0] * _NC + [50.0] * _NC + [3.0] * _NC + [200.0, 2.1, 1.0, 6.0, 20.0])


def roofline_time(f: KernelFeatures, spec: GpuSpec, sms: int, p: Params) -> float:
    """Seconds of one kernel on ``sms`` SMs of ``spec``, without corrections."""
    s = max(1, min(int(sms), spec.sms))
    tiled = f.cls in TILED
    slots = s * (f.resident if not tiled else 1)
    waves = math.ceil(f.ctas / slots)
    wave_eff = f.ctas / (waves * slots)
    frac = s / spec.sms
    peak = (spec.tensor_peak(f.dtype) if f.tensor else spec.fp32) * frac
    tc = f.flops / (peak * p.eff_c[f.cls] * min(1.0, wave_eff if tiled else 1.0)
                    / (1 + p.power * frac)) if f.flops else 0.0
    active = min(s, f.ctas)
    hbm, sm_bw = spec.mem_bw * p.eff_m[f.cls], active * p.bw_sm * p.sm_eff[f.cls] * spec.boost_ghz
    r = hbm / sm_bw            # (hbm^-p + sm_bw^-p)^(-1/p), without under/overflow
    bw = hbm / (1 + r ** p.p) ** (1 / p.p) if r < 1e3 else sm_bw
    l2 = f.act_bytes if f.act_bytes <= spec.l2_bytes / 2 else 0.0
    tm = (f.bytes - l2) / bw + l2 / (bw * p.l2_gain)
    cycles = REF_GHZ / spec.boost_ghz       # floors and wave tails are fixed cycle counts
    return spec.launch_s + (p.floor[f.cls] + p.wave_s * (waves - 1)) * cycles + max(tc, tm)


class _Rows:
    """Kernel rows ``(features, spec, sms)`` as arrays: :func:`roofline_time`
    over all of them at once (the fit's inner loop)."""

    def __init__(self, rows: Sequence[tuple[KernelFeatures, GpuSpec, int]]) -> None:
        a = lambda xs: np.array(list(xs), dtype=float)       # noqa: E731
        self.cls = np.array([CLASSES.index(f.cls) for f, _, _ in rows], dtype=int)
        self.tiled = np.isin(self.cls, [CLASSES.index(c) for c in TILED])
        full = a(sp.sms for _, sp, _ in rows)
        self.s = np.clip(a(n for _, _, n in rows), 1, full)
        self.frac = self.s / full
        slots = self.s * np.where(self.tiled, 1.0, a(f.resident for f, _, _ in rows))
        ctas = a(f.ctas for f, _, _ in rows)
        self.waves = np.ceil(ctas / slots)
        self.wave_eff = np.where(self.tiled, np.minimum(1.0, ctas / (self.waves * slots)), 1.0)
        self.peak = a((sp.tensor_peak(f.dtype) if f.tensor else sp.fp32) for f, sp, _ in rows) * self.frac
        self.flops = a(f.flops for f, _, _ in rows)
        self.active = np.minimum(self.s, ctas)
        self.mem_bw = a(sp.mem_bw for _, sp, _ in rows)
        self.boost = a(sp.boost_ghz for _, sp, _ in rows)
        self.bytes = a(f.bytes for f, _, _ in rows)
        act = a(f.act_bytes for f, _, _ in rows)
        self.l2 = np.where(act <= a(sp.l2_bytes for _, sp, _ in rows) / 2, act, 0.0)
        self.launch = a(sp.launch_s for _, sp, _ in rows)

    def times(self, p: Params) -> np.ndarray:
        pick = lambda d: np.array([d[c] for c in CLASSES])[self.cls]      # noqa: E731
        with np.errstate(divide="ignore", invalid="ignore"):
            tc = np.where(self.flops > 0, self.flops / (self.peak * pick(p.eff_c) * self.wave_eff
                                                        / (1 + p.power * self.frac)), 0.0)
            hbm = self.mem_bw * pick(p.eff_m)
            sm_bw = self.active * p.bw_sm * pick(p.sm_eff) * self.boost
            r = hbm / sm_bw
            bw = np.where(r < 1e3, hbm / (1 + np.minimum(r, 1e3) ** p.p) ** (1 / p.p), sm_bw)
        tm = (self.bytes - self.l2) / bw + self.l2 / (bw * p.l2_gain)
        cycles = REF_GHZ / self.boost
        return self.launch + (pick(p.floor) + p.wave_s * (self.waves - 1)) * cycles + np.maximum(tc, tm)


def correction(p: Params, key: str, sms: int) -> float:
    """Multiplicative correction of a profiled kernel at ``sms`` SMs: its log
    residual interpolated linearly in log(SMs) between the fitted SM counts
    around ``sms`` (the nearest one's outside their range)."""
    pts = p.corrections.get(key)
    if not pts:
        return 1.0
    x = math.log(max(sms, 1))
    lo = [q for q in pts if math.log(q[0]) <= x]
    hi = [q for q in pts if math.log(q[0]) >= x]
    if not lo or not hi:
        return math.exp((hi or lo)[0 if not lo else -1][1])
    (s0, r0), (s1, r1) = lo[-1], hi[0]
    if s0 == s1:
        return math.exp(r0)
    w = (x - math.log(s0)) / (math.log(s1) - math.log(s0))
    return math.exp(r0 + w * (r1 - r0))


def kernel_time(f: KernelFeatures, spec: GpuSpec, sms: int, p: Params, corrected: bool = True) -> float:
    t = roofline_time(f, spec, sms, p)
    return t * correction(p, f.key, sms) if corrected else t


@dataclass
class Profile:
    """Measured seconds of every kernel of ``graph`` on ``sms`` SMs of ``gpu``."""

    graph: KernelGraph
    gpu: str
    sms: int
    times: list[float]
    tag: str = ""


@dataclass
class StepProfile:
    """A measured whole step (the sum of its kernels' times) of ``graph``."""

    graph: KernelGraph
    gpu: str
    sms: int
    step_s: float
    tag: str = ""


def fit(profiles: Sequence[Profile], start: Params | None = None, corrections: bool = True,
        prior_weight: float = 0.3, steps: Sequence[StepProfile] = (), step_weight: float = 3.0,
        profile_steps: float = 1.0) -> Params:
    """Least squares on log(predicted / measured) over every kernel of every
    profile (robust loss), plus ``profile_steps`` x sqrt(its kernels) x
    log(predicted / measured) of each profile's whole step (so the few
    kernels that make up most of a step are fitted by the roofline, not only
    by their corrections: the corrections cannot carry a kernel's SM scaling
    beyond the profiled SM counts), plus ``step_weight`` x log(predicted /
    measured) of every whole step in ``steps`` (graphs timed only as a
    whole), with a weak pull (``prior_weight``) towards ``start`` (default
    :class:`Params`), then per-kernel corrections (see module docstring)."""
    from scipy.optimize import least_squares
    rows = []
    groups = []         # (first row, end row, log measured step, weight) per profile
    for pr in profiles:
        spec = get_spec(pr.gpu)
        first = len(rows)
        for f, t in zip(graph_features(pr.graph), pr.times):
            if t > 0:
                rows.append((f, spec, pr.sms, math.log(t)))
        if profile_steps > 0 and len(rows) > first:
            meas = sum(t for t in pr.times if t > 0)
            groups.append((first, len(rows), math.log(meas), profile_steps * math.sqrt(len(rows) - first)))
    whole = [(graph_features(st.graph), get_spec(st.gpu), st.sms, math.log(st.step_s)) for st in steps]
    if not rows and not whole:
        raise ValueError("fit: no measured kernel times")
    prior = np.clip((start or Params()).vector(), _LO + 1e-9, _HI - 1e-9)
    span = _HI - _LO
    ys = np.array([y for *_, y in rows])
    vec = _Rows([(f, s, n) for f, s, n, _ in rows])

    def resid(v: np.ndarray) -> np.ndarray:
        return np.log(vec.times(Params.from_vector(v))) - ys

    def objective(v: np.ndarray) -> np.ndarray:
        # a weak pull to the prior keeps terms the profiles do not constrain
        # (a class that never occurs, SM scaling from one count) at it
        p = Params.from_vector(v)
        r = resid(v)
        pred = np.exp(r + ys)
        own = [w * (math.log(pred[a:b].sum()) - y) for a, b, y, w in groups]
        st = [step_weight * (math.log(sum(roofline_time(f, sp, n, p) for f in fs)) - y) for fs, sp, n, y in whole]
        return np.concatenate([r, np.array(own), np.array(st), prior_weight * (v - prior) / span])
    res = least_squares(objective, prior, bounds=(_LO, _HI), loss="soft_l1", f_scale=0.2, max_nfev=200,
                        x_scale="jac")
    out = Params.from_vector(res.x)
    if corrections:
        by: dict[str, dict[int, list[float]]] = {}
        for (f, _, n, _y), r in zip(rows, resid(res.x)):
            by.setdefault(f.key, {}).setdefault(n, []).append(-float(r))
        out.corrections = {k: [(n, float(np.median(v))) for n, v in sorted(d.items())] for k, d in by.items()}
    return out


def predict(graph: KernelGraph, devices: Sequence[tuple[str, int | None]] | Sequence[str],
            params: Params, corrected: bool = True, mem: Sequence[int | None] | None = None) -> CostTable:
    """The planner's :class:`CostTable` of ``graph`` on simulated GPUs:
    ``devices`` are GPU names (whole GPUs) or ``(name, sms)`` pairs; links
    from :func:`.specs.link_between`; memory budgets default to each GPU's
    capacity.  Device names in the table are ``NAME`` or ``NAME#i`` when a
    type repeats (``NAME?sms=N`` for a partition)."""
    devs = [(d, None) if isinstance(d, str) else (d[0], d[1]) for d in devices]
    specs = [get_spec(n) for n, _ in devs]
    sms = [s or sp.sms for (_, s), sp in zip(devs, specs)]
    feats = graph_features(graph)
    kinds = list(dict.fromkeys(zip([sp.name for sp in specs], sms)))     # each GPU type once
    col = {kind: [kernel_time(f, get_spec(kind[0]), kind[1], params, corrected) for f in feats] for kind in kinds}
    per = [col[(sp.name, n)] for sp, n in zip(specs, sms)]
    times = [[per[d][k] for d in range(len(specs))] for k in range(len(feats))]
    names, seen = [], {}
    for (n, s), sp in zip(devs, specs):
        base = sp.name + (f"?sms={s}" if s and s < sp.sms else "")
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    lat, bw = link_matrices(len(specs), lambda a, b: link_between(specs[a], specs[b]))
    budgets = list(mem) if mem is not None else [sp.mem_bytes for sp in specs]
    return CostTable(names, times, lat, bw, budgets, "whatif")


@dataclass(frozen=True)
class Fitted:
    """The :class:`~tessera_actors.planning.costs.CostModel` of
    :func:`predict`: the fitted what-if roofline of simulated GPUs
    (``devices``: GPU names)."""
    params: "Params"
    corrected: bool = True

    def table(self, graph: KernelGraph, devices: Sequence[str]) -> CostTable:
        return predict(graph, devices, self.params, self.corrected)


__all__ = ["CLASSES", "Fitted", "KernelFeatures", "Params", "Profile", "StepProfile", "correction", "fit", "graph_features",
           "kernel_features", "kernel_time", "predict", "roofline_time"]
