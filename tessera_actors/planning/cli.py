"""``tessera plan``: place a saved graph and compare the plan with the baselines
and, for the throughput plan, with the LP bound on any placement."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

from tessera_actors.devices import DeviceSpec, DeviceSpecError, parse_devices
from tessera_actors.graph import GraphError, KernelGraph
from tessera_actors.plan import Plan, PlanError
from tessera_actors.planning.baselines import BaselineResult, single_graph_baselines
from tessera_actors.planning.bound import placement_bound
from tessera_actors.planning.costs import CostTable, Roofline, costs_path_for
from tessera_actors.planning.planner import MilpPlanner, PlannerConfig
from tessera_actors.planning.timeline import TimelineUnavailable, render_png


def load_costs(graph: KernelGraph, graph_path: str, devices: Sequence[str],
               costs_path: str | None) -> CostTable:
    """The explicit cost table, else ``<graph>.costs.json`` when it is for
    the same devices, else the roofline estimate."""
    path = Path(costs_path) if costs_path else costs_path_for(graph_path)
    if path.exists():
        costs = CostTable.load(path)
        costs.check_graph(graph)
        if [DeviceSpec.parse(d).name for d in costs.devices] != [DeviceSpec.parse(d).name for d in devices]:
            if costs_path:
                raise PlanError(f"{path} is for devices {costs.devices}, not {list(devices)}")
        else:
            return costs
    elif costs_path:
        raise PlanError(f"cost table {path} does not exist")
    return Roofline().table(graph, devices)


def _fmt_bytes(n: float | None) -> str:
    return "unbounded" if n is None else f"{n / 2**20:.1f} MiB"


def summary_lines(graph: KernelGraph, plan: Plan, costs: CostTable,
                  baselines: Sequence[BaselineResult]) -> list[str]:
    pred = plan.meta.get("predicted", {})
    res = plan.resident_bytes(graph)
    counts = plan.kernels_per_device()
    busy = pred.get("busy", [0.0] * len(plan.devices))
    lines = [f"graph: {len(graph.kernels)} kernels, {len(graph.buffers)} buffers; costs: {costs.source}",
             f"plan {plan.name} ({plan.mode}), source {plan.meta.get('source', '?')}, "
             f"{plan.microbatches} micro-batch(es) in flight",
             f"{'device':<28}{'kernels':>8}{'segments':>9}{'resident':>14}{'budget':>14}{'busy':>7}"]
    for d, dev in enumerate(plan.devices):
        nseg = sum(1 for s in plan.segments if s.device == d)
        lines.append(f"{dev:<28}{counts[d]:>8}{nseg:>9}{_fmt_bytes(res[d]):>14}{_fmt_bytes(costs.mem[d]):>14}"
                     f"{busy[d] * 100:>6.0f}%")
    cut = sum(1 for e in graph.edges if e.kind == "RAW" and plan.assignment[e.src] != plan.assignment[e.dst])
    lines.append(f"cut RAW edges: {cut}; transfers: {len(plan.transfers)}, {plan.bytes_per_step()} bytes per step")
    sol = plan.meta.get("solver", {})
    if sol:
        lines.append(f"MILP: {sol['classes']} classes x {len(plan.devices)} devices, {sol['status']}, "
                     f"gap {sol['mip_gap'] * 100:.2f}%, solve {sol['solve_s']:.2f} s")
    thr = pred.get("throughput", 0.0)
    lines.append(f"predicted: step {plan.predicted_step_s * 1e3:.3f} ms, throughput {thr:.2f} steps/s")
    lines.append(f"{'policy':<36}{'steps/s':>12}{'step ms':>10}{'tessera x':>11}")
    lines.append(f"{'tessera-' + plan.mode:<36}{thr:>12.2f}{plan.predicted_step_s * 1e3:>10.3f}{1.0:>11.2f}")
    for b in baselines:
        if b.throughput is None:
            lines.append(f"{b.name:<36}{'-':>12}{'-':>10}{'-':>11}  {b.note}")
        else:
            lines.append(f"{b.name:<36}{b.throughput:>12.2f}{b.step_s * 1e3:>10.3f}"
                         f"{thr / b.throughput:>11.2f}" + (f"  {b.note}" if b.note else ""))
    lines.append("pd: needs a prefill and a decode graph (tessera advise predicts it)")
    return lines


@contextmanager
def _phase(what: str):
    """One stderr line per phase of ``tessera plan`` with its time (the MILP
    also shows a progress bar on a terminal): a large graph takes minutes."""
    print(f"tessera plan: {what} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    yield
    print(f"tessera plan: {what}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def bound_line(graph: KernelGraph, costs: CostTable, plan: Plan) -> str:
    """The LP bound on any placement of ``graph`` (``planning/bound.py``) and
    the plan's share of it."""
    try:
        b = placement_bound([(graph, costs, 1.0)])
    except PlanError as e:
        return f"bound: {e}"
    thr = plan.meta.get("predicted", {}).get("throughput", 0.0)
    return (f"{'bound (LP relaxation)':<36}{b.throughput:>12.2f}{b.tau_s * 1e3:>10.3f}"
            f"{thr / b.throughput:>11.2f}  any placement, fractional kernel split (tessera x = plan / bound)")


def plan_command(graph_path: str, devices: list[str], mode: str, out_png: str | None,
                 costs_path: str | None, config: PlannerConfig | None = None) -> int:
    """Plan ``graph_path`` on ``devices`` and print the summary; 0 on success,
    1 when no plan exists (e.g. memory too small), 2 on bad input."""
    try:
        specs = parse_devices(devices)
        names = [s.name for s in specs]
        with _phase(f"loading {graph_path}"):
            graph = KernelGraph.load(graph_path)
            costs = load_costs(graph, graph_path, names, costs_path)
    except (OSError, GraphError, DeviceSpecError, PlanError) as e:
        print(f"tessera plan: {e}", file=sys.stderr)
        return 2
    if mode not in ("latency", "throughput"):
        print(f"tessera plan: unknown mode {mode!r} (latency | throughput)", file=sys.stderr)
        return 2
    try:
        with _phase(f"placing {len(graph.kernels)} kernels on {len(names)} devices ({mode}, MILP)"):
            config = config or PlannerConfig(progress=sys.stderr.isatty())
            plan = MilpPlanner(costs, config).plan(graph, names, mode)
    except PlanError as e:
        print(f"tessera plan: {e}", file=sys.stderr)
        return 1
    with _phase("scoring the baselines"):
        baselines = single_graph_baselines(graph, names, costs)
    print("\n".join(summary_lines(graph, plan, costs, baselines)))
    if mode == "throughput":
        print(bound_line(graph, costs, plan))
    if out_png:
        try:
            render_png(plan, costs, out_png)
            print(f"timeline written to {out_png}")
        except TimelineUnavailable as e:
            print(f"tessera plan: {e}", file=sys.stderr)
    return 0
