"""``tessera demo``: a Llama-style decoder split across devices hosted by node
processes, greedy decoding through the actor system, checked against the
single-device run.

Steps: capture the decode step as a kernel graph; run it on one device for
the reference tokens; start the nodes, let them register with the scheduler,
place the graph (one plan over all registered devices), deploy, decode
through the engine; print the placement, bytes moved and tokens; compare.
Exit status 0 only if the split tokens (and logits, bitwise on CPU) equal
the single-device ones.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Sequence

import msgpack
import torch

from actors.graph import GraphActor
from actors.scheduler import SchedulerActor
from actors.transfer import DATA_PLANES
from .capture import capture_module
from .cluster import LocalCluster
from .devices import parse_bytes, parse_devices
from .engine import Engine, greedy_decode
from .graph import KernelGraph
from .messages import GetStats, Place
from .plan import Plan, plan_from_dict, single_device_plan
from .planners import get_planner
from .runner import PlanRunner
from .system import ActorSystem


@dataclass
class DemoConfig:
    model: str = "llama"
    size: str = "tiny"
    nodes: tuple[str, ...] = ("cpu?threads=1", "cpu?threads=1")
    planner: str = "contiguous"
    mode: str = "latency"
    prompt_len: int = 8
    new_tokens: int = 16
    seed: int = 0
    data_plane: str = "zmq"        # how the nodes move bytes between them: zmq | dist
    chunk_bytes: str = ""          # the nodes' --chunk-bytes ("" = their default)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.new_tokens < 1:
            raise ValueError("--prompt-len and --new-tokens must be at least 1")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"--data-plane {self.data_plane!r}: expected one of {', '.join(DATA_PLANES)}")
        if self.chunk_bytes:
            parse_bytes(self.chunk_bytes)
        if not self.nodes:
            raise ValueError("at least one node is needed")
        for node in self.nodes:   # fail here, with the reason, rather than in a child process
            parse_devices(node)


def describe_placement(graph: KernelGraph, plan: Plan, routes: list) -> str:
    where = {d: f"{ep.rsplit(':', 1)[-1] if ep else 'local'}/{name}" for d, ep, name in routes}
    lines = [plan.describe(graph), "  segments:"]
    for s in plan.segments:
        first, last = graph.kernels[s.kernels[0]], graph.kernels[s.kernels[-1]]
        lines.append(f"    #{s.id:<3} {plan.devices[s.device]:<16} port/actor {where[s.device]:<16} kernels "
                     f"{first.id:>4}-{last.id:<4} {first.scope or first.name} .. {last.scope or last.name}")
    if plan.transfers:
        lines.append("  transfers per step:")
        for t in plan.transfers:
            b = graph.buffers[t.buffer]
            lines.append(f"    tag {t.tag:<3} device {t.src} -> {t.dst}: {t.nbytes:>8} bytes of buffer {t.buffer}"
                         f" ({b.role}{' ' + b.name if b.name else ''})")
    return "\n".join(lines)


async def run_demo(cfg: DemoConfig, out=print) -> int:
    from . import models
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)  # the nodes run cpu?threads=1: same kernels, same bits
    model = models.get(cfg.model, cfg.size, dtype=torch.float32, seed=cfg.seed)
    vocab = model.cfg.vocab_size
    prompt = torch.randint(0, vocab, (cfg.prompt_len,), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    t0 = time.perf_counter()
    cap = capture_module(model, model.example_inputs("decode", batch=1), meta={"model": cfg.model, "bucket": "decode:1"})
    g = cap.graph
    s = g.summary()
    out(f"captured {cfg.model}/{cfg.size} decode step in {time.perf_counter() - t0:.2f} s: {s['kernels']} kernels, "
        f"{s['buffers']} buffers, edges {s['edges']}")

    cuda = [d for node in cfg.nodes for d in node.split(",") if d.startswith("cuda")]
    ref_dev = cuda[0].split("?")[0] if cuda else "cpu"
    ref_runner = PlanRunner(g, single_device_plan(g, ref_dev), cap.values, device_of=lambda d: torch.device(ref_dev))
    ref_tokens, ref_logits = await greedy_decode(_sync_step(ref_runner), prompt, cfg.new_tokens)
    out(f"single device : {ref_tokens}  ({ref_dev})")

    async with split_on_nodes(g, cap.values, cfg.nodes, cfg.planner, cfg.mode, node_args(cfg)) as run:
        cluster, plan, engine = run.cluster, run.plan, run.engine
        out("nodes         : " + ", ".join(f"{n.name} pid {n.proc.pid} at {n.endpoint}" for n in cluster.nodes))
        out(describe_placement(g, plan, run.routes))
        t0 = time.perf_counter()
        tokens, logits = await greedy_decode(engine.step, prompt, cfg.new_tokens)
        dt = time.perf_counter() - t0
        stats = await run.transfer_stats()
        moved = sum(st["remote_bytes"] + st["local_bytes"] for st in stats.values())
        chunks = sum(st.get("remote_chunks", 0) for st in stats.values())
    codes = [n.exit_code for n in cluster.nodes]
    steps = engine.steps
    out(f"split         : {tokens}")
    out(f"{steps} steps in {dt:.3f} s ({steps / dt:.1f} steps/s); bytes moved between devices: {moved} "
        f"({moved / max(steps, 1):.0f} per step, plan predicts {plan.bytes_per_step()})")
    out(f"data plane    : {cfg.data_plane}, {chunks} messages between processes")
    out(f"nodes exited with {codes}")
    same_tokens = tokens == ref_tokens
    if cuda:  # GPU gate: greedy tokens identical and logits cosine >= 0.999
        cos = min(torch.nn.functional.cosine_similarity(a.double().flatten().cpu(), b.double().flatten().cpu(), dim=0).item()
                  for a, b in zip(logits, ref_logits))
        same_logits = cos >= 0.999
        out(f"check         : tokens {'IDENTICAL' if same_tokens else 'DIFFER'}, logits min cosine {cos:.6f} (GPU)")
    else:
        same_logits = all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
        out(f"check         : tokens {'IDENTICAL' if same_tokens else 'DIFFER'}, logits "
            f"{'bitwise equal' if same_logits else 'differ'} (fp32, CPU)")
    return 0 if same_tokens and same_logits and all(c == 0 for c in codes) else 1


@dataclass
class SplitRun:
    """A plan deployed over node processes; ``engine`` steps it."""
    system: ActorSystem
    cluster: LocalCluster
    routes: list          # [plan device, endpoint, actor]
    plan: Plan
    engine: Engine

    async def transfer_stats(self) -> dict[str, dict]:
        """``GetStats`` of the transfer actor of every node the plan uses, by endpoint."""
        out = {}
        for ep in sorted({ep for _, ep, _ in self.routes}):
            out[ep] = (await (await self.system.remote_ref(ep, "transfer")).ask(GetStats())).values
        return out


@asynccontextmanager
async def split_on_nodes(graph: KernelGraph, values: dict, nodes: Sequence[str], planner: str = "contiguous",
                         mode: str = "latency", node_args: Sequence[str] = (), plan_id: str = "demo",
                         step_timeout: float = 60.0, register_timeout: float = 30.0):
    """Start one node process per entry of ``nodes`` (its device specs), let
    them register with a scheduler in this process, place ``graph`` (initial
    bytes ``values``) over all their devices and deploy it; yields a
    ``SplitRun``.  On exit the nodes are stopped (exit codes in
    ``cluster.nodes``) and the actor system shut down."""
    async with ActorSystem("demo") as system:
        address = await system.listen("tcp://127.0.0.1:0")
        await system.spawn(GraphActor(graph), "graph")
        sched = await system.spawn(SchedulerActor(get_planner(planner), values), "scheduler")
        async with LocalCluster(nodes, scheduler=address, node_args=node_args) as cluster:
            deadline = time.monotonic() + register_timeout
            while len((await sched.ask(GetStats())).values["nodes"]) < len(nodes):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nodes did not register with the scheduler within {register_timeout:g} s")
                await asyncio.sleep(0.05)
            dep = await sched.ask(Place(plan_id, mode), timeout=120)
            plan = plan_from_dict(msgpack.unpackb(dep.plan, strict_map_key=False))
            refs = [await system.remote_ref(ep, name) for _, ep, name in dep.routes]
            yield SplitRun(system, cluster, dep.routes, plan, Engine(graph, plan, plan_id, refs, step_timeout))


def node_args(cfg: DemoConfig) -> list[str]:
    """The node daemon flags that carry the demo's data-plane choice."""
    args = ["--data-plane", cfg.data_plane]
    return args + (["--chunk-bytes", cfg.chunk_bytes] if cfg.chunk_bytes else [])


