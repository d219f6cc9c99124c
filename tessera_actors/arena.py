"""``tessera bench arena``: every placement policy side by side, in one run,
on one heterogeneous pair (DESIGN.md, "the arena").

L and R default to ``cuda:0`` and ``cuda:1?sms=32`` (two H200s, R limited to
32 SMs through a green context); on one GPU, ``cuda:0?sms=100`` and
``cuda:0?sms=32`` (functional only); on CPU, two CPU devices (functional).

Measured per model (random weights, real layer shapes, ``--layers`` layers):
* decode at ``--batch`` sequences with a ``--cache``-token static KV cache:
  Homo-L, Homo-R, AF and layer split (2 micro-batches of batch/2 in flight),
  Tessera latency (1 x batch) and throughput (2 x batch/2) plans - all
  executed with the pipelined executor (segments as CUDA graphs);
  Request Distribution from the Homo runs (a replica per device);
* prefill of one ``--prompt``-token request: Homo-L, Homo-R, Tessera latency;
* no workload numbers: served requests are measured through the serving
  engine (``tessera bench serve``), never computed from step times here;
* the ideal zero-communication kernel split from the same run's profiles;
* predicted (simulated from the profiles) vs measured step times;
* cost efficiency with declared prices (R priced in proportion to its SMs).
Writes JSON and (with matplotlib) a PNG bar chart to ``--out``.
"""
from __future__ import annotations

import gc
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from actors.backends.base import backend_for
from .capture import capture_module
from .devices import DeviceSpec
from .pipeline import PipelinedExecutor
from .plan import Plan, single_device_plan
from .profile import profile_kernels


@dataclass
class ArenaConfig:
    models: tuple[str, ...] = ("llama", "moe")
    devices: tuple[str, str] = ("cuda:0", "cuda:1?sms=32")
    layers: int = 4
    batch: int = 64
    cache: int = 2048
    prompt: int = 1024
    out_tokens: int = 128
    steps: int = 20
    dtype: str = "bfloat16"
    size: str = "real"
    out: str = "benchmarks/results"
    link_latency_s: float = 25e-6
    link_bandwidth: float = 385e9
    max_inflight: int = 4
    measure_links: bool = False     # time the L<->R copies instead of DESIGN.md's 25 us / 385 GB/s
    max_slots: int = 8              # micro-batch slots a mix may use (each holds its own KV cache)
    capture: str = "aten"           # aten | inductor
    r_mem: float | None = 0.6       # memory variant: R's budget (<1: fraction of the whole model+cache; else bytes)
    compile_baseline: bool = False  # also time torch.compile(mode="reduce-overhead") on L
    streams: str = "device"         # pipelined executor: one stream pair per device, or per slot
    log: Any = print
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch < 2 or self.batch % 2:
            raise ValueError("--batch must be even and >= 2 (the pipelined policies use two micro-batches)")
        if self.prompt >= self.cache:
            raise ValueError("--prompt must be shorter than --cache")


def default_devices() -> tuple[str, str]:
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return ("cuda:0", "cuda:1?sms=32")
    if torch.cuda.is_available():
        return ("cuda:0?sms=100", "cuda:0?sms=32")
    return ("cpu", "cpu?threads=1")


def price_of(spec: str) -> float:
    """$/hour: the declared price, else an H200 share proportional to SMs."""
    s = DeviceSpec.parse(spec)
    if s.price != 1.0 or s.kind == "cpu":
        return s.price
    return 1.0 * (s.sms or 132) / 132


