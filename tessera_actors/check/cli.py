"""``tessera check``: the verdict of :func:`tessera_actors.check.check` for a
reference model or a transformers model (``--model hf:...``) at one bucket.
Exits 0 only when every comparison holds; ``--json`` also writes the rows."""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama", help="reference model (llama, moe, mamba2, vlm, dit, smollm2) or "
                   "hf:<dir | config.json | file.gguf | smollm2 | tiny-ARCH>")
    p.add_argument("--size", default="tiny", help="reference models: tiny | real")
    p.add_argument("--layers", type=int, default=None, help="hf models: keep the first N layers")
    p.add_argument("--bucket", default="prefill:1:8", help="decode:B | prefill:B:T | denoise:B")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--devices", default="cpu,cpu", help="comma-separated devices to split over")
    p.add_argument("--orders", type=int, default=20, help="random topological orders")
    p.add_argument("--splits", type=int, default=5, help="random legal splits")
    p.add_argument("--planner", default="milp", help="planner whose split is checked too (contiguous, milp)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report (rows, info, command line) to this file")


def main(args: argparse.Namespace) -> int:
    from tessera_actors.capture.errors import CaptureError
    from tessera_actors.capture.cli import build_model
    from tessera_actors.check import check
    extra = {"layers": args.layers} if args.model.startswith("hf:") and args.layers else {}
    try:
        model, inputs, _ = build_model(args.model, args.size, args.bucket, args.dtype, "cpu", **extra)
        report = check(model, inputs, devices=args.devices.split(","), orders=args.orders, splits=args.splits,
                       planner=args.planner, seed=args.seed)
    except CaptureError as e:
        print(f"tessera check: cannot capture {args.model}: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ok": report.ok, "rows": report.rows, "info": report.info, "command": sys.argv}, f,
                      indent=1, default=str)
    return 0 if report.ok else 1
