"""tessera: kernel-granularity inference across heterogeneous devices (an asyncio actor system).

  tessera demo       split a Llama-style decoder over node processes, check tokens
  tessera serve      serve a model over the OpenAI API, with a chat page at /
  tessera capture    record a model's forward pass as a kernel graph file
  tessera check      capture a model, replay it in random orders and splits, print a verdict
  tessera plan       place a graph file on devices and compare with the baselines
  tessera advise     predict tokens/s and tokens/$ of every policy on GPU types we do not have
  tessera bench      benchmarks: arena, serve, roofline, offload
  tessera node       run a node daemon (same as python -m tessera_actors.node)
  tessera keys       create a cluster key directory (CURVE keys; clients allowed by public key)

Run `tessera COMMAND --help` for a command's flags.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One subcommand.  ``flags`` and ``run`` are ``"module:function"`` names,
    imported only when that subcommand is the one given: the module behind
    ``flags`` imports neither torch nor an optional extra, so every
    ``--help`` is fast and works on the base install, while ``run`` may pull
    in whatever the command needs."""
    help: str
    flags: str
    run: str


COMMANDS = {
    "demo": Command("split decoding across node processes and check it against one device",
                    "tessera_actors.cli:demo_flags", "tessera_actors.demo:main"),
    "serve": Command("OpenAI-compatible HTTP server with a chat page (needs the serve extra)",
                     "tessera_actors.serving.flags:add_serve_arguments", "tessera_actors.serving.server:run_command"),
    "capture": Command("capture a model's kernel graph to a file",
                       "tessera_actors.cli:capture_flags", "tessera_actors.capture.cli:main"),
    "check": Command("capture a model and check random orders and splits against one device and eager",
                     "tessera_actors.cli:check_flags", "tessera_actors.check.cli:main"),
    "plan": Command("place a graph on devices and compare with the baselines",
                    "tessera_actors.cli:plan_flags", "tessera_actors.cli:run_plan"),
    "advise": Command("predict every policy on a pair of GPU types we may not have",
                      "tessera_actors.planning.advise:add_arguments", "tessera_actors.planning.advise:main"),
    "keys": Command("create a cluster key directory (authentication; see README)",
                    "transport.keys_cli:add_arguments", "transport.keys_cli:main"),
}

