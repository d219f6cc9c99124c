"""``tessera advise``: which GPUs to rent for a model, predicted without them.

For a reference model at real size (:mod:`.reference`) and a group of GPU
types (``A100,L40S``; ``8xB200,8xH100``) it predicts output tokens/s and
tokens per dollar of every policy, each at its best decode batch within
memory (:mod:`.policies`), beside the placement bound (:mod:`.bound`), on
costs from the what-if model (:mod:`.whatif`, fitted on measured H200
profiles) and simulated links (:mod:`.specs`).  ``--budget`` recommends the
rental (one GPU, two of a type, or the pair) with the most tokens per dollar.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Sequence

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import PlanError
from tessera_actors.planning.policies import POLICIES, evaluate, parse_gpus
from tessera_actors.planning.reference import (DATA, MODELS, PARAMS_FILE, WORKLOADS, Workload, buckets_of, graph_path, load_graph,
                        load_params)
from tessera_actors.planning.specs import SPECS


def kernel_terms(graph: KernelGraph, costs) -> dict[str, Any]:
    """What the ratios come from: share of kernels (by count, and by their
    time on L) faster on R, and each device's step seconds by kernel class."""
    from tessera_actors.planning.whatif import graph_features
    feats = graph_features(graph)
    r_wins = [row[-1] < row[0] for row in costs.times]
    tl = sum(row[0] for row in costs.times) or 1.0
    by: dict[str, list[float]] = {}
    for f, row in zip(feats, costs.times):
        acc = by.setdefault(f.cls, [0.0, 0.0])
        acc[0] += row[0]
        acc[1] += row[-1]
    return {"kernels": len(feats), "r_faster_count": sum(r_wins) / max(len(feats), 1),
            "r_faster_time": sum(row[0] for row, w in zip(costs.times, r_wins) if w) / tl,
            "step_s": [costs.device_total(0), costs.device_total(costs.ndev - 1)],
            "by_class_s": {c: v for c, v in sorted(by.items(), key=lambda kv: -kv[1][0])}}


