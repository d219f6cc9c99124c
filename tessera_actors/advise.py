"""``tessera advise``: which GPUs to rent for a model, predicted without them.

For a reference model at real size and a pair of GPU types it predicts
output tokens/s and tokens per dollar of every policy - Homo-L, Homo-R,
Request Distribution, PD, AF and Tessera (the product's MILP planner and
mixes) - on costs from the what-if model (:mod:`.planning.whatif`, fitted on
measured H200 profiles) and simulated links (:mod:`.planning.specs`).

Graphs: each model's decode and prefill buckets (DiT: its denoise bucket)
captured once, at full depth, on the *meta* device (Mamba2: decode only; its
prefill is costed as prompt / batch decode steps, as a chunked scan runs) (shapes only, no weights:
``scripts/capture_advise_graphs.py``), committed gzip-compressed under
``tessera_actors/advise_data/``.

Workload (the served arena's, ``tessera bench arena``): conversation, 1024-
token prompts and 128 output tokens per request, decode at a batch of 64
sequences with a 2048-token KV cache; a batch of requests costs its prefills
plus 128 decode steps (``workload``).  PD prefills on one GPU and decodes on
the other, the prompt's KV cache crossing the link; AF decodes with
attention on one GPU and the rest on the other (prefill on the better one).
Tessera prefills by its latency plan or one replica per GPU, and decodes
with its best mix.  DiT: one request is an image of 50 denoising steps at a
batch of 16; its "tokens" are the 256 latent patch tokens of an image; PD
and AF do not apply (nor AF to the SSM), as in the paper.
"""
from __future__ import annotations

import gzip
import json
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import PlanError, build_plan
from tessera_actors.planning.specs import SPECS, get_spec

DATA = Path(__file__).with_name("advise_data")
PARAMS_FILE = Path(__file__).parent / "planning" / "whatif_params.json"
MODELS = ("llama", "moe", "mamba2", "vlm", "dit")
POLICIES = ("Homo-L", "Homo-R", "Request Distribution", "PD", "AF", "Tessera")


@dataclass(frozen=True)
class Workload:
    prompt: int = 1024
    out_tokens: int = 128
    batch: int = 64
    cache: int = 2048
    denoise_steps: int = 50
    image_tokens: int = 256


WORKLOADS = {"conversation": Workload()}


def graph_path(model: str, bucket: str, data: str | Path | None = None) -> Path:
    return Path(data or DATA) / f"{model}-{bucket}.tgraph.gz"


def buckets_of(model: str) -> dict[str, str]:
    if model == "dit":
        return {"denoise": "denoise-b16"}
    if model == "mamba2":
        return {"decode": "decode-b64"}
    return {"decode": "decode-b32" if model == "vlm" else "decode-b64", "prefill": "prefill-b1-t1024"}


@lru_cache(maxsize=16)
def load_graph(model: str, bucket: str, data: str | None = None) -> KernelGraph:
    """A committed graph (``data``: another directory of ``MODEL-BUCKET.tgraph.gz``)."""
    import msgpack
    path = graph_path(model, bucket, data)
    if not path.exists():
        raise FileNotFoundError(f"no committed graph {path} (run scripts/capture_advise_graphs.py)")
    return KernelGraph.from_dict(msgpack.unpackb(gzip.decompress(path.read_bytes()), raw=False,
                                                 strict_map_key=False))


def load_params(path: Path | None = None):
    """The fitted cost-model terms (``planning/whatif_params.json``)."""
    from tessera_actors.planning.whatif import Params
    p = Path(path or PARAMS_FILE)
    if not p.exists():
        raise FileNotFoundError(f"no fitted what-if parameters at {p} (run benchmarks/bench_whatif.py --write-params)")
    return Params.from_dict(json.loads(p.read_text())["params"])


def _homo_step(graph: KernelGraph, costs, d: int) -> float | None:
    """Step seconds of the whole graph on device ``d``; None when it does not fit."""
    from tessera_actors.planning.planner import fits
    plan = build_plan(graph, costs.devices, [d] * len(graph.kernels), name=f"homo[{costs.devices[d]}]")
    if any(fits(graph, plan, costs)):
        return None
    return costs.device_total(d)


