"""The ``tessera`` command.

  tessera demo       split a Llama-style decoder over node processes, check tokens
  tessera capture    record a model's forward pass as a kernel graph file
  tessera check      capture a model, replay it in random orders and splits, print a verdict
  tessera plan       place a graph file on devices and compare with the baselines
  tessera advise     predict tokens/s and tokens/$ of every policy on GPU types we do not have
  tessera node       run a node daemon (same as python -m tessera_actors.node)
  tessera serve      serve a model over the OpenAI API, with a chat page at /
  tessera keys       create a cluster key directory (CURVE keys; clients allowed by public key)
"""
from __future__ import annotations

import argparse
import sys


def _capture(args: argparse.Namespace) -> int:
    from tessera_actors.capture.cli import main
    return main(args)


def _plan(args: argparse.Namespace) -> int:
    from tessera_actors.planning.cli import plan_command
    return plan_command(args.graph, args.devices.split(","), args.mode, args.png, args.costs)


def _arena(args: argparse.Namespace) -> int:
    from tessera_actors.bench.arena import ArenaConfig, default_devices, run_arena
    devices = tuple(args.devices.split(",")) if args.devices else default_devices()
    if len(devices) != 2:
        raise ValueError("--devices takes two devices: L,R")
    cfg = ArenaConfig(tuple(args.models.split(",")), devices, args.layers, args.size, args.dtype, args.seqs,
                      args.cache, args.prompt, args.out_tokens, args.requests, args.rate, args.reps, args.out)
    if args.policies:
        cfg.policies = tuple(p.strip() for p in args.policies.split(","))
    run_arena(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["node"]:   # the node daemon parses its own flags (argparse's REMAINDER would take --listen)
        from tessera_actors.node import main as node_main
        return int(node_main(argv[1:]) or 0)
    ap = argparse.ArgumentParser(prog="tessera", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="command", required=True)

    from tessera_actors import demo
    p = sub.add_parser("demo", help="split decoding across node processes and check it against one device")
    demo.add_arguments(p)
    p.set_defaults(fn=demo.main)

    p = sub.add_parser("capture", help="capture a model's kernel graph to a file")
    p.add_argument("--model", default="llama", help="reference model name (llama, moe, mamba2, vlm, dit, smollm2) "
                   "or hf:<dir | config.json | file.gguf | smollm2 | tiny-ARCH> (transformers)")
    p.add_argument("--size", default="tiny", help="tiny | real | a named config")
    p.add_argument("--bucket", default="decode:1", help="decode:B | prefill:B:T | denoise:B")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu (aten capture) or cuda (inductor capture)")
    p.add_argument("--out", required=True, help="graph file to write (.tgraph)")
    p.add_argument("--regions", default="auto", choices=["auto", "whole", "blocks"],
                   help="inductor: compile repeated blocks once (auto, blocks) or the whole model as one graph")
    p.add_argument("--profile", default=None,
                   help="also time every kernel and link on these comma-separated devices and write the "
                        "cost table next to the graph (read by tessera plan)")
    p.set_defaults(fn=_capture)

    from tessera_actors.check import cli as check_cli
    p = sub.add_parser("check", help="capture a model and check random orders and splits against one device and eager")
    check_cli.add_arguments(p)
    p.set_defaults(fn=check_cli.main)

    p = sub.add_parser("plan", help="place a graph on devices and compare with the baselines")
    p.add_argument("graph")
    p.add_argument("--devices", required=True, help="comma-separated device specs")
    p.add_argument("--mode", default="throughput", choices=["latency", "throughput"])
    p.add_argument("--costs", default=None, help="cost table file (default: estimate from kernel features)")
    p.add_argument("--png", default=None, help="write a timeline of the predicted schedule")
    p.set_defaults(fn=_plan)

    from tessera_actors.planning import advise
    p = sub.add_parser("advise", help="predict every policy on a pair of GPU types we may not have")
    advise.add_arguments(p)
    p.set_defaults(fn=advise.main)

    p = sub.add_parser("bench", help="benchmarks: arena (all policies side by side)")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("arena", help="every placement policy serving the same requests through the engine")
    b.add_argument("--models", default="llama")
    b.add_argument("--devices", default=None, help="L,R (default: cuda:0,cuda:1?sms=32 on two GPUs)")
    b.add_argument("--layers", type=int, default=4)
    b.add_argument("--size", default="real")
    b.add_argument("--dtype", default="bfloat16")
    b.add_argument("--seqs", type=int, default=64, help="KV slots (sequences in flight) of every policy")
    b.add_argument("--cache", type=int, default=2048, help="context length of the KV cache")
    b.add_argument("--prompt", type=int, default=1024, help="mean prompt tokens (+-10%%)")
    b.add_argument("--out-tokens", type=int, default=128, help="mean output tokens (50%%-150%%)")
    b.add_argument("--requests", type=int, default=64)
    b.add_argument("--rate", type=float, default=8.0, help="conversation trace: requests/s (Poisson)")
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--policies", default="", help="comma-separated subset (default: all)")
    b.add_argument("--out", default="benchmarks/results/arena_served")
    b.set_defaults(fn=_arena)
    from tessera_actors.serving import loadgen
    b = bsub.add_parser("serve", help="replay a request trace through tessera serve (--url) or an in-process AsyncEngine")
    loadgen.add_arguments(b)
    b.set_defaults(fn=loadgen.run_command)

    from tessera_actors.serving import server
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a chat page")
    server.add_arguments(p)
    p.set_defaults(fn=server.run_command)

    from tessera_actors.bench import roofline
    b = bsub.add_parser("roofline", help="one GPU: tessera step vs torch.compile(reduce-overhead) vs the HBM/GEMM floor")
    roofline.add_arguments(b)
    b.set_defaults(fn=roofline.main)

    from tessera_actors.bench import offload as offload_bench
    b = bsub.add_parser("offload", help="a model over the GPU budget: kernel-level CPU+GPU placement vs offloading")
    offload_bench.add_arguments(b)
    b.set_defaults(fn=offload_bench.main)

    from transport import keys_cli
    p = sub.add_parser("keys", help="create a cluster key directory (authentication; see README)")
    keys_cli.add_arguments(p)
    p.set_defaults(fn=keys_cli.main)

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