def recommend(model: str, gpus: Sequence[str], budget: float, workload: Workload | None = None,
              params=None, pair: dict | None = None, data: str | None = None) -> dict[str, Any] | None:
    """The GPU mix (one of a type, two of a type, or the pair; at most two
    GPUs) and policy with the most tokens per dollar whose price fits ``budget``
    $/hour; ties go to more tokens/s.  ``replicas``: how many copies of that
    mix the budget rents (tokens per dollar is unchanged by replication)."""
    if len(gpus) != 2:
        raise ValueError("--budget recommends among two GPU types: give --gpus L,R without counts")
    params = params or load_params()
    cands: list[tuple[str, list[str], str, dict]] = []
    pair = pair or evaluate(model, gpus, workload, params, data)
    for pol, v in pair["policies"].items():
        used = {"Homo-L": [gpus[0]], "Homo-R": [gpus[1]]}.get(pol, list(gpus))
        cands.append((f"{' + '.join(used)}", used, pol, v))
    # two GPUs of one type: a replica each (kernels of one type never disagree
    # about the device, so a kernel-level split has nothing to gain there)
    for pol, g in (("Homo-L", gpus[0]), ("Homo-R", gpus[1])):
        v = pair["policies"].get(pol)
        if v is not None and gpus[0] != gpus[1]:
            cands.append((f"2x {g}", [g, g], "Request Distribution",
                          {**v, "tokens_per_s": 2 * v["tokens_per_s"], "price_per_h": 2 * v["price_per_h"]}))
    ok = [c for c in cands if c[3]["price_per_h"] <= budget + 1e-9]
    if not ok:
        return None
    name, used, pol, v = max(ok, key=lambda c: (round(c[3]["tokens_per_dollar"], 6), c[3]["tokens_per_s"]))
    reps = int(budget // v["price_per_h"])
    return {"gpus": used, "mix": name, "policy": pol, "tokens_per_s": v["tokens_per_s"],
            "tokens_per_dollar": v["tokens_per_dollar"], "price_per_h": v["price_per_h"], "replicas": reps,
            "total_tokens_per_s": v["tokens_per_s"] * reps, "budget_per_h": budget}


def format_table(res: dict[str, Any]) -> str:
    """The policies, each at its batch, with Tessera's ratio to each and every
    policy's share of the bound."""
    kinds = list(dict.fromkeys(res["gpus"]))
    group = " + ".join(f"{res['gpus'].count(k)}x {k}" for k in kinds)
    lines = [f"model {res['model']} on {group} (L = {kinds[0]}, R = {kinds[-1]}), {res['unit']}/s predicted "
             f"(what-if costs, simulated links)",
             f"{'policy':<22}{'tokens/s':>12}{'tokens/$':>12}{'$/h':>8}{'batch':>7}{'/bound':>8}  note"]
    tess = res["policies"].get("Tessera", {}).get("tokens_per_s")
    bound = res.get("bound", {}).get("tokens_per_s")
    for pol in POLICIES:
        v = res["policies"].get(pol)
        if v is None:
            lines.append(f"{pol:<22}{'-':>12}{'-':>12}{'':>8}{'':>7}{'':>8}  does not apply or does not fit")
            continue
        share = f"{v['tokens_per_s'] / bound:.2f}" if bound else "-"
        lines.append(f"{pol:<22}{v['tokens_per_s']:>12.0f}{v['tokens_per_dollar']:>12.4g}{v['price_per_h']:>8.2f}"
                     f"{v['batch']:>7}{share:>8}  {v['note']}"
                     + (f"  (Tessera x{tess / v['tokens_per_s']:.2f})" if tess and pol != "Tessera" else ""))
    if bound:
        lines.append(f"{'bound (LP relaxation)':<22}{bound:>12.0f}{'':>12}{'':>8}{res['bound']['batch']:>7}"
                     f"{1.0:>8.2f}  any placement, fractional kernel split, at equal memory")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pols = [p for p in POLICIES if p in res["policies"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for ax, key, label in ((axes[0], "tokens_per_s", f"{res['unit']}/s"), (axes[1], "tokens_per_dollar", "tokens/$")):
        ax.barh(pols, [res["policies"][p][key] for p in pols], color=["#888"] * (len(pols) - 1) + ["#c33"])
        ax.set_xlabel(label)
        ax.invert_yaxis()
    fig.suptitle(f"{res['model']} on {' + '.join(res['gpus'])} (predicted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def add_arguments(p) -> None:
    p.add_argument("--model", default="llama", choices=MODELS)
    p.add_argument("--gpus", required=True,
                   help=f"two GPU types L,R (with counts: 8xB200,8xH100) from: {', '.join(SPECS)}")
    p.add_argument("--workload", default="conversation", choices=sorted(WORKLOADS),
                   help="what a request is: conversation = a 1024-token prompt, 128 output tokens, a 2048-token "
                        "KV cache (default: conversation)")
    p.add_argument("--budget", type=float, default=None, help="$/hour: recommend the mix with the most tokens/$")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--png", default=None, help="write a bar chart of the comparison")
    p.add_argument("--data", default=None, help="directory of MODEL-BUCKET.tgraph.gz graphs (default: the committed ones)")


def to_json(res: dict[str, Any], rec: dict | None, budget: float | None) -> dict[str, Any]:
    """``--json``: model, gpus, policies (tokens/s, tokens/$, batch), bound."""
    doc = {"model": res["model"], "gpus": res["gpus"],
           "policies": {p: {"tokens_per_s": v["tokens_per_s"], "tokens_per_dollar": v["tokens_per_dollar"],
                            "batch": v["batch"]} for p, v in res["policies"].items()},
           "bound": res.get("bound")}
    if budget is not None:
        doc["recommendation"] = rec
    return doc


def main(args) -> int:
    t0 = time.perf_counter()
    try:
        gpus = parse_gpus(args.gpus)
        res = evaluate(args.model, gpus, WORKLOADS[args.workload], data=args.data)
        rec = recommend(args.model, gpus, args.budget, WORKLOADS[args.workload], pair=res, data=args.data) \
            if args.budget is not None else None
    except (ValueError, FileNotFoundError, PlanError) as e:
        print(f"tessera advise: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(res, rec, args.budget)))
    else:
        print(format_table(res))
        if args.budget is not None:
            if rec is None:
                print(f"budget ${args.budget:.2f}/h: no mix of {', '.join(gpus)} fits")
            else:
                print(f"budget ${args.budget:.2f}/h: rent {rec['mix']} with {rec['policy']} "
                      f"({rec['tokens_per_dollar']:.4g} tokens/$, {rec['tokens_per_s']:.0f} tokens/s at "
                      f"${rec['price_per_h']:.2f}/h; {rec['replicas']} cop{'y' if rec['replicas'] == 1 else 'ies'} "
                      f"fit the budget: {rec['total_tokens_per_s']:.0f} tokens/s)")
        print(f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.png and plot(res, args.png):
        print(f"chart written to {args.png}", file=sys.stderr)
    return 0


__all__ = ["DATA", "MODELS", "PARAMS_FILE", "POLICIES", "WORKLOADS", "Workload", "buckets_of", "evaluate",
           "graph_path", "kernel_terms", "load_graph", "load_params", "main", "recommend", "to_json"]