def _offload_plans(graph: KernelGraph, costs, scales: Sequence[float] = (0.75, 1.5)) -> list:
    """Kernel-level throughput plans solved with one device's times scaled
    (as :func:`.planning.mix.offload_family`, fewer and with short solves so a
    pair is advised in seconds)."""
    from tessera_actors.planning.costs import CostTable
    from tessera_actors.planning.planner import MilpPlanner, PlannerConfig
    plans, seen = [], set()
    for d in range(costs.ndev):
        for a in scales:
            times = [[t * a if j == d else t for j, t in enumerate(row)] for row in costs.times]
            scaled = CostTable(list(costs.devices), times, costs.latency, costs.bandwidth, list(costs.mem), costs.source)
            try:
                p = MilpPlanner(scaled, PlannerConfig(fallback=False, max_inflight=2, time_limit_s=1.0)).plan(
                    graph, costs.devices, "throughput")
            except PlanError:
                continue
            if len(set(p.assignment)) > 1 and tuple(p.assignment) not in seen:
                seen.add(tuple(p.assignment))
                p.name = f"offload[{costs.devices[d]} x{a:g}]"
                plans.append(p)
    return plans


def _tessera_step(graph: KernelGraph, costs, extra_plans: Sequence = ()) -> tuple[float, str]:
    """Seconds per graph execution of Tessera's best plan or mix (throughput)."""
    from tessera_actors.planning.mix import best_mix
    from tessera_actors.planning.planner import MilpPlanner, PlannerConfig
    thr = MilpPlanner(costs, PlannerConfig(max_inflight=4, time_limit_s=1.0)).plan(graph, costs.devices, "throughput")
    best, label = 1.0 / thr.meta["predicted"]["throughput"], f"{thr.meta['source']} plan x{thr.microbatches}"
    try:
        extra = list(extra_plans) + _offload_plans(graph, costs)
        mix = best_mix(graph, costs.devices, costs, thr, max_slots=4, family=False, extra=extra)
        if mix.throughput > 0 and 1.0 / mix.throughput < best:
            best, label = 1.0 / mix.throughput, f"mix {mix.label}"
    except PlanError:
        pass
    return best, label


