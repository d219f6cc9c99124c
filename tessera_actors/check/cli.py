"""``tessera check``: the verdict of :func:`tessera_actors.check.check` for a
reference model or a transformers model (``--model hf:...``) at one bucket.
Exits 0 only when every comparison holds; ``--json`` also writes the rows."""
from __future__ import annotations

import argparse
import json
import sys


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
