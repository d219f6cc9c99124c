"""Planner benchmark: MILP solve times on synthetic layered graphs, and the
predicted throughput plan vs every baseline on each committed graph fixture.

    python benchmarks/bench_plan.py [--quick] [--out benchmarks/results/plan.json]

Prints two tables and writes JSON.  Synthetic graphs: transformer-like blocks
(12 kernels each, repeated layers) with random per-signature device cost
ratios (planning.synthetic).  Targets (issue 5): 1000 kernels x 2 devices
< 0.5 s, 1000 x 4 < 5 s, 16 devices < 60 s.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera_actors.graph import KernelGraph  # noqa: E402
from tessera_actors.planning.baselines import single_graph_baselines  # noqa: E402
from tessera_actors.planning.costs import CostTable, costs_path_for  # noqa: E402
from tessera_actors.planning.planner import MilpPlanner  # noqa: E402
from tessera_actors.planning.mix import best_mix  # noqa: E402
from tessera_actors.planning.synthetic import random_costs, transformer_graph  # noqa: E402

TARGETS = {(1000, 2): 0.5, (1000, 4): 5.0, (1000, 16): 60.0}


def devices(n: int) -> list[str]:
    return ["cuda:0"] + [f"cuda:{i}?sms={[32, 66, 16][i % 3]}" for i in range(1, n)]


def solve_row(kernels: int, ndev: int, seed: int) -> dict:
    layers = max(1, (kernels - 2) // 12)
    g = transformer_graph(layers)
    devs = devices(ndev)
    costs = random_costs(g, devs, seed=seed)
    row = {"kernels": len(g.kernels), "devices": ndev}
    for mode in ("throughput", "latency"):
        t0 = time.perf_counter()
        plan = MilpPlanner(costs).plan(g, devs, mode)
        total = time.perf_counter() - t0
        sol = plan.meta["solver"]
        row[mode] = {"solve_s": sol["solve_s"], "plan_s": total, "gap": sol["mip_gap"], "status": sol["status"],
                     "classes": sol["classes"], "source": plan.meta["source"],
                     "throughput": plan.meta["predicted"]["throughput"], "step_s": plan.predicted_step_s}
    base = {b.name: b.throughput for b in single_graph_baselines(g, devs, costs)}
    row["baselines"] = base
    best = max(v for v in base.values() if v)
    row["vs_best_baseline"] = row["throughput"]["throughput"] / best
    row["target_s"] = TARGETS.get((kernels, ndev))
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
        thr = plan.meta["predicted"]["throughput"]
        mix = best_mix(g, devs, costs, plan)
        rows.append({"graph": path.name, "kernels": len(g.kernels), "devices": devs, "costs": costs.source,
                     "tessera": thr, "source": plan.meta["source"], "mix": mix.throughput, "mix_label": mix.label,
                     "baselines": {b.name: b.throughput for b in single_graph_baselines(g, devs, costs)}})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the 16-device case")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/plan.json"))
    args = ap.parse_args()
    cases = [(k, d) for k in (100, 500, 1000) for d in (2, 3, 4)] + ([] if args.quick else [(1000, 16)])
    rows = []
    print(f"{'kernels':>7} {'dev':>3} | {'thr solve':>9} {'plan':>6} {'gap':>6} {'cls':>4} {'source':>12} "
          f"{'x best base':>11} | {'lat solve':>9} {'gap':>6} | target")
    for i, (k, d) in enumerate(cases):
        r = solve_row(k, d, seed=i)
        rows.append(r)
        t, lat = r["throughput"], r["latency"]
        ok = "" if r["target_s"] is None else ("ok" if t["solve_s"] < r["target_s"] else "MISSED") + f" <{r['target_s']}s"
        print(f"{r['kernels']:>7} {d:>3} | {t['solve_s']:>8.2f}s {t['plan_s']:>5.1f}s {t['gap'] * 100:>5.2f}% "
              f"{t['classes']:>4} {t['source']:>12} {r['vs_best_baseline']:>11.3f} | {lat['solve_s']:>8.2f}s "
              f"{lat['gap'] * 100:>5.2f}% | {ok}", flush=True)
    fixtures = fixture_rows()
    if fixtures:
        print("\npredicted throughput (steps/s) on graph fixtures: tessera (best of the throughput plan and "
              "its mixes with replicas) vs baselines")
        for f in fixtures:
            best = max(f["tessera"], f["mix"])
            cells = "  ".join(f"{n}={v:.1f} ({best / v:.3f}x)" if v else f"{n}=n/a"
                              for n, v in f["baselines"].items())
            print(f"{f['graph']} [{f['kernels']} kernels, {f['costs']}]: plan={f['tessera']:.1f} ({f['source']})  "
                  f"mix={f['mix']:.1f} ({f['mix_label']})  {cells}")
    else:
        print("\nno graph fixtures under tests/data/graphs/ yet")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"host": platform.node(), "python": platform.python_version(),
                                          "synthetic": rows, "fixtures": fixtures}, indent=1))
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