def evaluate(model: str, gpus: Sequence[str], workload: Workload | None = None, params=None,
             data: str | None = None) -> dict[str, Any]:
    """Predicted tokens/s, tokens/$ and notes of every applicable policy on
    the pair ``gpus`` (two names from :data:`.planning.specs.SPECS`; the same
    name twice is a homogeneous pair)."""
    from tessera_actors.planning.baselines import af_plan, layer_split_plan
    from tessera_actors.planning.whatif import predict
    wl = workload or Workload()
    if len(gpus) != 2:
        raise ValueError("--gpus takes two GPU types: L,R")
    specs = [get_spec(g) for g in gpus]
    params = params or load_params()
    price = [s.price_per_h for s in specs]
    out: dict[str, dict[str, Any]] = {}

    def add(policy: str, tokens_per_s: float | None, price_h: float, note: str = "") -> None:
        if tokens_per_s is None or not tokens_per_s > 0:
            return
        out[policy] = {"tokens_per_s": float(tokens_per_s),
                       "tokens_per_dollar": float(tokens_per_s * 3600 / price_h), "price_per_h": price_h,
                       "note": note}

    if model == "dit":
        g = load_graph(model, buckets_of(model)["denoise"], data)
        c = predict(g, [s.name for s in specs], params)
        per_img = wl.denoise_steps / wl.image_tokens        # graph executions per token
        batch = _batch_of(g, 16)
        steps = [_homo_step(g, c, d) for d in (0, 1)]
        rate = [batch / (t * per_img) if t else None for t in steps]
        add("Homo-L", rate[0], price[0], f"{steps[0] * 1e3:.2f} ms/step" if steps[0] else "")
        add("Homo-R", rate[1], price[1], f"{steps[1] * 1e3:.2f} ms/step" if steps[1] else "")
        add("Request Distribution", sum(r for r in rate if r) or None, sum(price), "a replica per GPU")
        t, label = _tessera_step(g, c)
        add("Tessera", batch / (t * per_img), sum(price), label)
        return {"model": model, "gpus": list(gpus), "policies": out, "unit": "latent tokens",
                "terms": {"denoise": kernel_terms(g, c)}}
    gd = load_graph(model, buckets_of(model)["decode"], data)
    cd = predict(gd, [s.name for s in specs], params)
    ssm = model == "mamba2"
    # Mamba2: the reference model's prefill is a static unroll of one-token
    # steps; a real SSM prefills with a chunked scan, parallel over the
    # prompt like a batch, so a prompt costs prompt / batch decode steps
    gp, cp = (gd, cd) if ssm else (load_graph(model, buckets_of(model)["prefill"], data), None)
    cp = cp or predict(gp, [s.name for s in specs], params)
    B, T = _batch_of(gd, wl.batch), wl.out_tokens

    def workload(prefill_s: float, decode_s: float) -> float:
        return B * T / (B * prefill_s + T * decode_s)
    rep = wl.prompt / B if ssm else 1
    pre = [t * rep if t else None for t in (_homo_step(gp, cp, d) for d in (0, 1))]
    dec = [_homo_step(gd, cd, d) for d in (0, 1)]
    homo = [workload(p, q) if p and q else None for p, q in zip(pre, dec)]
    for d, name in ((0, "Homo-L"), (1, "Homo-R")):
        add(name, homo[d], price[d], f"prefill {pre[d] * 1e3:.1f} ms, decode {dec[d] * 1e3:.2f} ms/step"
            if homo[d] else "")
    add("Request Distribution", sum(h for h in homo if h) or None, sum(price), "a replica per GPU")
    # the request's state crosses the link: its prompt's KV cache (per-token
    # bytes from the decode graph's batch x cache), or an SSM's fixed state
    dec_state = sum(b.nbytes for b in gd.buffers.values() if b.role == "state")
    if ssm:
        kv = dec_state / B
    else:
        kv = dec_state / (B * wl.cache) * (wl.prompt + (576 if model == "vlm" else 0))
    best_pd, pd_note = 0.0, ""
    for a, b in ((0, 1), (1, 0)):
        if pre[a] and dec[b]:
            kv_s = cp.comm_s(a, b, kv)
            r = min(1 / (pre[a] + kv_s), B / (T * dec[b])) * T
            if r > best_pd:
                best_pd, pd_note = r, f"prefill on {gpus[a]}, decode on {gpus[b]}, KV {kv / 2**20:.0f} MiB/request"
    add("PD", best_pd, sum(price), pd_note)
    extra = []
    best_single_pre = min(p for p in pre if p) if any(pre) else None
    if model != "mamba2":
        af = af_plan(gd, cd.devices, cd)
        extra.append(af)
        if best_single_pre:
            add("AF", workload(best_single_pre, 1 / af.meta["predicted"]["throughput"]), sum(price),
                f"attention on {af.meta.get('attention_device')}, 2 micro-batches")
    try:
        extra.append(layer_split_plan(gd, cd.devices, cd, max_inflight=4))
    except PlanError:
        pass
    dstep, dlabel = _tessera_step(gd, cd, extra)
    from tessera_actors.planning.planner import MilpPlanner, PlannerConfig
    lat = MilpPlanner(cp, PlannerConfig(time_limit_s=1.0)).plan(gp, cp.devices, "latency").predicted_step_s * rep
    both = sum(1 / p for p in pre if p)
    tess = workload(lat, dstep)
    if both:
        tess = max(tess, B * T / (B / both + T * dstep))
    add("Tessera", tess, sum(price), f"decode {dstep * 1e3:.2f} ms/step ({dlabel}); prefill {lat * 1e3:.1f} ms")
    terms = {"decode": kernel_terms(gd, cd)}
    if not ssm:
        terms["prefill"] = kernel_terms(gp, cp)
    return {"model": model, "gpus": list(gpus), "policies": out, "unit": "output tokens", "terms": terms}


def kernel_terms(graph: KernelGraph, costs) -> dict[str, Any]:
    """What the ratios come from: share of kernels (by count, and by their
    time on L) faster on R, and each device's step seconds by kernel class."""
    from tessera_actors.planning.whatif import graph_features
    feats = graph_features(graph)
    r_wins = [row[1] < row[0] for row in costs.times]
    tl = sum(row[0] for row in costs.times) or 1.0
    by: dict[str, list[float]] = {}
    for f, row in zip(feats, costs.times):
        acc = by.setdefault(f.cls, [0.0, 0.0])
        acc[0] += row[0]
        acc[1] += row[1]
    return {"kernels": len(feats), "r_faster_count": sum(r_wins) / max(len(feats), 1),
            "r_faster_time": sum(row[0] for row, w in zip(costs.times, r_wins) if w) / tl,
            "step_s": [costs.device_total(0), costs.device_total(1)],
            "by_class_s": {c: v for c, v in sorted(by.items(), key=lambda kv: -kv[1][0])}}


def _batch_of(graph: KernelGraph, default: int) -> int:
    m = str(graph.meta.get("bucket", ""))
    try:
        return int(m.split(":")[1])
    except (IndexError, ValueError):
        return default


