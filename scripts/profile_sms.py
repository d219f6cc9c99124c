"""Profile every reference model's kernels at several SM counts of one GPU
(the what-if model's validation data; GPU only).

For each model at real layer shapes and ``--layers`` layers (bf16): its
decode and prefill buckets as ``tessera advise`` plans them (decode 64
sequences with a 2048-token cache - VLM 32 -, prefill one 1024-token
request - Mamba2 a 16-token one, its prefill being an unrolled loop -, DiT
denoise 16), captured as aten kernel graphs (the kernels advise's graphs
hold) and timed kernel by kernel (``tessera_actors.execution.profile``: each kernel a
CUDA graph of ``--reps`` launches on the device's stream) on partitions of
GPU 0 with ``--sms`` SMs each (default 8,16,32,64,132; CUDA green contexts,
``GreenContext.create(num_sms=N, device_id=0)``; the whole GPU for its full
SM count).  Writes, under ``$OUT/whatif_h200/`` (or ``--out``):
``MODEL-BUCKET.tgraph`` and ``MODEL-BUCKET.profile.json`` = {gpu, model,
bucket, sms: [...], times: {N: [seconds per kernel]}, step_s: {N: sum}},
plus ``run.json`` (torch, device, timings, errors).  A model that fails is
recorded and skipped; ``--budget-s`` stops starting new graphs in time.

    python scripts/profile_sms.py [--models llama,moe,mamba2,vlm,dit] [--sms 8,16,32,64,132]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUCKETS = {"llama": ("decode:64", "prefill:1:1024"), "moe": ("decode:64", "prefill:1:1024"),
           "mamba2": ("decode:64", "prefill:1:16"), "vlm": ("decode:32", "prefill:1:1024"),
           "dit": ("denoise:16",)}


def build(name: str, bucket: str, layers: int, device: str = "cuda"):
    import torch
    from tessera_actors import models
    from tessera_actors.capture.inductor_buckets import bucket_inputs, parse_bucket
    kind, batch, seq = parse_bucket(bucket)
    cache = 2048
    if name == "vlm":
        from tessera_actors.models.llama import LlamaConfig
        text = LlamaConfig.llama_2_7b(n_layers=layers, max_batch=max(batch, 1), max_seq=cache)
        model = models.get(name, "real", dtype=torch.bfloat16, seed=0, device=device, text=text, vis_layers=layers)
    elif name == "dit":
        model = models.get(name, "real", dtype=torch.bfloat16, seed=0, device=device, depth=layers)
    else:
        extra = {"max_batch": max(batch, 1)}
        if name != "mamba2":
            extra["max_seq"] = cache
        model = models.get(name, "real", dtype=torch.bfloat16, seed=0, device=device, n_layers=layers, **extra)
    if kind == "decode" and name != "mamba2":
        inputs = {k: v.to(device) for k, v in model.example_inputs(kind, batch=batch, seq=1, pos=cache - 2).items()}
    else:
        inputs = {k: v.to(device) for k, v in bucket_inputs(model, kind, batch, seq).items()}
    return model, inputs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(BUCKETS))
    # 64, not 66: the driver rounds a green context's SM count up to its
    # granularity (8 on Hopper), so 66 would run on 72 SMs while recorded as 66
    ap.add_argument("--sms", default="8,16,32,64,132")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no new graph after this many seconds")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "whatif_h200"))
    args = ap.parse_args()
    import torch
    from tessera_actors.execution.program import AtenProgram
    from tessera_actors.execution.backends import backend_for
    from tessera_actors.capture.aten import capture_module
    from tessera_actors.capture.inductor_buckets import bucket_name, parse_bucket
    from tessera_actors.execution.profile import profile_kernels
    from tessera_actors.provenance import provenance
    if not torch.cuda.is_available():
        print("profile_sms: needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    full = torch.cuda.get_device_properties(0).multi_processor_count
    counts = [int(s) for s in args.sms.split(",")]
    backends = {s: backend_for("cuda:0" if s >= full else f"cuda:0?sms={s}") for s in counts}
    run = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "sms_full": full,
           **provenance(), "graphs": {}, "errors": {}}
    for name in args.models.split(","):
        for bucket in BUCKETS[name]:
            tag = None
            if time.perf_counter() - t_start > args.budget_s:
                run["errors"][f"{name} {bucket}"] = "skipped: time budget"
                continue
            t0 = time.perf_counter()
            try:
                kind, batch, seq = parse_bucket(bucket)
                tag = f"{name}-{bucket_name(kind, batch, seq)}"
                model, inputs = build(name, bucket, args.layers)
                res = capture_module(model, inputs, meta={"model": name, "size": "real", "bucket": bucket,
                                                          "layers": args.layers, "dtype": "bfloat16"})
                del model
                res.graph.save(out / f"{tag}.tgraph")
                times = {}
                for s, be in backends.items():
                    times[str(min(s, full))] = profile_kernels(res.graph, res.values, inputs, be, reps=args.reps,
                                                               progress=False, program_cls=AtenProgram)
                doc = {"gpu": "H200" if "H200" in torch.cuda.get_device_name(0) else torch.cuda.get_device_name(0),
                       "model": name, "bucket": bucket, "layers": args.layers, "sms": sorted(int(k) for k in times),
                       "times": times, "step_s": {k: sum(v) for k, v in times.items()}, **provenance()}
                (out / f"{tag}.profile.json").write_text(json.dumps(doc))
                run["graphs"][tag] = {"kernels": len(res.graph.kernels), "seconds": time.perf_counter() - t0,
                                      "step_us": {k: v * 1e6 for k, v in doc["step_s"].items()}}
                print(f"{tag}: {len(res.graph.kernels)} kernels, " + ", ".join(
                    f"{k} SMs {v * 1e6:.0f} us" for k, v in doc["step_s"].items())
                    + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
                del res
            except Exception as e:  # record and go on with the next graph
                run["errors"][tag or f"{name} {bucket}"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
                print(f"{tag or name} {bucket}: FAILED {type(e).__name__}: {e}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            (out / "run.json").write_text(json.dumps(run, indent=1))
    run["total_s"] = time.perf_counter() - t_start
    (out / "run.json").write_text(json.dumps(run, indent=1))
    print(f"done in {run['total_s']:.0f} s; {len(run['graphs'])} graphs, {len(run['errors'])} errors -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
