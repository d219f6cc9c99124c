"""``tessera demo``: a Llama-style decoder served by the engine, split across
devices hosted by node processes, checked against the single-device run.

Steps: serve a few concurrent greedy requests with ``AsyncEngine`` on one
device (the reference); start the nodes, let them register with the
scheduler, place every bucket over their devices, serve the same requests
through them; print the placement, bytes moved and tokens; compare.  Exit
status 0 only if the split tokens (and every token's log probability,
bitwise on CPU) equal the single-device ones.
"""
from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import torch

from actors.transfer_config import DATA_PLANES
from tessera_actors.devices import parse_bytes, parse_devices
from tessera_actors.graph import KernelGraph
from tessera_actors.runtime.messages import GetStats
from tessera_actors.plan import Plan


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
    span_bytes: str = ""           # the nodes' --span-bytes ("" = their default)
    requests: int = 4              # concurrent requests (KV slots)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.new_tokens < 1 or self.requests < 1:
            raise ValueError("--prompt-len, --new-tokens and --requests must be at least 1")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"--data-plane {self.data_plane!r}: expected one of {', '.join(DATA_PLANES)}")
        if self.span_bytes:
            parse_bytes(self.span_bytes)
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
    """The main job through the serving engine: the same requests on one
    device and split over the node processes; exit status 0 only when every
    token is identical and (CPU, fp32) every token's log probability is
    bitwise equal, and the nodes exit 0."""
    from tessera_actors.serving import AsyncEngine, EngineConfig, SamplingParams
    torch.set_num_threads(1)  # the nodes run cpu?threads=1: same kernels, same bits
    cuda = [d for node in cfg.nodes for d in node.split(",") if d.startswith("cuda")]
    ref_dev = cuda[0].split("?")[0] if cuda else "cpu?threads=1"
    common = dict(model=cfg.model, size=cfg.size, seed=cfg.seed, planner=cfg.planner, max_seqs=cfg.requests,
                  max_model_len=max(64, cfg.prompt_len + cfg.new_tokens + 1), prefill_buckets=(8, 32),
                  # one decode shape: which rows share a step depends on timing, and a row's bits on the
                  # step's shape (a GEMM of 2 rows may round differently from one of 4)
                  decode_buckets=(cfg.requests,), mode=cfg.mode)
    gen = torch.Generator().manual_seed(cfg.seed)
    params = SamplingParams(max_tokens=cfg.new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    async with AsyncEngine(config=EngineConfig(devices=ref_dev, **common)) as single:
        await single.wait_placed()   # every bucket itself: a stand-in (a larger one) computes other bits
        vocab = single.served.vocab_size
        prompts = [torch.randint(0, vocab, (cfg.prompt_len,), generator=gen).tolist() for _ in range(cfg.requests)]
        ref = await asyncio.gather(*(_collect(single, p, params) for p in prompts))
        graph = single.served.graphs[single.deployment.reference_bucket()]
        s = graph.summary()
    out(f"captured {cfg.model}/{cfg.size}: {len(single.served.graphs)} buckets, the reference decode bucket "
        f"{s['kernels']} kernels, {s['buffers']} buffers, edges {s['edges']} ({time.perf_counter() - t0:.1f} s)")
    for i, (toks, _) in enumerate(ref):
        out(f"single device : request {i}: {toks}  ({ref_dev})")
    # a node that answers no ping for lost_after_s counts as lost and the run continues re-placed on the
    # survivors, in other kernels (not bitwise the reference's): on a loaded machine 1 s is too short
    # a wait for a live node; a node that dies is still seen at once (its process exits)
    eng = AsyncEngine(config=EngineConfig(nodes=cfg.nodes, node_args=tuple(node_args(cfg)), lost_after_s=10.0,
                                          **common))
    await eng.start()
    try:
        rt = eng.deployment
        out("nodes         : " + ", ".join(f"{n.name} pid {n.proc.pid} at {n.endpoint}" for n in rt.cluster.nodes))
        placed = rt.placed[rt.reference_bucket()]
        out(describe_placement(graph, placed.plan, placed.routes))
        t0 = time.perf_counter()
        got = await asyncio.gather(*(_collect(eng, p, params) for p in prompts))
        dt = time.perf_counter() - t0
        stats = eng.stats()
        moved, spans = 0, 0
        for ep in sorted({ep for _, ep, _ in placed.routes}):
            st = (await (await rt.system.remote_ref(ep, "transfer")).ask(GetStats())).values
            moved += st["remote_bytes"] + st["local_bytes"]
            spans += st.get("remote_spans", 0)
    finally:
        await eng.stop()
    codes = [n.exit_code for n in rt.cluster.nodes]
    for i, (toks, _) in enumerate(got):
        out(f"split         : request {i}: {toks}")
    steps = stats["steps"]
    out(f"{steps} engine steps ({stats['prefill_steps']} prompt chunks, {stats['decode_steps']} decode) in {dt:.3f} s; "
        f"{stats['generated_tokens']} tokens ({stats['generated_tokens'] / dt:.1f}/s); bytes moved between devices: "
        f"{moved} ({moved / max(steps, 1):.0f} per step, the decode plan predicts {placed.plan.bytes_per_step()})")
    out(f"data plane    : {cfg.data_plane}, {spans} messages between processes")
    out(f"nodes exited with {codes}")
    if stats["recoveries"]:
        out(f"recoveries    : {stats['recoveries']} (a node was counted lost; the rest ran re-placed)")
    same_tokens = [t for t, _ in got] == [t for t, _ in ref]
    if cuda:   # GPU gate: greedy tokens identical (log probabilities within rounding)
        worst = max(abs(x - y) for (_, a), (_, b) in zip(got, ref) for x, y in zip(a, b))
        same_logits = worst < 1e-2
        out(f"check         : tokens {'IDENTICAL' if same_tokens else 'DIFFER'}, log probabilities within "
            f"{worst:.2e} (GPU)")
    else:
        same_logits = [lp for _, lp in got] == [lp for _, lp in ref]
        out(f"check         : tokens {'IDENTICAL' if same_tokens else 'DIFFER'}, logits "
            f"{'bitwise equal' if same_logits else 'differ'} (fp32, CPU; log probability of every token)")
    return 0 if same_tokens and same_logits and all(c == 0 for c in codes) else 1


async def _collect(eng, prompt, params) -> tuple[list[int], list[float]]:
    toks, lps = [], []
    async for o in eng.generate(prompt, params):
        toks += o.token_ids
        lps += o.logprobs
    return toks, lps


def node_args(cfg: DemoConfig) -> list[str]:
    """The node daemon flags that carry the demo's data-plane choice."""
    args = ["--data-plane", cfg.data_plane]
    return args + (["--span-bytes", cfg.span_bytes] if cfg.span_bytes else [])


def main(args: argparse.Namespace) -> int:
    cfg = DemoConfig(args.model, args.size, tuple(n for n in args.nodes.split(";") if n.strip()), args.planner,
                     args.mode, args.prompt_len, args.new_tokens, args.seed, args.data_plane, args.span_bytes,
                     args.requests)
    try:
        import uvloop
        return uvloop.run(run_demo(cfg))
    except ImportError:
        return asyncio.run(run_demo(cfg))