def recommend(model: str, gpus: Sequence[str], budget: float, workload: Workload | None = None,
              params=None, pair: dict | None = None, data: str | None = None) -> dict[str, Any] | None:
    """The GPU mix (one of a type, two of a type, or the pair; at most two
    GPUs) and policy with the most tokens per dollar whose price fits ``budget``
    $/hour; ties go to more tokens/s.  ``replicas``: how many copies of that
    mix the budget rents (tokens per dollar is unchanged by replication)."""
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
    lines = [f"model {res['model']} on {res['gpus'][0]} (L) + {res['gpus'][1]} (R), {res['unit']}/s predicted "
             f"(what-if costs, simulated links)",
             f"{'policy':<22}{'tokens/s':>12}{'tokens/$':>12}{'$/h':>7}  note"]
    tess = res["policies"].get("Tessera", {}).get("tokens_per_s")
    for pol in POLICIES:
        v = res["policies"].get(pol)
        if v is None:
            lines.append(f"{pol:<22}{'-':>12}{'-':>12}{'':>7}  does not apply or does not fit")
            continue
        lines.append(f"{pol:<22}{v['tokens_per_s']:>12,.0f}{v['tokens_per_dollar']:>12,.0f}{v['price_per_h']:>7.2f}"
                     f"  {v['note']}" + (f"  (Tessera x{tess / v['tokens_per_s']:.2f})" if tess and pol != "Tessera" else ""))
    return "\n".join(lines)


def describe(model: str, workload: Workload, data: str | None = None) -> str:
    """What was predicted: the model's size and the workload, one line each."""
    kind, bucket = next(iter(buckets_of(model).items()))
    g = load_graph(model, bucket, data)
    weights = g.summary()["bytes_by_role"].get("weight", 0)
    what = (f"model {model}: {g.meta.get('size', '?')} size, {g.meta.get('dtype', '?')}, "
            f"{weights / 1e9:.1f} GB of weights")
    if model == "dit":
        work = (f"workload: images of {workload.denoise_steps} denoising steps at a batch of 16, "
                f"{workload.image_tokens} latent tokens each")
    else:
        work = (f"workload: {workload.prompt}-token prompts, {workload.out_tokens} output tokens per request, "
                f"decode at a batch of {workload.batch} with a {workload.cache}-token KV cache")
    return f"{what}\n{work}"


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
    p.add_argument("--gpus", required=True, help=f"two GPU types L,R from: {', '.join(SPECS)}")
    p.add_argument("--workload", default="conversation", choices=sorted(WORKLOADS))
    p.add_argument("--budget", type=float, default=None, help="$/hour: recommend the mix with the most tokens/$")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--png", default=None, help="write a bar chart of the comparison")
    p.add_argument("--data", default=None, help="directory of MODEL-BUCKET.tgraph.gz graphs (default: the committed ones)")


def main(args) -> int:
    t0 = time.perf_counter()
    gpus = [g.strip() for g in args.gpus.split(",")]
    try:
        gpus = [get_spec(g).name for g in gpus]
        if len(gpus) != 2:
            raise ValueError("--gpus takes two GPU types: L,R")
        res = evaluate(args.model, gpus, WORKLOADS[args.workload], data=args.data)
        rec = recommend(args.model, gpus, args.budget, WORKLOADS[args.workload], pair=res, data=args.data) \
            if args.budget is not None else None
    except (ValueError, FileNotFoundError, PlanError) as e:
        print(f"tessera advise: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"model": res["model"], "gpus": res["gpus"],
               "policies": {p: {"tokens_per_s": v["tokens_per_s"], "tokens_per_dollar": v["tokens_per_dollar"]}
                            for p, v in res["policies"].items()}}
        if args.budget is not None:
            doc["recommendation"] = rec
        print(json.dumps(doc))
    else:
        print(describe(args.model, WORKLOADS[args.workload], args.data))
        print(format_table(res))
        if args.budget is not None:
            if rec is None:
                print(f"budget ${args.budget:.2f}/h: no mix of {', '.join(gpus)} fits")
            else:
                print(f"budget ${args.budget:.2f}/h: rent {rec['mix']} with {rec['policy']} "
                      f"({rec['tokens_per_dollar']:,.0f} tokens/$, {rec['tokens_per_s']:,.0f} tokens/s at "
                      f"${rec['price_per_h']:.2f}/h; {rec['replicas']} cop{'y' if rec['replicas'] == 1 else 'ies'} "
                      f"fit the budget: {rec['total_tokens_per_s']:.0f} tokens/s)")
        print(f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.png and plot(res, args.png):
        print(f"chart written to {args.png}", file=sys.stderr)
    return 0


__all__ = ["MODELS", "POLICIES", "WORKLOADS", "Workload", "evaluate", "load_graph", "load_params", "main",
           "recommend"]
