"""Dense float32 against quantized weights, served (issue #33).

Through ``AsyncEngine`` (what ``tessera serve`` runs), SmolLM2-135M with
``weights="dense"`` (the GGUF dequantised to float32) and
``weights="quantized"`` (its Q4_1/Q8_0 as int4/int8, bfloat16 activations),
on each deployment of ``--deployments``, in alternating rounds (the box is
shared: ratios within a round are what count; ``cpu?threads=1`` has no
OpenMP barrier for another process's load to stretch):

* batch-1 decode: one stream of ``--tokens`` greedy tokens; the time per
  output token after the first is the interval between decode steps;
* idle TTFT of a fresh prompt of ``--ttft-tokens`` tokens (the issue's ~290);
* ``--streams`` prompts of 40 tokens sent at once, ``--tokens`` tokens each:
  output tok/s, TTFT p50/p99;
* the weights' bytes and the load average before each engine.

    PYTHONPATH=. python benchmarks/bench_quant_serve.py --out benchmarks/results/serve_cpu/quant_serve.json
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

from tessera_actors import AsyncEngine, SamplingParams
from tessera_actors.provenance import provenance

KEYS = ("batch1_tok_s", "batch1_step_ms", "ttft_fresh_s", "streams_tok_s", "ttft_p50_s", "ttft_p99_s")


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


async def serve(devices: str, weights: str, tokens: int, streams: int, ttft_tokens: int) -> dict:
    load = os.getloadavg()[0]
    async with AsyncEngine(model="smollm2", devices=devices, weights=weights, max_seqs=16, max_model_len=1024,
                           kv_cache_memory=None) as eng:
        await eng.wait_placed()
        prompt = list(range(1000, 1040))
        await _stream(eng, prompt, 4)   # warm
        first, total, got = await _stream(eng, prompt, tokens)
        step = (total - first) / max(got - 1, 1)
        fresh, _, _ = await _stream(eng, list(range(2000, 2000 + ttft_tokens)), 1)
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(_stream(eng, [t + 50 * i for t in prompt], tokens) for i in range(streams)))
        wall = time.perf_counter() - t0
        ttft = [r[0] for r in rs]
        return {"devices": devices, "weights": eng.cfg.weights, "dtype": eng.cfg.dtype,
                "weight_bytes": eng.served.weight_bytes, "load_avg_1m": load,
                "batch1_tok_s": 1 / step, "batch1_step_ms": step * 1e3, "ttft_fresh_s": fresh,
                "streams": streams, "streams_tok_s": sum(r[2] for r in rs) / wall,
                "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployments", default="cpu?threads=1;cpu", help="';' between deployments (device lists)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--ttft-tokens", type=int, default=290)
    ap.add_argument("--out", default="benchmarks/results/serve_cpu/quant_serve.json")
    a = ap.parse_args()
    runs = [(d, w) for d in a.deployments.split(";") if d for w in ("dense", "quantized")]
    rounds = []
    for r in range(a.rounds):
        rows = []
        for d, w in runs:
            row = asyncio.run(serve(d, w, a.tokens, a.streams, a.ttft_tokens))
            rows.append(row)
            print(f"round {r + 1} {d:14} {w:9} load {row['load_avg_1m']:4.2f}  batch-1 {row['batch1_tok_s']:5.1f} tok/s "
                  f"({row['batch1_step_ms']:6.1f} ms a step)  TTFT {a.ttft_tokens} tokens {row['ttft_fresh_s']:5.2f} s  "
                  f"{a.streams} streams {row['streams_tok_s']:6.1f} tok/s, TTFT p50 {row['ttft_p50_s']:5.2f} s "
                  f"p99 {row['ttft_p99_s']:5.2f} s  weights {row['weight_bytes'] / 2**20:.0f} MiB", flush=True)
        rounds.append(rows)
    summary = {}
    print(f"\n{'deployment':14} {'weights':9} " + " ".join(f"{k:>20}" for k in KEYS) + "   (median; x: quantized/dense per round)")
    for i, (d, w) in enumerate(runs):
        dense = runs.index((d, "dense"))
        med = {k: statistics.median(rd[i][k] for rd in rounds) for k in KEYS}
        ratio = {k: statistics.median(rd[i][k] / rd[dense][k] for rd in rounds) for k in KEYS}
        summary[f"{d} {w}"] = {"median": med, "ratio_to_dense": ratio}
        print(f"{d:14} {w:9} " + " ".join(f"{med[k]:12.2f} x{ratio[k]:6.2f}" for k in KEYS))
    write_summary(a.out, rounds, summary)
    return 0


def write_summary(path: str, rounds: list, summary: dict) -> None:
    """The rounds and their summary, with provenance, as JSON at ``path``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance(), "rounds": rounds, "summary": summary}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