def _sync_step(runner: PlanRunner):
    async def step(inputs):
        return runner.step(inputs)
    return step


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="llama", help="reference model (llama, moe, mamba2, smollm2)")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--nodes", default="cpu?threads=1;cpu?threads=1",
                    help="devices of each node process, nodes separated by ';' (e.g. 'cpu;cpu?threads=1')")
    ap.add_argument("--planner", default="contiguous", help="contiguous | milp")
    ap.add_argument("--mode", default="latency", choices=["latency", "throughput"])
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-plane", default="zmq", choices=DATA_PLANES,
                    help="how node processes move transfer bytes: zmq, or dist (torch.distributed: NCCL between "
                         "GPUs, gloo otherwise)")
    ap.add_argument("--chunk-bytes", default="", help="nodes send transfers above this size in pipelined chunks "
                                                      "(e.g. 64KiB; default: the node default, 4MiB)")


def main(args: argparse.Namespace) -> int:
    cfg = DemoConfig(args.model, args.size, tuple(n for n in args.nodes.split(";") if n.strip()), args.planner,
                     args.mode, args.prompt_len, args.new_tokens, args.seed, args.data_plane, args.chunk_bytes)
    try:
        import uvloop
        return uvloop.run(run_demo(cfg))
    except ImportError:
        return asyncio.run(run_demo(cfg))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
