"""Capture the graphs ``tessera advise`` plans, once, on the meta device.

Every reference model at real size and full depth, bf16: its decode bucket
(64 sequences, 2048-token KV cache; VLM 32: its
multi-head KV cache is 4x Llama-3's) and prefill bucket (one 1024-token
request; VLM adds its 576 image tokens; Mamba2 has none: its reference
prefill is a static unroll of one-token steps, advise costs a chunked scan), DiT's denoise bucket (16 latents).  Meta tensors carry shapes only,
so this takes seconds and no memory; the graphs are written msgpack +
gzip to ``tessera_actors/advise_data/`` (a few hundred kB in all).

    python scripts/capture_advise_graphs.py [--models llama,moe,...]
"""
from __future__ import annotations

import argparse
import gzip
import sys
import time
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUCKETS = {"llama": ("decode:64", "prefill:1:1024"), "moe": ("decode:64", "prefill:1:1024"),
           "mamba2": ("decode:64",), "vlm": ("decode:32", "prefill:1:1024"),
           "dit": ("denoise:16",)}


def main() -> int:
    from tessera_actors.capture.aten import capture_module
    from tessera_actors.capture.inductor_buckets import bucket_name, parse_bucket
    from tessera_actors.capture.cli import build_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(BUCKETS))
    ap.add_argument("--out", default=str(ROOT / "tessera_actors" / "advise_data"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        for bucket in BUCKETS[name]:
            t0 = time.perf_counter()
            kind, batch, seq = parse_bucket(bucket)
            extra = {"max_seq": 2048} if kind == "decode" and name != "mamba2" else {}
            if name == "vlm":   # its config passes cache sizes on to the text decoder
                extra = {"max_batch": batch, "max_seq": 2048}
            model, inputs, _ = build_model(name, "real", bucket, "bfloat16", "meta", **extra)
            res = capture_module(model, inputs, meta={"model": name, "size": "real", "bucket": bucket,
                                                      "dtype": "bfloat16", "device": "meta"})
            path = out / f"{name}-{bucket_name(kind, batch, seq)}.tgraph.gz"
            path.write_bytes(gzip.compress(msgpack.packb(res.graph.to_dict(), use_bin_type=True), 9))
            g = res.graph
            print(f"{name} {bucket}: {len(g.kernels)} kernels, "
                  + ", ".join(f"{r} {b / 2**30:.2f} GiB" for r, b in g.buffers_by_role().items() if b)
                  + f"; {path.stat().st_size / 1024:.0f} kB in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
