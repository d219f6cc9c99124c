"""The paper check: ``tessera advise`` on the Tessera paper's three GPU pairs
x five models, predicted Tessera/PD, Tessera/AF and Tessera/RD beside the
paper's published means (Tessera/PD 1.51 mean, max 2.32; Tessera/AF 1.35
mean, max 1.69; no Tessera/RD mean published).

Writes ``paper_check.json`` and ``paper_check.md`` (the table, the per-model
terms behind each ratio: per-GPU decode/prefill step times, and Tessera's
plan) to ``benchmarks/results/paper_check/``.

    python benchmarks/bench_paper_check.py [--models llama,moe,mamba2,vlm,dit] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera_actors.planning.advise import buckets_of, evaluate, kernel_terms, load_graph, load_params  # noqa: E402
from tessera_actors.planning.whatif import predict  # noqa: E402
from tessera_actors.provenance import provenance  # noqa: E402

MODELS = ("llama", "moe", "mamba2", "vlm", "dit")      # the paper's five

PAIRS = (("A100", "L40S"), ("H100", "RTX-PRO-6000"), ("B200", "H100"))
PAPER = {"Tessera/PD": {"mean": 1.51, "max": 2.32}, "Tessera/AF": {"mean": 1.35, "max": 1.69},
         "Tessera/RD": {"mean": None, "max": None}}
BASE = {"Tessera/PD": "PD", "Tessera/AF": "AF", "Tessera/RD": "Request Distribution"}


def plot(rows: list[dict], path: Path) -> bool:
    """Grouped bars of the three ratios per pair and model, the paper's means dashed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(11, 3.6))
    labels = [f"{r['model']}\n{r['pair'].replace('RTX-PRO-6000', 'RTX6000')}" for r in rows]
    for i, (k, color) in enumerate(zip(BASE, ("#c33", "#36c", "#999"))):
        ax.bar([x + (i - 1) * 0.27 for x in range(len(rows))], [r["ratios"][k] or 0 for r in rows], 0.27,
               label=k, color=color)
        if PAPER[k]["mean"]:
            ax.axhline(PAPER[k]["mean"], color=color, ls="--", lw=1)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("Tessera / policy (predicted)")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "paper_check"))
    args = ap.parse_args()
    params = load_params()
    rows = []
    for pair in PAIRS:
        for model in args.models.split(","):
            t0 = time.perf_counter()
            res = evaluate(model, list(pair), params=params)
            pol = res["policies"]
            tess = pol.get("Tessera", {}).get("tokens_per_s")
            ratios = {k: (tess / pol[b]["tokens_per_s"] if tess and b in pol else None) for k, b in BASE.items()}
            best = max((v["tokens_per_s"] for p, v in pol.items() if p != "Tessera"), default=None)
            bound = res.get("bound", {}).get("tokens_per_s")
            ratios["Tessera/best baseline"] = tess / best if tess and best else None
            ratios["Tessera/bound"] = tess / bound if tess and bound else None
            ratios["RD/bound"] = pol["Request Distribution"]["tokens_per_s"] / bound \
                if bound and "Request Distribution" in pol else None
            terms = {ph: kernel_terms(g, predict(g, list(pair), params))
                     for ph, g in ((ph, load_graph(model, b)) for ph, b in buckets_of(model).items())}
            rows.append({"pair": "+".join(pair), "model": model, "ratios": ratios, "seconds": time.perf_counter() - t0,
                         "policies": pol, "bound": res.get("bound"), "terms": terms})
            print(f"{'+'.join(pair):<18} {model:<7} " + "  ".join(
                f"{k} {v:.2f}" if v else f"{k} -" for k, v in ratios.items()) + f"  ({rows[-1]['seconds']:.1f} s)",
                flush=True)
    summary = {}
    for k in list(BASE) + ["Tessera/best baseline", "Tessera/bound", "RD/bound"]:
        vals = [r["ratios"][k] for r in rows if r["ratios"][k]]
        summary[k] = {"mean": statistics.mean(vals) if vals else None, "max": max(vals) if vals else None,
                      "n": len(vals), "paper": PAPER.get(k, {"mean": None, "max": None})}
    lines = ["| pair | model | Tessera/PD | Tessera/AF | Tessera/RD | Tessera/best baseline | Tessera/bound | "
             "RD/bound | Tessera tokens/s (batch) | bound (batch) | Tessera plan |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        f = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
        t = r["policies"].get("Tessera", {})
        b = r["bound"] or {}
        q = r["ratios"]
        lines.append(f"| {r['pair']} | {r['model']} | {f(q['Tessera/PD'])} | {f(q['Tessera/AF'])} "
                     f"| {f(q['Tessera/RD'])} | {f(q['Tessera/best baseline'])} | {f(q['Tessera/bound'])} "
                     f"| {f(q['RD/bound'])} | {t.get('tokens_per_s', 0):.0f} ({t.get('batch', '-')}) "
                     f"| {b.get('tokens_per_s', 0):.0f} ({b.get('batch', '-')}) | {t.get('note', '')} |")
    lines += ["", "Terms (per phase: share of kernels faster on R by count / by their time on L; step ms on L / R; "
              "the largest kernel classes' ms on L / R):", "",
              "| pair | model | phase | R faster (count / time) | step ms L / R | top classes ms L / R |",
              "|---|---|---|---:|---:|---|"]
    for r in rows:
        for ph, tm in r["terms"].items():
            top = ", ".join(f"{c} {v[0] * 1e3:.1f}/{v[1] * 1e3:.1f}" for c, v in list(tm["by_class_s"].items())[:3])
            lines.append(f"| {r['pair']} | {r['model']} | {ph} | {tm['r_faster_count'] * 100:.0f}% / "
                         f"{tm['r_faster_time'] * 100:.0f}% | {tm['step_s'][0] * 1e3:.1f} / {tm['step_s'][1] * 1e3:.1f} "
                         f"| {top} |")
    lines += ["", "| ratio | predicted mean | predicted max | paper mean | paper max |", "|---|---:|---:|---:|---:|"]
    for k, v in summary.items():
        g = lambda x: f"{x:.2f}" if x else "-"  # noqa: E731
        lines.append(f"| {k} | {g(v['mean'])} | {g(v['max'])} | {g(v['paper']['mean'])} | {g(v['paper']['max'])} |")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paper_check.json").write_text(json.dumps({**provenance(), "rows": rows, "summary": summary}, indent=1))
    notes = out / "explanation.md"
    (out / "paper_check.md").write_text("# Paper check (predicted by tessera advise)\n\n" + text + "\n"
                                        + (f"\n{notes.read_text()}" if notes.exists() else ""))
    plot(rows, out / "paper_check.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
