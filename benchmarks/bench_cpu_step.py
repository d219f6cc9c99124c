"""Where a CPU step goes, with float32 and with quantized weights (issue #33).

Through ``AsyncEngine`` (what ``tessera serve`` runs), SmolLM2-135M, for each
deployment of ``--deployments`` and each weight form of ``--weights``
(``dense``: dequantized to float32; ``quantized``: the GGUF's 4-bit blocks
and the int8 head through torch's CPU kernels), in alternating rounds (the
box is shared: ratios within a round are what count):

* batch-1 decode: one stream of ``--tokens`` greedy tokens, time per output
  token after the first;
* 16 streams: ``--streams`` prompts of 40 tokens sent at once, ``--tokens``
  tokens each: output tok/s, TTFT p50/p99.

Then, for each weight form on one device, the batch-1 decode step taken
apart: its bucket's kernels run in program order on this thread
(``AtenProgram``, the executor the device actor runs), timed as a whole, and
under ``torch.profiler`` the time inside the aten kernels; the rest of the
loop is per-kernel dispatch.  With ``--rss``, a ``tessera serve`` process per
weight form: its resident memory once every bucket is placed and after a
few requests.

    PYTHONPATH=. python benchmarks/bench_cpu_step.py --rounds 3 --rss \\
        --out benchmarks/results/cpu_step/cpu_step.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tessera_actors import AsyncEngine, SamplingParams
from tessera_actors.provenance import provenance

KEYS = ("batch1_tok_s", "streams_tok_s", "ttft_p99_s")


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


async def serve_round(devices: str, weights: str, tokens: int, streams: int) -> dict:
    t0 = time.perf_counter()
    async with AsyncEngine(model="smollm2", devices=devices, weights=weights, max_seqs=16, max_model_len=1024,
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
        return {"devices": devices, "weights": stats["weights"], "start_s": start_s, "batch1_tpot_s": tpot1,
                "batch1_tok_s": 1 / tpot1, "streams": streams, "streams_tok_s": sum(r[2] for r in rs) / wall,
                "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
                "kernels_per_device": stats["placement"]["kernels_per_device"],
                "bytes_per_step": stats["placement"]["bytes_per_step"], "weight_bytes": eng.served.weight_bytes,
                "prefill_steps": stats["prefill_steps"], "decode_steps": stats["decode_steps"],
                "load_avg_1m": os.getloadavg()[0]}


def kernel_breakdown(bucket: str, weights: str, reps: int) -> dict:
    """The batch-1 decode bucket's kernels on this thread: loop time vs time inside aten."""
    from torch.profiler import ProfilerActivity, profile

    from tessera_actors.execution.program import AtenProgram
    from tessera_actors.serving.config import EngineConfig
    from tessera_actors.serving.deploy import load_served_model
    served = load_served_model(EngineConfig(model="smollm2", devices="cpu", max_seqs=16, max_model_len=1024,
                                            kv_cache_memory=None, embeddings=False, weights=weights), core_only=True)
    graph = served.graph(bucket)
    prog = AtenProgram(graph, torch.device("cpu"), graph.buffers)
    prog.load(served.values[bucket])
    order = [k.id for k in graph.kernels]   # program order
    prog.run_kernels(order)   # bind and warm
    prog.run_kernels(order)
    loops = []
    for _ in range(reps):
        t0 = time.perf_counter()
        prog.run_kernels(order)
        loops.append(time.perf_counter() - t0)
    loop = statistics.median(loops)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            prog.run_kernels(order)
    top = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    inside = sum(e.cpu_time_total for e in top) / 1e6 / reps
    by_op: dict[str, float] = {}
    for e in top:
        by_op[e.name] = by_op.get(e.name, 0.0) + e.cpu_time_total / 1e6 / reps
    return {"bucket": bucket, "weights": weights, "kernels": len(order), "loop_s": loop, "loop_min_s": min(loops),
            "in_aten_s": inside, "dispatch_s": max(loop - inside, 0.0),
            "dispatch_per_kernel_us": max(loop - inside, 0.0) / len(order) * 1e6,
            "top_ops_s": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:8]),
            "weight_bytes": served.weight_bytes, "threads": torch.get_num_threads(),
            "load_avg_1m": os.getloadavg()[0]}