def ideal_split(profiles: list[list[float]]) -> float:
    """min over kernel partitions of max(sum on L, sum on R): the zero-
    communication limit of kernel placement (no ordering, no transfers)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    n = len(profiles[0])
    tl, tr = np.array(profiles[0]), np.array(profiles[1])
    c = np.zeros(n + 1)
    c[-1] = 1.0
    a = np.zeros((2, n + 1))
    a[0, :n], a[0, -1] = tl, -1.0          # sum x*tl - T <= 0
    a[1, :n], a[1, -1] = -tr, -1.0         # sum (1-x)*tr - T <= 0
    cons = LinearConstraint(a, [-np.inf, -np.inf], [0.0, -tr.sum()])
    integrality = np.r_[np.ones(n), 0]
    bounds = Bounds(np.r_[np.zeros(n), 0], np.r_[np.ones(n), np.inf])
    res = milp(c, constraints=cons, integrality=integrality, bounds=bounds, options={"time_limit": 20})
    return float(res.fun) if res.x is not None else min(tl.sum(), tr.sum())


class Phase:
    """One captured graph (a bucket) with its per-device profiles."""

    def __init__(self, cfg: ArenaConfig, name: str, kind: str, batch: int, seq: int, backends) -> None:
        from . import models
        dev = backends[0].device
        dtype = getattr(torch, cfg.dtype)
        t0 = time.perf_counter()
        model = models.get(name, cfg.size, dtype=dtype, seed=0, device=dev, n_layers=cfg.layers,
                           max_batch=batch, max_seq=cfg.cache)
        self.inputs = {k: v.to(dev) for k, v in model.example_inputs(kind, batch=batch, seq=seq,
                                                                     pos=cfg.cache - seq - 1).items()}
        meta = {"model": name, "bucket": f"{kind}:{batch}:{seq}"}
        self.program_cls = None
        self.streams = cfg.streams
        if cfg.capture == "inductor":
            from actors.backends.triton import TritonProgram
            from .capture.inductor import capture_inductor
            cap = capture_inductor(model, self.inputs, meta=meta)
            self.program_cls = TritonProgram
        else:
            from actors.backends.aten import AtenProgram
            cap = capture_module(model, self.inputs, meta=meta)
            self.program_cls = AtenProgram
        self.compiled_step_s = compiled_baseline(model, self.inputs) if cfg.compile_baseline and kind == "decode" else None
        del model
        self.graph, self.values = cap.graph, cap.values
        self.capture_s = time.perf_counter() - t0
        self.profiles = [profile_kernels(self.graph, self.values, self.inputs, be, program_cls=self.program_cls)
                         for be in backends]
        self.profile_s = time.perf_counter() - t0 - self.capture_s
        from .planning import CostTable
        if cfg.measure_links:
            from .profile import measured_links
            links = measured_links(backends)
        else:
            links = {(0, 1): (cfg.link_latency_s, cfg.link_bandwidth), (1, 0): (cfg.link_latency_s, cfg.link_bandwidth)}
        self.costs = CostTable.from_profiles(self.graph, list(cfg.devices), self.profiles, links)
        cfg.log(f"  {name} {kind} batch {batch} x {seq}: {len(self.graph.kernels)} kernels, capture "
                f"{self.capture_s:.1f} s, profile {self.profile_s:.1f} s; sum L {sum(self.profiles[0]) * 1e6:.0f} us, "
                f"R {sum(self.profiles[1]) * 1e6:.0f} us")


def compiled_baseline(model, inputs, steps: int = 20) -> float | None:
    """Seconds per step of the same model and batch under plain
    ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), on L."""
    if not torch.cuda.is_available():
        return None
    fn = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            fn(**inputs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn(**inputs)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def measure(phase: Phase, plan: Plan, backends, microbatches: int, steps: int, held: list | None = None) -> float:
    """Measured seconds per step (all micro-batches) of ``plan``; the bytes
    each device holds are appended to ``held`` when given."""
    bes = list(backends)
    ex = PipelinedExecutor(phase.graph, plan, phase.values, bes, microbatches=microbatches,
                           program_cls=phase.program_cls, streams=phase.streams, costs=phase.costs)
    ex.enqueue([phase.inputs] * microbatches)
    t = ex.time_steps(steps)
    if held is not None:
        held.extend(ex.allocated_bytes())
    del ex
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return t


def busy_fractions(runs, costs, seconds: float, devices) -> list[float]:
    """Per arena device: the profiled kernel time of ``runs`` ((plan,
    executions) pairs) over the measured ``seconds`` - how busy each GPU was."""
    from .planning.mix import device_busy
    busy = [0.0] * len(devices)
    for plan, n in runs:
        per = device_busy(plan, costs) if len(plan.devices) > 1 else \
            [sum(costs.times[k][list(devices).index(plan.devices[0])] for k in range(len(costs.times)))]
        for d, t in zip([list(devices).index(x) for x in plan.devices], per):
            busy[d] += n * t
    return [b / seconds for b in busy]


def predicted_step(plan: Plan, costs, microbatches: int) -> float:
    from .planning.simulate import simulate
    pred = simulate(plan, costs, inflight=microbatches)
    return microbatches / pred.throughput if pred.throughput else math.inf


def run_model(cfg: ArenaConfig, name: str, backends) -> dict[str, Any]:
    """Decode policies on one graph at ``cfg.batch``. Pipelined policies keep
    several such micro-batches in flight (each a full batch with its own KV
    cache), as Request Distribution keeps one per device; tokens/s counts
    every micro-batch."""
    from .planning import MilpPlanner
    from .planning.baselines import af_plan, layer_split_plan
    L, R = cfg.devices
    log = cfg.log
    log(f"== {name}: {cfg.layers} layers, {cfg.dtype}, L={L} R={R}")
    full = Phase(cfg, name, "decode", cfg.batch, 1, backends)
    # the graph and its measured cost table, so plans can be studied offline later
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    full.graph.save(out / f"{name}-decode-b{cfg.batch}.tgraph")
    full.costs.save(out / f"{name}-decode-b{cfg.batch}.costs.json")
    rows: list[dict[str, Any]] = []
    devs = list(cfg.devices)

    def add(policy: str, plan: Plan | None, mb: int, step_s: float | None = None,
            devices_used: tuple[str, ...] = (L, R), note: str = "") -> dict[str, Any]:
        if step_s is None:
            devices_of = plan.devices
            bes = backends if len(devices_of) > 1 else [backends[cfg.devices.index(devices_of[0])]]
            step_s = measure(full, plan, bes, mb, cfg.steps)
        tokens = mb * cfg.batch / step_s
        row = {"policy": policy, "step_us": step_s * 1e6, "tokens_per_s": tokens,
               "microbatches": mb, "devices": list(devices_used), "note": note}
        if plan is not None:
            row["busy"] = busy_fractions([(plan, mb)], full.costs, step_s, cfg.devices)
            pc = full.costs
            if len(plan.devices) == 1:
                from .planning import CostTable
                d = cfg.devices.index(plan.devices[0])
                pc = CostTable(list(plan.devices), [[t[d]] for t in pc.times], [[0.0]], [[math.inf]], [None], "profile")
            row["predicted_us"] = predicted_step(plan, pc, mb) * 1e6
            row["bytes_per_step"] = plan.bytes_per_step() * mb
            row["segments"] = len(plan.segments)
            if "predicted" in plan.meta:
                row["predicted_busy"] = plan.meta["predicted"].get("busy")
        rows.append(row)
        log(f"  {policy:<22} {row['step_us']:9.0f} us/step x{mb}  {tokens:10.0f} tok/s"
            + (f"  (predicted {row['predicted_us']:.0f} us, {row.get('segments')} segments)" if "predicted_us" in row else ""))
        return row

    homo_l = add("Homo-L", single_device_plan(full.graph, L), 1, devices_used=(L,))
    homo_r = add("Homo-R", single_device_plan(full.graph, R), 1, devices_used=(R,))
    rd_step = 1 / (1 / (homo_l["step_us"] * 1e-6) + 1 / (homo_r["step_us"] * 1e-6))
    add("Request Distribution", None, 1, step_s=rd_step, note="a replica per device; from the Homo runs")
    baseline_plans = []
    for policy, make in (("AF", af_plan), ("layer split", layer_split_plan)):
        try:
            bp = make(full.graph, devs, full.costs)
            bp.name = policy
            baseline_plans.append(bp)
            add(policy, bp, 2)
        except Exception as e:  # e.g. no attention scopes
            log(f"  {policy} not applicable: {type(e).__name__}: {e}")
    t0 = time.perf_counter()
    from .planning.planner import PlannerConfig
    pcfg = PlannerConfig(max_inflight=cfg.max_inflight)   # plan for the depth the executor will run
    lat = MilpPlanner(full.costs, pcfg).plan(full.graph, devs, "latency")
    thr = MilpPlanner(full.costs, pcfg).plan(full.graph, devs, "throughput")
    plan_s = time.perf_counter() - t0
    add("Tessera latency", lat, 1, note=f"source {lat.meta.get('source')}")
    mb = max(1, min(thr.microbatches, cfg.max_inflight))
    add("Tessera throughput", thr, mb, note=f"source {thr.meta.get('source')}, "
        f"gap {thr.meta.get('solver', {}).get('mip_gap')}")
    memory = memory_variant(cfg, full, backends, add) if cfg.r_mem else None
    from .planning.mix import best_mix
    mix = best_mix(full.graph, devs, full.costs, thr, max_slots=cfg.max_slots, extra=baseline_plans)
    sched = mix.meta.get("schedule")
    if sched is None:   # an LP-scored mix: slots at the LP's rates
        from .planning.schedule import list_schedule
        top = max(mix.rates)
        sched = list_schedule(mix.plans, full.costs, steps=[max(1, round(cfg.steps * r / top)) for r in mix.rates])
    ex = PipelinedExecutor(full.graph, mix.plans, full.values, backends, program_cls=full.program_cls,
                           streams=cfg.streams, costs=full.costs)
    ex.enqueue([full.inputs] * ex.mb)
    wall = ex.time_slots(sched)   # the very queue order the planner scored
    del ex
    row = add("Tessera mix", None, sum(sched.steps), step_s=wall,
              note=f"{mix.label}; slot steps {sched.steps}")
    row["predicted_us"] = sched.makespan_s * 1e6
    row["busy"] = busy_fractions(list(zip(mix.plans, sched.steps)), full.costs, wall, cfg.devices)
    row["segments"] = sum(len(p.segments) for p in mix.plans)
    row["bytes_per_step"] = sum(p.bytes_per_step() for p in mix.plans)
    log(f"    mix: predicted {row['predicted_us']:.0f} us for its {sum(sched.steps)} slot-steps "
        f"(the list schedule's makespan), measured {wall * 1e6:.0f} us")
    ideal_s = ideal_split(full.profiles)
    best_ideal = cfg.batch / ideal_s
    for r in rows:
        r["of_ideal"] = r["tokens_per_s"] / best_ideal
        r["price_per_h"] = sum(price_of(d) for d in r["devices"])
        r["tokens_per_dollar"] = r["tokens_per_s"] * 3600 / r["price_per_h"]
    tess = max(r["tokens_per_s"] for r in rows if r["policy"].startswith("Tessera") and "GiB" not in r["policy"])
    log(f"  ideal zero-comm split: {ideal_s * 1e6:.0f} us per batch-{cfg.batch} step ({best_ideal:.0f} tok/s); "
        f"best Tessera plan = {tess / best_ideal * 100:.1f}% of it; both plans solved in {plan_s:.1f} s")
    if full.compiled_step_s:
        over = rows[0]["step_us"] * 1e-6 / full.compiled_step_s - 1
        log(f"  overhead check: Homo-L through tessera {rows[0]['step_us']:.0f} us vs torch.compile(reduce-overhead) "
            f"{full.compiled_step_s * 1e6:.0f} us: {over * 100:+.1f}%")
    result = {"model": name, "decode": rows, "memory_variant": memory, "compiled_step_us": (full.compiled_step_s or 0) * 1e6, "ideal": {"step_us": ideal_s * 1e6, "tokens_per_s": best_ideal},
              "capture_s": full.capture_s, "profile_s": full.profile_s, "plan_s": plan_s,
              "kernels": len(full.graph.kernels)}
    full.values.clear()   # free the decode phase's weights before the prefill phase
    gc.collect()
    result.update(run_prefill(cfg, name, backends, result))
    return result


def memory_variant(cfg: ArenaConfig, full: Phase, backends, add) -> dict[str, Any]:
    """R gets a memory budget it cannot fit the whole model and its KV cache
    into: Request Distribution and PD (decode on R) are out; Tessera's
    memory-aware plan keeps what R holds under the budget."""
    from .planning import MilpPlanner
    from .plan import PlanError
    g = full.graph
    whole = sum(b.nbytes for b in g.buffers.values())
    budget = int(cfg.r_mem * whole) if cfg.r_mem < 1 else int(cfg.r_mem)
    cfg.log(f"  memory variant: R budget {budget / 2**30:.2f} GiB, the whole model + cache needs "
            f"{whole / 2**30:.2f} GiB: Request Distribution and PD-with-decode-on-R do not fit")
    costs = full.costs.with_mem([None, budget])
    out: dict[str, Any] = {"budget_bytes": budget, "whole_bytes": whole}
    for mode in ("latency", "throughput"):
        try:
            from .planning.planner import PlannerConfig
            plan = MilpPlanner(costs, PlannerConfig(max_inflight=cfg.max_inflight)).plan(g, list(cfg.devices), mode)
        except PlanError as e:
            cfg.log(f"  memory variant {mode}: {e}")
            out[mode] = {"error": str(e)}
            continue
        mb = 1 if mode == "latency" else max(1, min(plan.microbatches, cfg.max_inflight))
        held: list[int] = []
        step = measure(full, plan, backends, mb, cfg.steps, held)
        row = add(f"Tessera {mode} (R {budget / 2**30:.1f} GiB)", plan, mb, step_s=step)
        row["held_bytes"] = held
        row["fits"] = held[1] <= budget
        cfg.log(f"    held on R: {held[1] / 2**30:.2f} GiB of {budget / 2**30:.2f} GiB "
                f"({'within' if row['fits'] else 'OVER'} budget with {mb} micro-batch(es))")
        out[mode] = row
    return out


def run_prefill(cfg: ArenaConfig, name: str, backends, decode: dict[str, Any]) -> dict[str, Any]:
    from .planning import MilpPlanner
    L, R = cfg.devices
    log = cfg.log
    try:
        pre = Phase(cfg, name, "prefill", 1, cfg.prompt, backends)
    except Exception as e:  # e.g. a model with no prefill bucket
        log(f"  prefill skipped: {e}")
        return {}
    t = {"Homo-L": measure(pre, single_device_plan(pre.graph, L), [backends[0]], 1, max(3, cfg.steps // 4)),
         "Homo-R": measure(pre, single_device_plan(pre.graph, R), [backends[1]], 1, max(3, cfg.steps // 4))}
    lat = MilpPlanner(pre.costs).plan(pre.graph, list(cfg.devices), "latency")
    t["Tessera"] = measure(pre, lat, backends, 1, max(3, cfg.steps // 4))
    for k, v in t.items():
        log(f"  prefill 1x{cfg.prompt} {k:<10} {v * 1e6:9.0f} us")
    return {"prefill_us": {k: v * 1e6 for k, v in t.items()}}


def print_table(results: list[dict[str, Any]], cfg: ArenaConfig) -> str:
    lines = [f"arena: L={cfg.devices[0]} R={cfg.devices[1]}, decode batch {cfg.batch}, cache {cfg.cache}, "
             f"{cfg.layers} layers, {cfg.dtype}; prices $/h L={price_of(cfg.devices[0]):.2f} "
             f"R={price_of(cfg.devices[1]):.2f}",
             "| model | policy | step us | predicted us | tokens/s | of ideal | tokens/$ | vs best single-plan baseline | busy L/R |",
             "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        best_other = max(r["tokens_per_s"] for r in res["decode"] if not r["policy"].startswith("Tessera")
                         and r["policy"] != "Request Distribution")
        for r in res["decode"]:
            pred = f"{r['predicted_us']:.0f}" if "predicted_us" in r else "-"
            busy = "/".join(f"{b * 100:.0f}%" for b in r["busy"]) if r.get("busy") else "-"
            lines.append(f"| {res['model']} | {r['policy']} | {r['step_us']:.0f} | {pred} | {r['tokens_per_s']:.0f} | "
                         f"{r['of_ideal'] * 100:.1f}% | {r['tokens_per_dollar']:.3g} | {r['tokens_per_s'] / best_other:.2f} "
                         f"| {busy} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results):
        names = [r["policy"] for r in res["decode"]]
        vals = [r["tokens_per_s"] for r in res["decode"]]
        ax.barh(names, vals, color=["tab:orange" if n.startswith("Tessera") else "tab:blue" for n in names])
        ax.axvline(res["ideal"]["tokens_per_s"], color="k", ls="--", label="ideal zero-comm split")
        ax.set_title(f"{res['model']} decode")
        ax.set_xlabel("tokens/s")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def run_arena(cfg: ArenaConfig) -> list[dict[str, Any]]:
    backends = [backend_for(d) for d in cfg.devices]
    results = []
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"devices": list(cfg.devices), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "config": {k: v for k, v in cfg.__dict__.items() if k not in ("log",)}}
    for name in cfg.models:
        results.append(run_model(cfg, name, backends))
        # written after every model, so an interrupted run keeps what it measured
        (out / "arena.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    table = print_table(results, cfg)
    cfg.log(table)
    if plot(results, out / "arena.png"):
        cfg.log(f"wrote {out / 'arena.json'} and {out / 'arena.png'}")
    else:
        cfg.log(f"wrote {out / 'arena.json'} (no matplotlib: no PNG)")
    return results
