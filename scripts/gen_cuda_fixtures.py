#!/usr/bin/env python3
"""Capture one CUDA kernel graph of each reference architecture (fixtures for CPU CI).

Run on the GPU machine from the repo root:

    python3 scripts/gen_cuda_fixtures.py --out tests/data/graphs

For each of llama, moe, mamba2, vlm, dit (small configs, bf16) the model is
compiled with inductor and recorded (``capture_inductor``), saved as
``OUT/<arch>-<bucket>.tgraph`` (each file kept under ``--max-mib``: the
generated sources, then the PTX texts, are dropped from a file that is too
big, and that is recorded in its meta), then checked on the GPU: program-order
replay through ``TritonProgram`` must equal the compiled model bitwise, and so
must ``--orders`` random topological orders. Prints a summary table, writes
``OUT/fixtures_summary.json``. ``--device cpu`` runs the same pipeline with the
aten capture (to test this script without a GPU). Each architecture is
guarded: a failure is reported and the next one runs; ``--budget`` seconds
bound the whole run (a watchdog exits with code 3).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARCHS = {"llama": "decode:8", "moe": "decode:8", "mamba2": "decode:8", "vlm": "prefill:1:16", "dit": "denoise:2"}


def save_bounded(graph, path: str, max_mib: float) -> list[str]:
    """Save; drop generated sources, then PTX texts, while the file is too big."""
    dropped = []
    graph.save(path)
    for key in ("triton_src", "ptx"):
        if os.path.getsize(path) <= max_mib * 2**20:
            break
        if graph.meta.get(key):
            graph.meta[key] = {}
            dropped.append(key)
            graph.meta["dropped"] = list(dropped)
            graph.save(path)
    return dropped


def one(arch: str, bucket: str, args) -> dict:
    import torch
    from tessera_actors.capture.aten import capture_module
    from tessera_actors.capture.inductor_buckets import bucket_name, parse_bucket
    from tessera_actors.check.inductor import soundness
    from tessera_actors.capture.cli import build_model, summarize
    t0 = time.perf_counter()
    model, inputs, (kind, batch, seq) = build_model(arch, args.size, bucket, args.dtype, args.device)
    name = bucket_name(*parse_bucket(bucket))
    meta = {"model": arch, "size": args.size, "bucket": name, "dtype": args.dtype, "device": args.device,
            "state_names": list(model.state_names()), "fixture": True}
    if args.device.startswith("cuda"):
        from tessera_actors.capture.inductor import capture_inductor
        res = capture_inductor(model, inputs, meta=meta)
    else:
        res = capture_module(model, inputs, meta=meta)
    capture_s = time.perf_counter() - t0
    path = os.path.join(args.out, f"{arch}-{name}.tgraph")
    dropped = save_bounded(res.graph, path, args.max_mib)
    s = summarize(res.graph)
    check = soundness(res, inputs, orders=args.orders, seed=7, device=args.device)
    from tessera_actors.capture.inductor_match import reanalyze
    again = reanalyze(res.graph)  # the CPU re-derivation must reproduce the capture exactly
    check["reanalysis_equal"] = [(k.accesses, k.indirect) for k in again.kernels] == \
        [(k.accesses, k.indirect) for k in res.graph.kernels]
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"arch": arch, "bucket": name, "file": path, "file_kib": round(os.path.getsize(path) / 1024, 1),
            "dropped": dropped, "capture_s": round(capture_s, 1), "kernels": s["kernels"],
            "ptx": s["kernels_by_kind"].get("ptx", 0), "library": s["kernels_by_kind"].get("library", 0),
            "buffers": s["buffers"], "edges": s["edges_total"], "edges_by_kind": s["edges"],
            "indirect": s["indirect"], "pinned": s["pinned"], "disagreements": s["disagreements"],
            "bytes_by_role": s["bytes_by_role"], "check": check}


def table(rows: list[dict]) -> str:
    head = ("| arch | bucket | kernels | ptx | lib | buffers | edges | indirect | pinned | weight/state/temp KiB "
            "| file KiB | capture s | replay equal | orders (mismatch) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arch']} | {r.get('bucket', '')} | ERROR: {r['error'][:120]} |")
            continue
        b = r["bytes_by_role"]
        c = r["check"]
        lines.append(f"| {r['arch']} | {r['bucket']} | {r['kernels']} | {r['ptx']} | {r['library']} | {r['buffers']} "
                     f"| {r['edges']} | {r['indirect']} | {len(r['pinned'])} | {b['weight'] // 1024}/{b['state'] // 1024}/"
                     f"{b['temp'] // 1024} | {r['file_kib']} | {r['capture_s']} | {c['program_order']['equal']} "
                     f"| {c['orders']} ({c['mismatches']}) |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--orders", type=int, default=20)
    ap.add_argument("--max-mib", type=float, default=1.9)
    ap.add_argument("--budget", type=float, default=500.0)
    ap.add_argument("--verbose", action="store_true", help="log every hooked kernel (tessera.* loggers)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.verbose:
        import logging
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("tessera").setLevel(logging.INFO)
    rows: list[dict] = []
    summary_path = os.path.join(args.out, "fixtures_summary.json")

    def dump(extra: dict | None = None) -> None:
        with open(summary_path, "w") as fh:
            json.dump({"rows": rows, **(extra or {})}, fh, indent=1, default=str)

    def fire() -> None:
        print(f"\n!! watchdog: budget {args.budget:.0f} s exhausted", flush=True)
        dump({"watchdog": True})
        print(table(rows), flush=True)
        os._exit(3)
    timer = threading.Timer(args.budget, fire)
    timer.daemon = True
    timer.start()
    import torch
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device {args.device}", flush=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA GPU visible; use --device cpu to test this script", flush=True)
        return 2
    t0 = time.perf_counter()
    for arch in [a.strip() for a in args.archs.split(",") if a.strip()]:
        bucket = ARCHS.get(arch, "decode:8")
        print(f"== {arch} {bucket} ({time.perf_counter() - t0:.0f} s)", flush=True)
        try:
            rows.append(one(arch, bucket, args))
            r = rows[-1]
            print(f"   {r['kernels']} kernels ({r['ptx']} ptx), {r['edges']} edges, pinned {r['pinned']}, "
                  f"reanalysis equal {r['check']['reanalysis_equal']}, "
                  f"replay equal {r['check']['program_order']['equal']}, "
                  f"{r['check']['mismatches']}/{r['check']['orders']} order mismatches", flush=True)
        except Exception as e:
            rows.append({"arch": arch, "bucket": bucket, "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-3000:]})
            print(f"!! {arch} failed: {type(e).__name__}: {e}", flush=True)
        dump()
    print(table(rows))
    print(f"total {time.perf_counter() - t0:.0f} s; summary {summary_path}")
    ok = all("error" not in r and r["check"]["program_order"]["equal"] and r["check"]["mismatches"] == 0
             and r["check"]["reanalysis_equal"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