async def server_rss(weights: str, requests: int = 4) -> dict:
    """``tessera serve --weights W`` (the default deployment of this machine):
    resident bytes once placed and after ``requests`` chat requests."""
    import aiohttp

    from tessera_actors.serving.launch import LaunchedServer
    server = LaunchedServer(f"--model smollm2 --weights {weights}")
    async with aiohttp.ClientSession() as session:
        try:
            url = await server.start(session)
            body = {"model": "smollm2", "max_tokens": 32, "messages": [{"role": "user", "content": "Tell me a story."}]}
            for _ in range(requests):
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    await r.json()
        finally:
            rep = server.stop()
    return {"weights": weights, "rss_placed": rep.rss.get("placed"), "rss_after_requests": rep.rss.get("after_trace"),
            "start_to_placed_s": rep.all_placed_s, "exit_code": rep.exit_code}


def _print_rounds(rows: list[dict], r: int, streams: int) -> None:
    for row in rows:
        print(f"round {r + 1} {row['devices']:8} {row['weights']:9} batch-1 {row['batch1_tok_s']:5.1f} tok/s  "
              f"{streams} streams {row['streams_tok_s']:5.1f} tok/s  TTFT p50 {row['ttft_p50_s']:.2f} s "
              f"p99 {row['ttft_p99_s']:.2f} s  kernels {row['kernels_per_device']}  load {row['load_avg_1m']:.1f}",
              flush=True)


def _summary(rounds: list[list[dict]], cases: list[tuple[str, str]]) -> dict:
    """Per case: the median over rounds of each key and of its ratio to the first case in the same round."""
    out = {}
    for i, (d, w) in enumerate(cases):
        out[f"{d} {w}"] = {**{k: statistics.median(rd[i][k] for rd in rounds) for k in KEYS},
                           **{f"{k}_ratio": statistics.median(rd[i][k] / rd[0][k] for rd in rounds) for k in KEYS}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployments", default="cpu", help="';' between deployments (device lists)")
    ap.add_argument("--weights", default="dense;quantized", help="';' between weight forms (dense, quantized)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10, help="kernel breakdown: repetitions")
    ap.add_argument("--rss", action="store_true", help="also the resident memory of tessera serve per weight form")
    ap.add_argument("--out", default="benchmarks/results/cpu_step/cpu_step.json")
    a = ap.parse_args()
    cases = [(d, w) for d in a.deployments.split(";") if d for w in a.weights.split(";") if w]
    rounds = []
    for r in range(a.rounds):
        rounds.append([asyncio.run(serve_round(d, w, a.tokens, a.streams)) for d, w in cases])
        _print_rounds(rounds[-1], r, a.streams)
    summary = _summary(rounds, cases) if rounds else {}
    parts = [kernel_breakdown("decode:1@0~512", w, a.reps) for w in dict.fromkeys(w for _, w in cases)]
    rss = [asyncio.run(server_rss(w)) for w in dict.fromkeys(w for _, w in cases)] if a.rss else []
    if summary:
        print(f"\n{'case':18} {'batch-1 tok/s':>14} {'streams tok/s':>14} {'TTFT p99':>12}   (median; ratio to "
              f"{cases[0][0]} {cases[0][1]} in the same round)")
    for case, m in summary.items():
        print(f"{case:18} {m['batch1_tok_s']:8.1f} x{m['batch1_tok_s_ratio']:.2f} {m['streams_tok_s']:8.1f} "
              f"x{m['streams_tok_s_ratio']:.2f} {m['ttft_p99_s']:6.2f} s x{m['ttft_p99_s_ratio']:.2f}")
    for p in parts:
        print(f"\nbatch-1 decode step, one device, {p['weights']} ({p['threads']} threads): {p['kernels']} kernels, "
              f"loop {p['loop_s'] * 1e3:.1f} ms (min {p['loop_min_s'] * 1e3:.1f}) = in aten {p['in_aten_s'] * 1e3:.1f} "
              f"ms + dispatch {p['dispatch_s'] * 1e3:.1f} ms ({p['dispatch_per_kernel_us']:.1f} us a kernel); "
              f"weights {p['weight_bytes'] / 2**20:.0f} MiB")
        print("  top aten ops (ms/step):", {k: round(v * 1e3, 2) for k, v in p["top_ops_s"].items()})
    for m in rss:
        print(f"tessera serve --weights {m['weights']}: RSS placed {m['rss_placed'] / 2**20:.0f} MiB, after requests "
              f"{m['rss_after_requests'] / 2**20:.0f} MiB")
    prov = provenance()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"git_commit": prov["git_commit"], "command": prov["command"], "provenance": prov,
                               "rounds": rounds, "summary": summary, "decode_step_breakdown": parts,
                               "server_rss": rss}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
