"""torch's CPU int4/int8 weight kernels against the dense matmul, by
activation dtype and rows (issue #33: which dtype quantized weights run in).

SmolLM2-135M's matrix shapes (576 -> 1536, 1536 -> 576, and the 49152-row
LM head), ``M`` activation rows (1: batch-1 decode; 16: a full decode
batch; 128 and 512: prompt chunks), on this machine's threads:

* ``dense``: ``x @ W.t()`` in the activations' dtype;
* ``int4``: ``aten._weight_int4pack_mm_for_cpu`` (groups of 32, the layers' Q4_1);
* ``int8``: ``aten._weight_int8pack_mm`` (a scale per row, the LM head's Q8_0).

The median of ``--reps`` timed calls after two warm-up calls, milliseconds.

    PYTHONPATH=. python benchmarks/bench_quant_kernels.py --out benchmarks/results/serve_cpu/quant_kernels.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tessera_actors.provenance import provenance

SHAPES = ((1536, 576), (576, 1536), (49152, 576))   # (out, in)


def _ms(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def row(n: int, k: int, m: int, dtype: torch.dtype, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    sz = (torch.rand(k // 32, n, 2, generator=gen) * 0.01).to(dtype)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = (torch.rand(n, generator=gen) * 0.01).to(dtype)
    return {"out": n, "in": k, "rows": m, "dtype": str(dtype).removeprefix("torch."),
            "dense_ms": _ms(lambda: x @ w.t(), reps),
            "int4_ms": _ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz), reps),
            "int8_ms": _ms(lambda: torch.ops.aten._weight_int8pack_mm(x, q8, scale), reps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,128,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--max-macs", type=float, default=2e9, help="skip a case above this many multiply-adds "
                                                                "(float32's int kernels take seconds there)")
    ap.add_argument("--out", default="benchmarks/results/serve_cpu/quant_kernels.json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    print(f"{'out x in':>12} {'rows':>5} {'dtype':>9} {'dense ms':>9} {'int4 ms':>9} {'int8 ms':>9}")
    for dt in a.dtypes.split(","):
        for n, k in SHAPES:
            for m in (int(r) for r in a.rows.split(",")):
                if n * k * m > a.max_macs:
                    continue
                r = row(n, k, m, getattr(torch, dt), a.reps)
                rows.append(r)
                print(f"{n:>6}x{k:<5} {m:>5} {r['dtype']:>9} {r['dense_ms']:9.3f} {r['int4_ms']:9.3f} "
                      f"{r['int8_ms']:9.3f}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance(), "threads": torch.get_num_threads(), "rows": rows},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
