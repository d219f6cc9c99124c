"""Planner benchmark: MILP solve times and gaps on synthetic layered graphs,
and the predicted throughput plan vs every baseline and the LP bound on each
committed graph fixture.

    python benchmarks/bench_plan.py [--quick] [--out benchmarks/results/plan.json]

Prints two tables and writes JSON (with ``git_commit`` and ``command``).
Synthetic graphs: transformer-like blocks (12 kernels each, repeated layers)
with random per-signature device cost ratios (``planning.synthetic``), on 2,
3 and 4 devices of different types and on 16 devices of two types (8 + 8,
identical within a type).  Targets (issue 29): 1,000 kernels x 4 devices
<= 2 s at <= 1% gap; 16 devices of two types <= 30 s at <= 2% gap; and
1,000 kernels x 2 devices <= 0.5 s (the paper's 0.43 s).  A target is met
when the whole planner call (``plan_s``) is within the time, not only the
solve.  ``solve_s``: the planner's solver work (relaxation, its
neighbourhood, branch and bound; ``solve_total_s``; on two devices three
pipeline depths are solved); ``plan_s``: the whole planner call (problem
build, solves, expansion to devices, simulation of its plan at every
micro-batch count it tries), the comparison with the baselines turned off;
``plan_cpu_s``: the CPU seconds of that call (this process's, all
threads), which the load of a shared box inflates less than ``plan_s``;
``gap``: the solver's, against its lower bound.  Every row has the load
average when it ran (the CPU box is shared: wall times scale with it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera_actors.graph import KernelGraph  # noqa: E402
from tessera_actors.planning.baselines import single_graph_baselines  # noqa: E402
from tessera_actors.planning.bound import placement_bound  # noqa: E402
from tessera_actors.planning.costs import CostTable, costs_path_for  # noqa: E402
from tessera_actors.planning.planner import MilpPlanner, PlannerConfig  # noqa: E402
from tessera_actors.planning.synthetic import random_costs, transformer_graph  # noqa: E402
from tessera_actors.provenance import provenance  # noqa: E402

TARGETS = {(1000, 2): (0.5, None), (1000, 4): (2.0, 0.01), (1000, 16): (30.0, 0.02)}


def devices(n: int) -> tuple[list[str], list[str] | None]:
    """Device specs and type labels: up to 4 devices of different types, 16
    as 8 full GPUs + 8 of 66 SMs."""
    if n == 16:
        return [f"cuda:{i}" for i in range(8)] + [f"cuda:{i}?sms=66" for i in range(8, 16)], ["L"] * 8 + ["R"] * 8
    return ["cuda:0"] + [f"cuda:{i}?sms={[32, 66, 16][i % 3]}" for i in range(1, n)], None


def solve_row(kernels: int, ndev: int, seed: int) -> dict:
    g = transformer_graph(max(1, (kernels - 2) // 12))
    devs, types = devices(ndev)
    costs = random_costs(g, devs, seed=seed, types=types)
    row = {"kernels": len(g.kernels), "devices": ndev, "device_types": len(set(types or devs))}
    for mode in ("throughput", "latency"):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = MilpPlanner(costs, PlannerConfig(fallback=False)).plan(g, devs, mode)
        sol = plan.meta["solver"]
        row[mode] = {"solve_s": sol["solve_total_s"], "plan_s": time.perf_counter() - t0,
                     "plan_cpu_s": time.process_time() - c0, "gap": sol["mip_gap"],
                     "status": sol["status"], "classes": sol["classes"], "objective_s": sol["objective_s"],
                     "bound_s": sol["bound_s"], "throughput": plan.meta["predicted"]["throughput"],
                     "step_s": plan.predicted_step_s}
    base = {b.name: b.throughput for b in single_graph_baselines(g, devs, costs)}
    row["baselines"] = base
    row["vs_best_baseline"] = row["throughput"]["throughput"] / max(v for v in base.values() if v)
    row["target"] = TARGETS.get((kernels, ndev))
    return row


def fixture_rows(pattern: str = "tests/data/graphs/*.tgraph") -> list[dict]:
    rows = []
    for path in sorted(ROOT.glob(pattern)):
        g = KernelGraph.load(path)
        devs = ["cuda:0", "cuda:1?sms=32"]
        cpath = costs_path_for(path)
        costs = CostTable.load(cpath) if cpath.exists() else CostTable.estimate(g, devs)
        devs = costs.devices
        plan = MilpPlanner(costs).plan(g, devs, "throughput")
        rows.append({"graph": path.name, "kernels": len(g.kernels), "devices": devs, "costs": costs.source,
                     "tessera": plan.meta["predicted"]["throughput"], "source": plan.meta["source"],
                     "bound": placement_bound([(g, costs, 1.0)]).throughput,
                     "baselines": {b.name: b.throughput for b in single_graph_baselines(g, devs, costs)}})
    return rows


def verdict(r: dict) -> str:
    if r["target"] is None:
        return ""
    limit, gap = r["target"]
    t = r["throughput"]
    ok = t["plan_s"] <= limit and (gap is None or t["gap"] <= gap)
    return ("ok" if ok else "MISSED") + f" <={limit}s" + (f" <={gap * 100:g}%" if gap else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the 16-device case")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/plan.json"))
    args = ap.parse_args()
    cases = [(k, d) for k in (100, 500, 1000) for d in (2, 3, 4)] + ([] if args.quick else [(1000, 16)])
    rows = []
    print(f"{'kernels':>7} {'dev':>3} {'types':>5} | {'thr MILP':>8} {'plan':>6} {'cpu':>6} {'gap':>6} {'cls':>4} "
          f"{'x best base':>11} | {'lat MILP':>8} {'gap':>6} | {'load':>4} | target")
    for i, (k, d) in enumerate(cases):
        r = solve_row(k, d, seed=i)
        r["verdict"] = verdict(r)
        r["load_avg_1m"] = os.getloadavg()[0]        # the box is shared: times scale with its load
        rows.append(r)
        t, lat = r["throughput"], r["latency"]
        print(f"{r['kernels']:>7} {d:>3} {r['device_types']:>5} | {t['solve_s']:>7.2f}s {t['plan_s']:>5.2f}s "
              f"{t['plan_cpu_s']:>5.2f}s {t['gap'] * 100:>5.2f}% {t['classes']:>4} {r['vs_best_baseline']:>11.3f} | "
              f"{lat['solve_s']:>7.2f}s "
              f"{lat['gap'] * 100:>5.2f}% | {r['load_avg_1m']:>4.1f} | {r['verdict']}", flush=True)
    fixtures = fixture_rows()
    if fixtures:
        print("\npredicted throughput (steps/s) on graph fixtures: the throughput plan vs the LP bound and the baselines")
        for f in fixtures:
            cells = "  ".join(f"{n}={v:.1f} ({f['tessera'] / v:.3f}x)" if v else f"{n}=n/a"
                              for n, v in f["baselines"].items())
            print(f"{f['graph']} [{f['kernels']} kernels, {f['costs']}]: plan={f['tessera']:.1f} ({f['source']}, "
                  f"{f['tessera'] / f['bound']:.3f} of bound {f['bound']:.1f})  {cells}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**provenance(), "synthetic": rows, "fixtures": fixtures}, indent=1))
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
