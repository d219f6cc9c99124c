"""Where a CPU step goes, and which CPU deployment is faster (issue #33).

Through ``AsyncEngine`` (what ``tessera serve`` runs), SmolLM2-135M in
float32, for each deployment of ``--deployments`` in alternating rounds (the
box is shared: ratios within a round are what count):

* batch-1 decode: one stream of ``--tokens`` greedy tokens, time per output
  token after the first;
* 16 streams: ``--streams`` prompts of 40 tokens sent at once, ``--tokens``
  tokens each: output tok/s, TTFT p50/p99.

Then, for the one-device deployment, the batch-1 decode step taken apart:
its bucket's kernels run in program order on this thread (``AtenProgram``,
the executor the device actor runs), timed as a whole, and under
``torch.profiler`` the time inside the aten kernels; the rest of the loop
is per-kernel dispatch (Python call, views, out= variants).  A split's cost
over one device at equal total work is its hand-offs (and its lost cores).

    PYTHONPATH=. python benchmarks/bench_cpu_step.py --out benchmarks/results/serve_cpu/cpu_step.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tessera_actors import AsyncEngine, SamplingParams
from tessera_actors.serving.loadgen_report import provenance


async def _stream(eng, prompt: list[int], n: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first, got = None, 0
    async for out in eng.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)):
        if first is None:
            first = time.perf_counter() - t0
        got += len(out.token_ids)
    return first, time.perf_counter() - t0, got


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def serve_round(devices: str, tokens: int, streams: int) -> dict:
    t0 = time.perf_counter()
    async with AsyncEngine(model="smollm2", devices=devices, max_seqs=16, max_model_len=1024,
                           kv_cache_memory=None) as eng:
        await eng.wait_placed()
        start_s = time.perf_counter() - t0
        prompt = list(range(1000, 1040))
        await _stream(eng, prompt, 4)   # warm
        first, total, got = await _stream(eng, prompt, tokens)
        tpot1 = (total - first) / max(got - 1, 1)
        t1 = time.perf_counter()
        rs = await asyncio.gather(*(_stream(eng, [t + 50 * i for t in prompt], tokens) for i in range(streams)))
        wall = time.perf_counter() - t1
        ttft = [r[0] for r in rs]
        stats = eng.stats()
        return {"devices": devices, "start_s": start_s, "batch1_tpot_s": tpot1, "batch1_tok_s": 1 / tpot1,
                "streams": streams, "streams_tok_s": sum(r[2] for r in rs) / wall,
                "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
                "kernels_per_device": stats["placement"]["kernels_per_device"],
                "bytes_per_step": stats["placement"]["bytes_per_step"],
                "prefill_steps": stats["prefill_steps"], "decode_steps": stats["decode_steps"]}


def kernel_breakdown(bucket: str, reps: int) -> dict:
    """The batch-1 decode bucket's kernels on this thread: loop time vs time inside aten."""
    from torch.profiler import ProfilerActivity, profile

    from tessera_actors.execution.program import AtenProgram
    from tessera_actors.serving.config import EngineConfig
    from tessera_actors.serving.deploy import load_served_model
    served = load_served_model(EngineConfig(model="smollm2", devices="cpu", max_seqs=16, max_model_len=1024,
                                            kv_cache_memory=None, embeddings=False), core_only=True)
    graph = served.graph(bucket)
    prog = AtenProgram(graph, torch.device("cpu"), graph.buffers)
    prog.load(served.values[bucket])
    order = [k.id for k in graph.kernels]   # program order
    prog.run_kernels(order)   # bind and warm
    t0 = time.perf_counter()
    for _ in range(reps):
        prog.run_kernels(order)
    loop = (time.perf_counter() - t0) / reps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            prog.run_kernels(order)
    top = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    inside = sum(e.cpu_time_total for e in top) / 1e6 / reps
    by_op: dict[str, float] = {}
    for e in top:
        by_op[e.name] = by_op.get(e.name, 0.0) + e.cpu_time_total / 1e6 / reps
    weights = sum(t.numel() * t.element_size() for t in served.weights.values())
    wsum = [t for t in served.weights.values() if t.is_floating_point()]
    t0 = time.perf_counter()
    for _ in range(reps):
        for t in wsum:
            t.sum()
    read = (time.perf_counter() - t0) / reps
    return {"bucket": bucket, "kernels": len(order), "loop_s": loop, "in_aten_s": inside,
            "dispatch_s": max(loop - inside, 0.0), "dispatch_per_kernel_us": max(loop - inside, 0.0) / len(order) * 1e6,
            "top_ops_s": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:6]),
            "weight_bytes": weights, "weight_read_s": read, "threads": torch.get_num_threads()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployments", default="cpu;cpu,cpu", help="';' between deployments (device lists)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10, help="kernel breakdown: repetitions")
    ap.add_argument("--out", default="benchmarks/results/serve_cpu/cpu_step.json")
    a = ap.parse_args()
    deps = [d for d in a.deployments.split(";") if d]
    rounds = []
    for r in range(a.rounds):
        rounds.append([asyncio.run(serve_round(d, a.tokens, a.streams)) for d in deps])
        for row in rounds[-1]:
            print(f"round {r + 1} {row['devices']:10} batch-1 {row['batch1_tok_s']:5.1f} tok/s  {a.streams} streams "
                  f"{row['streams_tok_s']:5.1f} tok/s  TTFT p50 {row['ttft_p50_s']:.2f} s p99 {row['ttft_p99_s']:.2f} s",
                  flush=True)
    base = deps[0]
    ratios = {d: {k: statistics.median(rd[i][k] / rd[0][k] for rd in rounds)
                  for k in ("batch1_tok_s", "streams_tok_s", "ttft_p99_s")} for i, d in enumerate(deps)} if rounds else {}
    parts = kernel_breakdown("decode:1@0~512", a.reps)
    print(f"\n{'deployment':12} {'batch-1 tok/s':>14} {'streams tok/s':>14} {'TTFT p99':>9}   (median ratio to {base})")
    for i, d in enumerate(deps if rounds else []):
        med = {k: statistics.median(rd[i][k] for rd in rounds) for k in ("batch1_tok_s", "streams_tok_s", "ttft_p99_s")}
        print(f"{d:12} {med['batch1_tok_s']:8.1f} x{ratios[d]['batch1_tok_s']:.2f} {med['streams_tok_s']:8.1f} "
              f"x{ratios[d]['streams_tok_s']:.2f} {med['ttft_p99_s']:6.2f} s x{ratios[d]['ttft_p99_s']:.2f}")
    print(f"\nbatch-1 decode step, one device ({parts['threads']} threads): {parts['kernels']} kernels, loop "
          f"{parts['loop_s'] * 1e3:.1f} ms = in aten {parts['in_aten_s'] * 1e3:.1f} ms + dispatch "
          f"{parts['dispatch_s'] * 1e3:.1f} ms ({parts['dispatch_per_kernel_us']:.1f} us a kernel); reading the "
          f"{parts['weight_bytes'] / 2**20:.0f} MiB of weights once: {parts['weight_read_s'] * 1e3:.1f} ms")
    print("  top aten ops (s/step):", {k: round(v * 1e3, 1) for k, v in parts["top_ops_s"].items()})
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance(), "rounds": rounds, "ratios": ratios,
                               "decode_step_breakdown": parts}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
