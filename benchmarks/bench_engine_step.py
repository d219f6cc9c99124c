"""The served decode step against torch.compile's, through the public AsyncEngine.

For one model and each ``--batch``, in one run:
  served  - the engine's decode step at that bucket (``batch`` rows over the
            whole ``--cache``-token KV cache) while it serves a saturating
            trace: ``batch`` requests at once, wall seconds per decode step
            from the moment every row decodes (``tessera_actors.bench.served``);
  compile - the same model and shapes under ``torch.compile(mode="reduce-overhead")``;
  floor   - bytes the step must move at the measured copy bandwidth, or its
            FLOPs at the measured GEMM rate, whichever is longer;
and the served output tokens/s, and the host microseconds per served step
(CPU seconds: the serving loop's own work, the event loop's whole thread,
the devices' workers outside runs of kernels, the host total - thread plus
workers, who share the interpreter lock - and the workers' wall time inside
runs of kernels).  Prints a table, writes one JSON row per case
(``model, layers, batch, window, capture, served_step_us, compile_step_us,
floor_us, served_tok_s`` plus ``git_commit`` and ``command``) to ``--json``.

  python benchmarks/bench_engine_step.py --model llama --layers 32 --batch 64,256 --cache 2048 \\
      --json benchmarks/results/served_gpu_h200/served.json          # one H200
  python benchmarks/bench_engine_step.py --model llama --size tiny --device cpu --dtype float32 \\
      --batch 4 --cache 256 --no-compile                                 # the CPU box: the engine alone
  python benchmarks/bench_engine_step.py --model llama --size tiny --layers 2 --device cpu --dtype float32 \\
      --batch 64 --cache 256 --no-compile                                # the CPU box: host work per step
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys

import torch

from tessera_actors.bench.roofline import (RooflineConfig, build, compiled_baseline, measured_bandwidth,
                                           measured_gemm_rate, step_bytes, step_flops)
from tessera_actors.bench.served import ServedCase, served_decode
from tessera_actors.provenance import provenance


def run_case(a, batch: int, bandwidth: float | None, gemm: float | None) -> dict:
    case = ServedCase(a.model, a.size, a.layers, a.dtype, a.device, batch, a.cache, regions=a.regions,
                      capture=a.capture, decode_tokens=a.tokens)
    served = asyncio.run(served_decode(case))
    graph = served.pop("graph")
    nbytes = step_bytes(graph)
    del graph
    row = {"model": a.model, "layers": a.layers, "batch": batch, "window": a.cache, "capture": served["capture"],
           "served_step_us": served["served_step_s"] * 1e6, "served_tok_s": served["served_tok_s"],
           "trace_tok_s": served["trace_tok_s"], "host_us": {k: v * 1e6 for k, v in served["host_s"].items()},
           "bucket_stats": served["bucket_stats"], "start_s": served["start_s"],
           "compile_step_us": None, "floor_us": None, "served_over_compile": None}
    if a.compile:
        cfg = RooflineConfig(layers=a.layers, batch=batch, cache=a.cache, dtype=a.dtype, device=a.device)
        make, _ = build(a.model, "decode", cfg, torch.device(a.device))
        import torch._dynamo as dynamo
        dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        model, inputs = make()
        flops = step_flops(model, inputs)
        row["compile_step_us"] = compiled_baseline(model, inputs, a.steps) * 1e6
        del model
        dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        row["floor_us"] = max(nbytes / bandwidth, flops / gemm) * 1e6
        row["served_over_compile"] = row["served_step_us"] / row["compile_step_us"]
    return row


def _host(h: dict) -> str:
    """Host microseconds per decode step: CPU of the serving loop, of the event
    loop's whole thread and of the workers outside kernels, their sum (the
    host work of a step), and the workers' wall time inside kernels."""
    cells = [h.get("loop"), h.get("loop_thread"), h.get("worker")]
    cells.append(h["loop_thread"] + h["worker"] if "loop_thread" in h and "worker" in h else None)
    cells.append(h.get("kernels"))
    return " ".join(f"{c:6.0f}" if c is not None else f"{'-':>6}" for c in cells)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama")
    ap.add_argument("--size", default="real")
    ap.add_argument("--layers", type=int, default=32, help="layers of the model (0: the model's own)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", default="64,256", help="comma-separated decode batches")
    ap.add_argument("--cache", type=int, default=2048, help="KV cache positions (every step reads them all)")
    ap.add_argument("--tokens", type=int, default=48, help="output tokens of each request of the trace")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of the compile baseline")
    ap.add_argument("--regions", default="auto", choices=["auto", "whole", "blocks"])
    ap.add_argument("--capture", default="auto", choices=["auto", "aten", "inductor"])
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile baseline")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    gpu = a.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        raise SystemExit(f"--device {a.device}: no CUDA device is visible (on CPU: --size tiny --device cpu "
                         "--dtype float32 --batch 4 --cache 256 --no-compile)")
    if a.compile and not gpu:
        raise SystemExit("the torch.compile baseline (reduce-overhead: CUDA graphs) needs a GPU; use --no-compile")
    bandwidth = measured_bandwidth(torch.device(a.device)) if a.compile else None
    gemm = measured_gemm_rate(torch.device(a.device), getattr(torch, a.dtype)) if a.compile else None
    rows = [run_case(a, int(b), bandwidth, gemm) for b in a.batch.split(",")]
    print(f"{'model':6} {'layers':>6} {'batch':>5} {'window':>6} {'capture':10} {'served us':>10} {'compile us':>10} "
          f"{'/compile':>8} {'floor us':>9} {'served tok/s':>12}  host us/step: {'loop':>6} {'thread':>6} "
          f"{'worker':>6} {'host':>6} {'kernels':>6}")
    for r in rows:
        comp = f"{r['compile_step_us']:10.0f} {r['served_over_compile']:8.3f} {r['floor_us']:9.0f}" \
            if r["compile_step_us"] else f"{'-':>10} {'-':>8} {'-':>9}"
        print(f"{r['model']:6} {r['layers']:6d} {r['batch']:5d} {r['window']:6d} {str(r['capture'])[:10]:10} "
              f"{r['served_step_us']:10.0f} {comp} {r['served_tok_s']:12.0f}  {_host(r['host_us'])}")
    doc = {**provenance(), "device": torch.cuda.get_device_name(a.device) if gpu else "cpu",
           "torch": torch.__version__, "bandwidth_Bps": bandwidth, "gemm_flops": gemm, "rows": rows}
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2, default=str)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
