"""Validate the what-if cost model where we can measure: leave one SM count out.

Reads per-kernel profiles of graphs at several SM counts of one GPU (the
output of ``scripts/profile_sms.py``: ``MODEL-BUCKET.tgraph`` +
``MODEL-BUCKET.profile.json`` per graph; or cost tables
``*.costs.json`` whose devices are ``cuda:i[?sms=N]`` partitions of an H200,
like the arena's).  For every SM count it fits the model on all the other
counts and predicts the held-out one; per graph it reports the per-kernel
median and p90 relative error |predicted / measured - 1| and the whole-step
error (sum of predicted over sum of measured kernel times, minus one), for
the roofline alone and with the per-kernel corrections.  ``--synthetic``
makes profiles from the committed advise graphs with known parameters and
noise instead (a check of the fit itself).  ``--write-params`` also fits on
every profile and writes ``tessera_actors/planning/whatif_params.json``,
which ``tessera advise`` uses (also fitted to the whole-step times of the
arena's aten graphs in ``benchmarks/results/whatif/arena_aten/``, unless
``--no-steps``, and to DESIGN.md's H200 micro-benchmarks per SM count).

    python benchmarks/bench_whatif.py [--profiles DIR ...] [--out benchmarks/results/whatif]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera_actors.graph import KernelGraph  # noqa: E402
from tessera_actors.provenance import git_commit  # noqa: E402
from tessera_actors.planning import whatif as W  # noqa: E402

DEFAULT_DIRS = [ROOT / "benchmarks" / "results" / "whatif_h200", ROOT / "benchmarks" / "results" / "arena_h200x2_inductor"]


def _sms_of(device: str) -> int:
    from tessera_actors.devices import DeviceSpec
    s = DeviceSpec.parse(device)
    return s.sms or 132


def load_profiles(dirs) -> list[W.Profile]:
    """Profiles in ``dirs``: profile_sms.py output, else arena cost tables."""
    from tessera_actors.planning.costs import CostTable
    out: list[W.Profile] = []
    for d in map(Path, dirs):
        if not d.is_dir():
            continue
        found = sorted(d.glob("*.profile.json"))
        for pj in found:
            doc = json.loads(pj.read_text())
            g = KernelGraph.load(pj.with_name(pj.name.replace(".profile.json", ".tgraph")))
            for s, times in doc["times"].items():
                out.append(W.Profile(g, doc.get("gpu", "H200"), int(s), [float(t) for t in times],
                                     pj.name.replace(".profile.json", "")))
        if found:
            continue
        for cj in sorted(d.glob("*.costs.json")):
            g = KernelGraph.load(cj.with_name(cj.name.replace(".costs.json", ".tgraph")))
            c = CostTable.load(cj)
            for i, dev in enumerate(c.devices):
                out.append(W.Profile(g, "H200", _sms_of(dev), [row[i] for row in c.times],
                                     cj.name.replace(".costs.json", "")))
    return out


ARENA_ATEN = ROOT / "benchmarks" / "results" / "whatif" / "arena_aten"


def load_steps(d: Path = ARENA_ATEN) -> list[W.StepProfile]:
    """Whole-step measurements of aten graphs (``steps.json`` beside the graphs)."""
    import gzip
    import msgpack
    f = Path(d) / "steps.json"
    if not f.exists():
        return []
    graphs: dict[str, KernelGraph] = {}
    out = []
    for st in json.loads(f.read_text())["steps"]:
        if st["graph"] not in graphs:
            raw = gzip.decompress((Path(d) / st["graph"]).read_bytes())
            graphs[st["graph"]] = KernelGraph.from_dict(msgpack.unpackb(raw, raw=False, strict_map_key=False))
        out.append(W.StepProfile(graphs[st["graph"]], st["gpu"], int(st["sms"]), float(st["step_s"]), st["graph"]))
    return out


# DESIGN.md, "Heterogeneous hardware here": measured on one H200 per green-context SM count:
# bf16 GEMM 8192^3 (TFLOP/s), copy bandwidth (TB/s, read + write), 8x8192x8192 GEMV (us)
DESIGN_H200 = {132: (789, 4.19, 34), 66: (485, 3.75, 37), 32: (220, 2.25, 52), 16: (111, 1.23, 99), 8: (56, 0.65, 194)}


def design_profiles() -> list[W.Profile]:
    """The DESIGN.md micro-benchmarks as one-kernel profiles (aten mm, copy, GEMV)."""
    from tessera_actors.graph import Access, Buffer, Kernel

    def ref(b, shape):
        return {"t": [b, 0, list(shape), [], "bfloat16"]}

    def mm_graph(m, k, n):
        bufs = {0: Buffer(0, m * k * 2, "input"), 1: Buffer(1, k * n * 2, "weight"), 2: Buffer(2, m * n * 2, "output")}
        kern = Kernel(0, "mm", "library", (Access(0, 0, m * k * 2), Access(1, 0, k * n * 2), Access(2, 0, m * n * 2, "w")),
                      flops=2.0 * m * n * k, signature=f"design-mm-{m}x{k}x{n}",
                      payload={"op": "aten.mm.default", "args": [ref(0, (m, k)), ref(1, (k, n))], "outs": [{"ref": ref(2, (m, n))}]})
        return KernelGraph([kern], bufs, meta={"model": "design"})
    size = 1 << 30
    copy = KernelGraph([Kernel(0, "copy_", "library", (Access(0, 0, size), Access(1, 0, size, "w")), flops=0.0,
                               signature="design-copy-1GiB",
                               payload={"op": "aten.copy_.default", "args": [ref(1, (size // 2,)), ref(0, (size // 2,))],
                                        "outs": [{"ref": ref(1, (size // 2,))}]})],
                       {0: Buffer(0, size, "input"), 1: Buffer(1, size, "output")}, meta={"model": "design"})
    gemm, gemv = mm_graph(8192, 8192, 8192), mm_graph(8, 8192, 8192)
    out = []
    for sms, (tf, tbs, us) in DESIGN_H200.items():
        out.append(W.Profile(gemm, "H200", sms, [2.0 * 8192 ** 3 / (tf * 1e12)], "design-gemm"))
        out.append(W.Profile(copy, "H200", sms, [2.0 * size / (tbs * 1e12)], "design-copy"))
        out.append(W.Profile(gemv, "H200", sms, [us * 1e-6], "design-gemv"))
    return out


def synthetic_profiles(truth: W.Params, sms=(8, 16, 32, 66, 132), noise: float = 0.05, bias: float = 0.3,
                       seed: int = 0, models=("llama", "dit")) -> list[W.Profile]:
    """Profiles generated by the model itself with ``truth``, a per-kernel
    systematic factor (log-normal, ``bias``: what the roofline cannot know about
    one kernel, the same at every SM count) and log-normal noise per measurement."""
    from tessera_actors.planning.advise import buckets_of, load_graph
    rng = random.Random(seed)
    spec = W.get_spec("H200")
    out = []
    for m in models:
        for b in buckets_of(m).values():
            g = load_graph(m, b)
            feats = W.graph_features(g)
            factor = {}
            for f in feats:
                factor.setdefault(f.key, math.exp(rng.gauss(0, bias)))
            for s in sms:
                out.append(W.Profile(g, "H200", s, [W.roofline_time(f, spec, s, truth) * factor[f.key]
                                                    * math.exp(rng.gauss(0, noise)) for f in feats], f"{m}-{b}"))
    return out


def errors(profile: W.Profile, params: W.Params, corrected: bool) -> dict[str, float]:
    spec = W.get_spec(profile.gpu)
    pred = np.array([W.kernel_time(f, spec, profile.sms, params, corrected) for f in W.graph_features(profile.graph)])
    meas = np.array(profile.times)
    ok = meas > 0
    rel = np.abs(pred[ok] / meas[ok] - 1)
    return {"median": float(np.median(rel)), "p90": float(np.quantile(rel, 0.9)),
            "step": float(pred[ok].sum() / meas[ok].sum() - 1), "kernels": int(ok.sum())}


def leave_one_out(profiles: list[W.Profile]) -> list[dict]:
    rows = []
    counts = sorted({p.sms for p in profiles})
    for held in counts:
        train = [p for p in profiles if p.sms != held]
        if not train:
            continue
        t0 = time.perf_counter()
        params = W.fit(train)
        fit_s = time.perf_counter() - t0
        for p in profiles:
            if p.sms == held:
                rows.append({"graph": p.tag, "held_out_sms": held, "fit_s": fit_s,
                             "roofline": errors(p, params, False), "corrected": errors(p, params, True)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| graph | held-out SMs | kernels | median (roofline) | p90 (roofline) | step (roofline) "
             "| median (corrected) | p90 (corrected) | step (corrected) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        a, b = r["roofline"], r["corrected"]
        lines.append(f"| {r['graph']} | {r['held_out_sms']} | {a['kernels']} | {a['median'] * 100:.1f}% | "
                     f"{a['p90'] * 100:.1f}% | {a['step'] * 100:+.1f}% | {b['median'] * 100:.1f}% | "
                     f"{b['p90'] * 100:.1f}% | {b['step'] * 100:+.1f}% |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", nargs="*", default=None, help="directories of profiles")
    ap.add_argument("--synthetic", action="store_true", help="profiles made by the model with known parameters")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "whatif"))
    ap.add_argument("--write-params", action="store_true", help="fit on every profile and write whatif_params.json")
    ap.add_argument("--no-steps", action="store_true",
                    help="--write-params without the arena's whole-step aten measurements (benchmarks/results/whatif/arena_aten)")
    args = ap.parse_args()
    if args.synthetic:
        truth = W.Params(bw_sm=35e9, power=0.1, l2_gain=2.5, wave_s=0.4e-6)
        profiles, source = synthetic_profiles(truth), "synthetic"
    else:
        dirs = args.profiles or [str(d) for d in DEFAULT_DIRS]
        profiles = load_profiles(dirs)
        source = ", ".join(sorted({str(Path(d).relative_to(ROOT)) if Path(d).is_absolute() and ROOT in Path(d).parents
                                   else d for d in dirs if Path(d).is_dir()}))
        if not profiles:
            print(f"bench_whatif: no profiles in {dirs}", file=sys.stderr)
            return 2
    print(f"{len(profiles)} profiles ({source}); SM counts {sorted({p.sms for p in profiles})}", file=sys.stderr)
    rows = leave_one_out(profiles)
    text = table(rows)
    print(text)
    worst = {k: max(r["corrected"][k] if k != "step" else abs(r["corrected"]["step"]) for r in rows)
             for k in ("median", "step")} if rows else {}
    print(f"worst corrected: median {worst.get('median', 0) * 100:.1f}%, |step| {worst.get('step', 0) * 100:.1f}% "
          f"(acceptance: <= 15% and <= 10%)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "bench_whatif_synthetic" if args.synthetic else (
        f"bench_whatif_{Path(args.profiles[0]).name}" if args.profiles else "bench_whatif")
    doc = {"git_commit": git_commit(), "command": " ".join(sys.argv), "source": source, "rows": rows, "worst": worst}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{name}.md").write_text(f"Leave-one-SM-count-out ({source})\n\n{text}\n")
    if args.write_params and not args.synthetic:
        steps = [] if args.no_steps else load_steps()
        design = design_profiles()
        # each micro-benchmark is one clean kernel: counted 5 times against the many kernels of the graphs
        params = W.fit(profiles + design * 5, steps=steps)
        checks = []
        for pr in design:
            pred = W.kernel_time(W.graph_features(pr.graph)[0], W.get_spec("H200"), pr.sms, params, corrected=False)
            checks.append({"what": pr.tag, "sms": pr.sms, "predicted_s": pred, "measured_s": pr.times[0]})
        for st in steps:
            pred = sum(W.kernel_time(f, W.get_spec(st.gpu), st.sms, params) for f in W.graph_features(st.graph))
            checks.append({"what": f"arena aten step {st.tag}", "sms": st.sms, "predicted_s": pred,
                           "measured_s": st.step_s})
        print("in-sample fit of the written parameters:")
        for c in checks:
            c["error"] = c["predicted_s"] / c["measured_s"] - 1
            print(f"  {c['what']:<38} {c['sms']:>4} SMs: predicted {c['predicted_s'] * 1e6:9.0f} us, measured "
                  f"{c['measured_s'] * 1e6:9.0f} us ({c['error'] * 100:+.1f}%)")
        (out / "fit_checks.json").write_text(json.dumps({"git_commit": git_commit(), "command": " ".join(sys.argv),
                                                         "checks": checks}, indent=1))
        from tessera_actors.planning.advise import PARAMS_FILE
        PARAMS_FILE.write_text(json.dumps({"commit": git_commit(), "source": source,
                                           "steps": [f"{st.tag}@{st.sms}" for st in steps],
                                           "profiles": sorted({f"{p.tag}@{p.sms}" for p in profiles}),
                                           "params": params.to_dict()}, indent=1))
        print(f"parameters written to {PARAMS_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
