"""``tessera serve``'s default CPU deployment, old against new (issue #33).

``old``: one ``cpu`` device at torch's thread count (every core), the
default before; ``new``: what ``tessera serve`` now chooses with no
``--devices`` (``flags.chosen_deployment``: every core but one, or with
3+ cores the count a start-up probe picks; chosen afresh in each round and
recorded with its reason and how long the choice took); ``--also`` adds explicit
device lists.  Each is served through ``AsyncEngine`` by
``bench_quant_serve.serve`` (SmolLM2-135M, ``weights="auto"``: quantized,
bfloat16 activations, as ``tessera serve``'s CPU default; 16 KV rows of
1024 tokens), in alternating rounds (the box is shared: ratios within a
round are what count): batch-1 decode tok/s, idle TTFT of a fresh
prompt, ``--streams`` streams' output tok/s and TTFT, the load average
before each engine.

    PYTHONPATH=. python benchmarks/bench_cpu_threads.py --rounds 2 \\
        --out benchmarks/results/serve_cpu/cpu_threads_default.json
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quant_serve import KEYS, serve, write_summary  # noqa: E402

from tessera_actors.serving.flags import add_serve_arguments, chosen_deployment, engine_kwargs  # noqa: E402


def _chosen() -> dict:
    """What ``tessera serve`` with no device flags chooses now, and how long the choice took."""
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    a = p.parse_args([])
    t0 = time.perf_counter()
    chosen = chosen_deployment(a)
    took = time.perf_counter() - t0
    kw = engine_kwargs(a, None, chosen)
    return {"devices": kw["devices"], "why": chosen.why, "choice_s": took, "weights": kw["weights"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--also", default="", help="';' between extra device lists, e.g. 'cpu?threads=1'")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--ttft-tokens", type=int, default=290)
    ap.add_argument("--out", default="benchmarks/results/serve_cpu/cpu_threads_default.json")
    a = ap.parse_args()
    names = ["old", "new"] + [d for d in a.also.split(";") if d]
    rounds = []
    for r in range(a.rounds):
        rows = []
        for name in names:
            choice = _chosen() if name == "new" else None
            devices = {"old": "cpu", "new": choice["devices"] if choice else ""}.get(name, name)
            row = asyncio.run(serve(devices, "auto", a.tokens, a.streams, a.ttft_tokens))
            row["row"], row["choice"] = name, choice
            rows.append(row)
            print(f"round {r + 1} {name:14} {devices:14} load {row['load_avg_1m']:4.2f}  batch-1 "
                  f"{row['batch1_tok_s']:5.1f} tok/s  TTFT {a.ttft_tokens} tokens {row['ttft_fresh_s']:5.2f} s  "
                  f"{a.streams} streams {row['streams_tok_s']:6.1f} tok/s, TTFT p50 {row['ttft_p50_s']:5.2f} s "
                  f"p99 {row['ttft_p99_s']:5.2f} s" + (f"  [chose in {choice['choice_s']:.2f} s: {choice['why']}]"
                                                       if choice else ""), flush=True)
        rounds.append(rows)
    summary = {}
    print(f"\n{'row':14} " + " ".join(f"{k:>20}" for k in KEYS) + "   (median; x: row/old per round)")
    for i, name in enumerate(names):
        med = {k: statistics.median(rd[i][k] for rd in rounds) for k in KEYS}
        ratio = {k: statistics.median(rd[i][k] / rd[0][k] for rd in rounds) for k in KEYS}
        summary[name] = {"median": med, "ratio_to_old": ratio}
        print(f"{name:14} " + " ".join(f"{med[k]:12.2f} x{ratio[k]:6.2f}" for k in KEYS))
    write_summary(a.out, rounds, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
