#!/usr/bin/env python3
"""GPU acceptance run for the CUDA (inductor) capture. Run from the repo root:

    python3 scripts/gpu_capture_check.py --out OUT_DIR [--budget 400]

Parts (each guarded; a failing part is reported and the next one runs):

  capture   Llama-3.1-8B decode, batch 64, static cache 2048, bf16 random
            weights (``--llama-layers``, default 32): compile / record /
            total seconds (target: under 60 s) and graph size; the graph is
            saved to OUT_DIR/llama-3.1-8b-decode-b64.tgraph.
  llama     soundness of a full-width Llama decode graph (``--sound-layers``
            layers): TritonProgram replay in program order and in
            ``--orders`` random topological orders vs the compiled model
            (bitwise, max abs diff, cosine) + greedy tokens over ``--steps``.
  moe       the same for the GPT-oss-20B-like MoE (``--moe-layers``).

Prints a table and writes OUT_DIR/gpu_capture_check.json. Never hangs: a
watchdog writes what it has and exits (code 3) when ``--budget`` seconds
have passed; parts that would start too late are skipped.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPORT: dict = {"parts": {}}
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def write_report(out_dir: str) -> str:
    path = os.path.join(out_dir, "gpu_capture_check.json")
    REPORT["elapsed_s"] = round(elapsed(), 1)
    from tessera_actors.provenance import provenance
    REPORT.update(provenance())
    with open(path, "w") as fh:
        json.dump(REPORT, fh, indent=1, default=str)
    return path


def watchdog(budget: float, out_dir: str) -> None:
    def fire() -> None:
        REPORT["watchdog"] = f"budget of {budget:.0f} s exhausted; exiting"
        print(f"\n!! watchdog: {REPORT['watchdog']}", flush=True)
        try:
            write_report(out_dir)
            print_table()
        finally:
            os._exit(3)
    t = threading.Timer(budget, fire)
    t.daemon = True
    t.start()


def DTYPE(args):
    import torch
    return getattr(torch, args.dtype)


def free_cuda() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build(name: str, layers: int, batch: int, max_seq: int, dtype, args):
    import torch
    from tessera_actors import models
    t = time.perf_counter()
    model = models.get(name, args.size, dtype=dtype, seed=0, device=args.device, n_layers=layers,
                       max_batch=batch, max_seq=max_seq)
    inputs = model.example_inputs("decode", batch=batch, pos=min(16, max_seq - 1))
    if args.device == "cuda":
        torch.cuda.synchronize()
    return model, inputs, round(time.perf_counter() - t, 1)


def capture_fns(args):
    """(compile, capture): inductor on CUDA; on ``--device cpu`` (testing this
    script only) the eager model and the aten capture."""
    if args.device == "cuda":
        from tessera_actors.capture.inductor import capture_inductor, compile_model
        return compile_model, capture_inductor
    from tessera_actors.capture.aten import capture_module

    def capture(model, inputs, meta=None, progress=None, compiled=None, regions=None):
        res = capture_module(model, inputs, meta=meta)
        res.graph.meta["capture_times"] = {"total_s": 0.0}
        return res
    return (lambda m, regions=None: m), capture


def graph_facts(graph, path: str | None = None) -> dict:
    from tessera_actors.capture.cli import summarize
    s = summarize(graph)
    facts = {k: s[k] for k in ("kernels", "kernels_by_kind", "buffers", "edges", "edges_total", "indirect",
                               "indirect_kernels", "pinned", "disagreements", "bytes_by_role")}
    facts["distinct_triton_kernels"] = len(graph.meta.get("triton_kernels", {}))
    facts["capture_times"] = graph.meta.get("capture_times")
    facts["regions"] = graph.meta.get("regions")
    facts["compiled_graphs"] = graph.meta.get("compiled_graphs")
    if path:
        facts["file"], facts["file_mib"] = path, round(os.path.getsize(path) / 2**20, 2)
    return facts


def part_capture(args) -> dict:
    import torch
    _, capture_inductor = capture_fns(args)
    model, inputs, build_s = build("llama", args.llama_layers, args.batch, args.max_seq, DTYPE(args), args)
    mem0 = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
    res = capture_inductor(model, inputs, meta={"model": "llama-3.1-8b", "bucket": "decode-b64",
                                                "layers": args.llama_layers, "max_seq": 2048},
                           regions=args.regions, progress=lambda p: print(f"   [capture] {p} ({elapsed():.0f} s)", flush=True))
    names = [k.name for k in res.graph.kernels]
    path = os.path.join(args.out, "llama-3.1-8b-decode-b64.tgraph")
    t = time.perf_counter()
    edges = len(res.graph.edges)
    edges_s = time.perf_counter() - t
    res.graph.save(path)
    out = {"layers": args.llama_layers, "build_s": build_s, "edges_s": round(edges_s, 2), "edges": edges,
           "peak_gib_before_capture": round(mem0, 1),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if args.device == "cuda" else 0.0,
           **graph_facts(res.graph, path)}
    out["capture_s"] = out["capture_times"]["total_s"] if out.get("capture_times") else None
    del res
    free_cuda()
    if args.warm_repeat and elapsed() + 1.5 * (out["capture_s"] or 0) < args.budget - args.min_part:
        # the same capture again: dynamo re-traces, inductor's on-disk caches (FX graph, Triton) hit
        print(f"   [capture] repeating with warm compile caches ({elapsed():.0f} s)", flush=True)
        res = capture_inductor(model, inputs, meta={"model": "llama-3.1-8b", "bucket": "decode-b64"},
                               regions=args.regions)
        out["capture_warm_times"] = res.graph.meta.get("capture_times")
        out["capture_warm_s"] = (out["capture_warm_times"] or {}).get("total_s")
        out["warm_graph_same_kernels"] = [k.name for k in res.graph.kernels] == names
        del res
    best = min(x for x in (out["capture_s"], out.get("capture_warm_s")) if x is not None)
    out["target_met"] = best < 60
    del model, inputs
    return out


def part_sound(args, name: str, layers: int) -> dict:
    from tessera_actors.check.inductor import greedy_tokens, soundness
    compile_model, capture_inductor = capture_fns(args)
    model, inputs, build_s = build(name, layers, args.batch, args.max_seq, DTYPE(args), args)
    compiled = compile_model(model, regions=args.regions)
    res = capture_inductor(model, inputs, meta={"model": name, "layers": layers}, compiled=compiled,
                           progress=lambda p: print(f"   [{name}] {p} ({elapsed():.0f} s)", flush=True))
    out = {"layers": layers, "batch": args.batch, "max_seq": args.max_seq, "build_s": build_s,
           **graph_facts(res.graph)}
    out["capture_s"] = (out.get("capture_times") or {}).get("total_s")
    print(f"   [{name}] replaying {args.orders} random orders ({elapsed():.0f} s)", flush=True)
    out["soundness"] = soundness(res, inputs, orders=args.orders, seed=1,
                                 deadline=T0 + args.budget - 30, device=args.device)
    print(f"   [{name}] greedy tokens ({elapsed():.0f} s)", flush=True)
    try:
        out["tokens"] = greedy_tokens(model, compiled, res, inputs, steps=args.steps, device=args.device)
    except Exception as e:
        out["tokens"] = {"error": f"{type(e).__name__}: {e}"}
    del model, inputs, res, compiled
    return out


def part_xproc(args) -> dict:
    """Replay a saved graph in a fresh process (kernels re-imported from the
    generated module files, pinned to the captured configs)."""
    import subprocess
    import torch
    from tessera_actors import models
    _, capture = capture_fns(args)
    m = models.get("llama", "tiny", dtype=DTYPE(args), seed=0, device=args.device)
    inputs = m.example_inputs("decode", batch=4, pos=3)
    res = capture(m, inputs, meta={"model": "llama-tiny"})
    base = os.path.join(args.out, "xproc")
    res.graph.save(base + ".tgraph")
    torch.save({"values": {k: v.cpu() for k, v in res.values.items()},
                "inputs": {k: v.cpu() for k, v in inputs.items()},
                "outputs": [t.cpu() for t in res.outputs]}, base + ".pt")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", args.out, "--device", args.device,
                           "--replay-child", base], capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    out = json.loads(lines[-1]) if lines else {"error": (proc.stderr or proc.stdout)[-2000:]}
    out["returncode"] = proc.returncode
    out["kernels_by_kind"] = {"ptx": out.get("ptx", 0), "library": out.get("kernels", 0) - out.get("ptx", 0)}
    return out


def replay_child(base: str, device: str) -> int:
    import torch
    from tessera_actors.capture.aten import CaptureResult
    from tessera_actors.check.inductor import compare, new_program, replay
    from tessera_actors.graph import KernelGraph
    g = KernelGraph.load(base + ".tgraph")
    saved = torch.load(base + ".pt")
    res = CaptureResult(g, saved["values"], saved["outputs"])
    inputs = {k: v.to(device) for k, v in saved["inputs"].items()}
    got = replay(new_program(res, device), res, inputs, range(len(g.kernels)))
    c = compare([t.cpu() for t in got], saved["outputs"])
    print(json.dumps({"kernels": len(g.kernels), "ptx": sum(k.kind == "ptx" for k in g.kernels), **c}), flush=True)
    return 0 if c["equal"] else 1


def run_part(name: str, fn, args, *a) -> None:
    if elapsed() > args.budget - args.min_part:
        REPORT["parts"][name] = {"status": "skipped", "reason": f"only {args.budget - elapsed():.0f} s of budget left"}
        return
    print(f"== {name} ({elapsed():.0f} s)", flush=True)
    t = time.perf_counter()
    try:
        REPORT["parts"][name] = {"status": "ok", **fn(args, *a)}
    except Exception as e:
        REPORT["parts"][name] = {"status": "error", "error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc()[-3000:]}
        print(f"!! {name} failed: {type(e).__name__}: {e}", flush=True)
    REPORT["parts"][name]["seconds"] = round(time.perf_counter() - t, 1)
    try:
        free_cuda()
    except Exception:
        pass
    write_report(args.out)


def print_table() -> None:
    print("\n| part | status | layers | kernels (ptx/lib) | edges | indirect | pinned | time | result |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, p in REPORT["parts"].items():
        kk = p.get("kernels_by_kind", {})
        res = ""
        if name == "capture" and p.get("status") == "ok":
            t = p.get("capture_times") or {}
            res = (f"capture {p.get('capture_s')} s cold (compile {t.get('compile_s')}, record {t.get('record_s')}), "
                   f"{p.get('capture_warm_s')} s with warm caches, file {p.get('file_mib')} MiB, "
                   f"target<60s {'met' if p.get('target_met') else 'MISSED'}")
        elif p.get("soundness"):
            s, tok = p["soundness"], p.get("tokens", {})
            res = (f"program order equal={s['program_order']['equal']} "
                   f"maxabs={s['program_order']['max_abs']:.3g} cos={s['program_order']['cosine']:.6f}; "
                   f"{s['orders']} orders, {s['mismatches']} mismatches, worst maxabs={s['worst_max_abs']:.3g}; "
                   f"tokens identical={tok.get('identical')}")
        elif name == "xproc" and p.get("status") == "ok":
            res = (f"replay in a fresh process: equal={p.get('equal')} maxabs={p.get('max_abs')} "
                   f"rc={p.get('returncode')} {p.get('error', '')[-200:]}")
        elif p.get("status") != "ok":
            res = p.get("error") or p.get("reason", "")
        print(f"| {name} | {p.get('status')} | {p.get('layers', '')} | {p.get('kernels', '')} "
              f"({kk.get('ptx', 0)}/{kk.get('library', 0)}) | {p.get('edges_total', '')} | {p.get('indirect', '')} | "
              f"{len(p.get('pinned', []) or [])} | {p.get('seconds', '')} s | {res} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=400.0, help="global time budget in seconds")
    ap.add_argument("--parts", default="capture,llama,moe,xproc")
    ap.add_argument("--llama-layers", type=int, default=32)
    ap.add_argument("--sound-layers", type=int, default=32, help="Llama layers for the soundness part")
    ap.add_argument("--moe-layers", type=int, default=24)
    ap.add_argument("--regions", default="auto", choices=("auto", "whole", "blocks"),
                    help="compile the repeated blocks once (auto/blocks) or the whole model as one graph")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--orders", type=int, default=20)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--no-warm-repeat", dest="warm_repeat", action="store_false",
                    help="skip the second capture with warm compile caches")
    ap.add_argument("--min-part", type=float, default=45.0, help="do not start a part with less time left")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--size", default="real", help="model size (tiny only to test this script)")
    ap.add_argument("--device", default="cuda", help="cpu: test this script with the aten capture")
    ap.add_argument("--verbose", action="store_true", help="log every hooked kernel (tessera.* loggers)")
    ap.add_argument("--replay-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.replay_child:
        return replay_child(args.replay_child, args.device)
    if args.verbose:
        import logging
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("tessera").setLevel(logging.INFO)
    watchdog(args.budget, args.out)
    import torch
    REPORT["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import triton
        REPORT["env"]["triton"] = triton.__version__
    except Exception as e:
        REPORT["env"]["triton"] = f"unavailable: {e}"
    print(f"env: {REPORT['env']}", flush=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to check", flush=True)
        write_report(args.out)
        return 2
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if "capture" in parts:
        run_part("capture", part_capture, args)
    if "llama" in parts:
        run_part("llama", part_sound, args, "llama", args.sound_layers)
    if "moe" in parts:
        run_part("moe", part_sound, args, "moe", args.moe_layers)
    if "xproc" in parts:
        run_part("xproc", part_xproc, args)
    print_table()
    print(f"\nreport: {write_report(args.out)}")
    ok = all(p.get("status") == "ok" for p in REPORT["parts"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
