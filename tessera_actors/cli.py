"""The ``tessera`` command.

  tessera demo       split a Llama-style decoder over node processes, check tokens
  tessera capture    record a model's forward pass as a kernel graph file
  tessera plan       place a graph file on devices and compare with the baselines
  tessera node       run a node daemon (same as python -m tessera_actors.node)
"""
from __future__ import annotations

import argparse
import sys


def _capture(args: argparse.Namespace) -> int:
    from .capture_cli import main
    return main(args)


def _plan(args: argparse.Namespace) -> int:
    from .planning.cli import plan_command
    return plan_command(args.graph, args.devices.split(","), args.mode, args.png, args.costs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tessera", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="command", required=True)

    from . import demo
    p = sub.add_parser("demo", help="split decoding across node processes and check it against one device")
    demo.add_arguments(p)
    p.set_defaults(fn=demo.main)

    p = sub.add_parser("capture", help="capture a model's kernel graph to a file")
    p.add_argument("--model", default="llama", help="reference model name (llama, moe, mamba2, vlm, dit, smollm2)")
    p.add_argument("--size", default="tiny", help="tiny | real | a named config")
    p.add_argument("--bucket", default="decode:1", help="decode:B | prefill:B:T | denoise:B")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu (aten capture) or cuda (inductor capture)")
    p.add_argument("--out", required=True, help="graph file to write (.tgraph)")
    p.set_defaults(fn=_capture)

    p = sub.add_parser("plan", help="place a graph on devices and compare with the baselines")
    p.add_argument("graph")
    p.add_argument("--devices", required=True, help="comma-separated device specs")
    p.add_argument("--mode", default="throughput", choices=["latency", "throughput"])
    p.add_argument("--costs", default=None, help="cost table file (default: estimate from kernel features)")
    p.add_argument("--png", default=None, help="write a timeline of the predicted schedule")
    p.set_defaults(fn=_plan)

    p = sub.add_parser("node", help="run a node daemon", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=lambda a: __import__("tessera_actors.node", fromlist=["main"]).main(a.rest))

    args = ap.parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as e:
        print(f"tessera {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