BENCH = {
    "arena": Command("every placement policy serving the same requests through the engine",
                     "tessera_actors.cli:arena_flags", "tessera_actors.cli:run_arena"),
    "serve": Command("replay a request trace through tessera serve (--url) or an in-process AsyncEngine",
                     "tessera_actors.serving.loadgen:add_arguments", "tessera_actors.serving.loadgen:run_command"),
    "roofline": Command("one GPU: the served step (AsyncEngine) vs torch.compile(reduce-overhead) vs the HBM/GEMM floor",
                        "tessera_actors.cli:roofline_flags", "tessera_actors.bench.roofline:main"),
    "offload": Command("a model over the GPU budget: kernel-level CPU+GPU placement vs offloading",
                       "tessera_actors.cli:offload_flags", "tessera_actors.bench.offload:main"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default after its help (unless the help states it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default in ("", [], argparse.SUPPRESS)
        if not unset and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def _load(name: str):
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _add_commands(sub, table: dict[str, Command], chosen: str | None) -> dict[str, argparse.ArgumentParser]:
    """A subparser per command of ``table``; only ``chosen`` gets its flags."""
    parsers = {}
    for name, cmd in table.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help, formatter_class=HelpFormatter)
        p.set_defaults(command_run=cmd.run)
        if name == chosen:
            _load(cmd.flags)(p)
        parsers[name] = p
    return parsers


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The ``tessera`` parser, with the flags of the subcommand ``argv`` names
    (and only those: another command's flag modules are never imported)."""
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(prog="tessera", description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc.rstrip().rsplit("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv else None
    _add_commands(sub, COMMANDS, chosen)
    bench = sub.add_parser("bench", help="benchmarks: arena, serve, roofline, offload",
                           description="Benchmarks (programs: each prints a table and writes JSON). "
                                       "Run `tessera bench NAME --help` for a benchmark's flags.",
                           formatter_class=HelpFormatter)
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    _add_commands(bsub, BENCH, argv[1] if chosen == "bench" and len(argv) > 1 else None)
    sub.add_parser("node", help="run a node daemon (flags: tessera node --help)", add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["node"]:   # the node daemon parses its own flags (argparse's REMAINDER would take --listen)
        from tessera_actors.node import main as node_main
        return int(node_main(argv[1:]) or 0)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(_load(args.command_run)(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as e:
        extra = "serve" if args.command == "serve" or getattr(args, "bench", None) == "serve" else "test"
        print(f"tessera {args.command}: error: {e}; this command needs an optional dependency: "
              f"pip install -e '.[{extra},models]'", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError) as e:
        print(f"tessera {args.command}: error: {e}", file=sys.stderr)
        return 2


# --- flags of the commands whose implementation imports torch (kept here so --help never does) ---

def demo_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="llama", help="reference model: llama, moe, mamba2 or smollm2")
    ap.add_argument("--size", default="tiny", help="model size: tiny | real")
    ap.add_argument("--nodes", default="cpu?threads=1;cpu?threads=1",
                    help="devices of each node process, nodes separated by ';' (e.g. 'cpu;cpu?threads=1')")
    ap.add_argument("--planner", default="contiguous", help="contiguous | milp")
    ap.add_argument("--mode", default="latency", choices=["latency", "throughput", "auto"],
                    help="decode plan: one step of all rows, micro-batch groups, or switched under load")
    ap.add_argument("--requests", type=int, default=4, help="concurrent requests, one KV slot each")
    ap.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    ap.add_argument("--data-plane", default="zmq",
                    help="how node processes move transfer bytes: zmq, or dist (torch.distributed: NCCL between "
                         "GPUs, gloo otherwise)")
    ap.add_argument("--span-bytes", default="", help="nodes send transfers above this size in pipelined spans "
                                                      "(e.g. 64KiB; default: the node default, 4MiB)")


def capture_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama", help="reference model name (llama, moe, mamba2, vlm, dit, smollm2) "
                   "or hf:<dir | config.json | file.gguf | smollm2 | tiny-ARCH> (transformers)")
    p.add_argument("--size", default="tiny", help="tiny | real | a named config")
    p.add_argument("--bucket", default="decode:1", help="decode:B | prefill:B:T | denoise:B")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu (aten capture) or cuda (inductor capture)")
    p.add_argument("--out", required=True, help="graph file to write (.tgraph)")
    p.add_argument("--regions", default="auto", choices=["auto", "whole", "blocks"],
                   help="inductor: compile repeated blocks once (auto, blocks) or the whole model as one graph")
    p.add_argument("--profile", default=None,
                   help="also time every kernel and link on these comma-separated devices and write the "
                        "cost table next to the graph (read by tessera plan)")


def check_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama", help="reference model (llama, moe, mamba2, vlm, dit, smollm2) or "
                   "hf:<dir | config.json | file.gguf | smollm2 | tiny-ARCH>")
    p.add_argument("--size", default="tiny", help="reference models: tiny | real")
    p.add_argument("--layers", type=int, default=None, help="hf models: keep the first N layers")
    p.add_argument("--bucket", default="prefill:1:8", help="decode:B | prefill:B:T | denoise:B")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--devices", default="cpu,cpu", help="comma-separated devices to split over")
    p.add_argument("--orders", type=int, default=20, help="random topological orders")
    p.add_argument("--splits", type=int, default=5, help="random legal splits")
    p.add_argument("--planner", default="milp", help="planner whose split is checked too (contiguous, milp)")
    p.add_argument("--seed", type=int, default=0, help="seed of the orders, splits and inputs")
    p.add_argument("--json", default=None, help="write the report (rows, info, command line) to this file")


def plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("graph", help="graph file from tessera capture (.tgraph)")
    p.add_argument("--devices", required=True, help="comma-separated device specs, e.g. cpu,cpu?threads=1")
    p.add_argument("--mode", default="throughput", choices=["latency", "throughput"],
                   help="optimise one step's latency, or the pipelined step rate")
    p.add_argument("--costs", default=None, help="cost table file (default: the graph's .costs.json when it "
                                                 "matches the devices, else an estimate from kernel features)")
    p.add_argument("--png", default=None, help="write a timeline of the predicted schedule")


def run_plan(args: argparse.Namespace) -> int:
    from tessera_actors.planning.cli import plan_command
    return plan_command(args.graph, args.devices.split(","), args.mode, args.png, args.costs)


def arena_flags(b: argparse.ArgumentParser) -> None:
    b.add_argument("--models", default="llama", help="comma-separated reference models (llama, moe, mamba2, vlm, dit)")
    b.add_argument("--devices", default=None, help="L,R (default: cuda:0,cuda:1?sms=32 on two GPUs)")
    b.add_argument("--layers", type=int, default=4, help="decoder layers of each model")
    b.add_argument("--size", default="real", help="model size: tiny | real")
    b.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16")
    b.add_argument("--seqs", type=int, default=64, help="KV slots (sequences in flight) of every policy")
    b.add_argument("--cache", type=int, default=2048, help="context length of the KV cache")
    b.add_argument("--prompt", type=int, default=1024, help="mean prompt tokens (+-10%%)")
    b.add_argument("--out-tokens", type=int, default=128, help="mean output tokens (50%%-150%%)")
    b.add_argument("--requests", type=int, default=64, help="requests per trace")
    b.add_argument("--rate", type=float, default=8.0, help="conversation trace: requests/s (Poisson)")
    b.add_argument("--reps", type=int, default=3, help="repetitions of every policy (median and spread)")
    b.add_argument("--policies", default="", help="comma-separated subset (default: all)")
    b.add_argument("--out", default="benchmarks/results/arena_served", help="result folder")


def run_arena(args: argparse.Namespace) -> int:
    from tessera_actors.bench.arena import ArenaConfig, default_devices, run_arena as run
    devices = tuple(args.devices.split(",")) if args.devices else default_devices()
    if len(devices) != 2:
        raise ValueError("--devices takes two devices: L,R")
    cfg = ArenaConfig(tuple(args.models.split(",")), devices, args.layers, args.size, args.dtype, args.seqs,
                      args.cache, args.prompt, args.out_tokens, args.requests, args.rate, args.reps, args.out)
    if args.policies:
        cfg.policies = tuple(p.strip() for p in args.policies.split(","))
    run(cfg)
    return 0


def roofline_flags(b: argparse.ArgumentParser) -> None:
    b.add_argument("--models", default="llama,moe,mamba2,vlm,dit", help="comma-separated reference models")
    b.add_argument("--layers", type=int, default=4, help="decoder layers of each model")
    b.add_argument("--batch", type=int, default=64, help="decode rows (DiT: denoise batch)")
    b.add_argument("--cache", type=int, default=2048, help="KV cache positions of the decode case")
    b.add_argument("--prompt", type=int, default=1024, help="tokens of the prefill case")
    b.add_argument("--steps", type=int, default=20, help="timed steps per case")
    b.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16")
    b.add_argument("--device", default="cuda:0", help="the GPU measured")
    b.add_argument("--out", default="benchmarks/results/roofline", help="result folder")
    b.add_argument("--gqa", default="enable_gqa", choices=["fold", "enable_gqa"], help="attention's GQA form")
    b.add_argument("--regions", default="auto", choices=["auto", "whole", "blocks"],
                   help="the served inductor capture's regions (auto/blocks: each repeated block compiled once; "
                        "whole: the model as one graph, as the baseline compiles it)")


def offload_flags(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default="llama", help="reference model")
    b.add_argument("--size", default="real", help="model size: tiny | real")
    b.add_argument("--gpu-budget", default="8GiB", help="bytes (8GiB) or a fraction of weights + KV (0.5)")
    b.add_argument("--batch", default="1,8", help="decode batch sizes")
    b.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: skip)")
    b.add_argument("--devices", default="", help="GPU,CPU (default cuda:0,cpu?threads=12; CPU-only: cpu?threads=1,cpu)")
    b.add_argument("--steps", type=int, default=32, help="decode steps timed per workload")
    b.add_argument("--prefill-steps", type=int, default=3, help="prompts timed per prefill workload")
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"], help="weight dtype")
    b.add_argument("--reserve", default="320MiB", help="GPU bytes kept for transient op results")
    b.add_argument("--switch-us", type=float, default=200.0,
                   help="planned cost of one CPU<->GPU hand-off with --no-measure")
    b.add_argument("--no-measure", action="store_true",
                   help="plan with the H200 host's reference rates (PCIe 55 GB/s, CPU GEMV 40 GB/s) and "
                        "--switch-us instead of measuring them")
    b.add_argument("--layers", type=int, default=0, help="only this many layers (a quick real-size check)")
    b.add_argument("--ring", default="bytes",
                   help="staging ring: bytes (packed, the default) or slots (one weight a slot); a list "
                        "(bytes,slots) runs Tessera once per mode, rows tessera_<mode>_ring (the first is the "
                        "headline, and the ring of the streaming row)")
    b.add_argument("--tie-nats", type=float, default=0.0625,
                   help="teacher-forced check: an argmax flip within this many nats of the reference's best "
                        "is a tie")
    b.add_argument("--reference-capture", default="aten", choices=["auto", "aten", "inductor"],
                   help="the GPU-only reference engine's capture (aten, the default: the GPU kernels the offload "
                        "rows run, so the teacher-forced check sees the placement alone; auto: inductor on a GPU, "
                        "what a GPU-only user gets - Llama-8B's bf16 logits then differ by up to 0.22 nats on the "
                        "GPU alone)")
    b.add_argument("--expert-parts", type=int, default=4,
                   help="moe: each layer's routed experts as this many stacked tensors, each placed on its own "
                        "(resident, streamed or on the CPU); 1: one tensor a layer")
    b.add_argument("--probe", type=int, default=0,
                   help="after each decode batch's timed window, probe this many steps: per step the busy time "
                        "of each resource, copy/CPU overlap, copy-engine gaps by cause (row JSON 'timeline', "
                        "beside the planner's prediction in the same terms) and a trace file in --out")
    b.add_argument("--out", default="benchmarks/results/offload", help="result folder")


if __name__ == "__main__":
    sys.exit(main())
