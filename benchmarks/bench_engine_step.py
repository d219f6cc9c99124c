"""Engine overhead and saturated throughput, through the public AsyncEngine.

For one model and one device set it measures, in one run:
  raw      - the execution core alone: back-to-back decode steps of the
             largest decode bucket sent straight to the placed plan
             (``Deployment.step``: one RunStep per device, sampling on the
             device), no engine loop, each sent once the previous one's
             tokens are back;
  raw ahead - the same steps, each sent while the previous one runs, its
             input tokens fed on the device from the previous step's samples
             (``Deployment.reserve`` + ``token_rows``, as the engine's lookahead
             does): the device's own rate (when the plan can feed tokens);
  engine   - the same bucket's decode steps while the engine serves a
             saturating trace (``max_seqs`` requests arrive at once,
             ``--prompt`` tokens each, ``--out`` tokens each), from the
             moment every prompt is prefilled (every KV slot busy): the wall
             time per decode step, engine loop included (the ratio's
             numerator), and the mean round trip of one step;
and the served output tokens/s of that trace.  Prints a table, writes JSON
(git commit, command line, machine) to ``--json``.

  python benchmarks/bench_engine_step.py --model llama --size real --layers 4 \\
      --dtype bfloat16 --devices cuda:0 --seqs 64 --context 2048     # one H200
  python benchmarks/bench_engine_step.py --model smollm2 --seqs 16 --context 1024   # CPU box
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import torch

from tessera_actors import AsyncEngine, SamplingParams
from tessera_actors.serving.loadgen_report import provenance


async def run(a) -> dict:
    overrides = {"n_layers": a.layers} if a.layers else {}
    eng = AsyncEngine(model=a.model, size=a.size, devices=a.devices, dtype=a.dtype, max_seqs=a.seqs,
                      max_model_len=a.context, decode_buckets=(a.seqs,), prefill_buckets=(a.prompt,),
                      mode="latency", overrides=overrides, lookahead=a.lookahead)
    t0 = time.perf_counter()
    await eng.start()
    started = time.perf_counter() - t0
    try:
        from tessera_actors.serving.deploy import bucket_name, window_for
        # the decode bucket the served trace runs at (its attention window covers prompt + output)
        bucket = bucket_name("decode", a.seqs, 0, window_for(eng.cfg, a.prompt + a.out))
        vocab = eng.served.vocab_size
        ids = torch.randint(0, vocab, (a.seqs, 1))
        pos = torch.full((a.seqs,), a.prompt, dtype=torch.int64)
        sample = [[r, 0, 0.0, 1.0, 0, 0, 0] for r in range(a.seqs)]
        inputs = {"input_ids": ids, "positions": pos}
        for _ in range(3):
            await eng.deployment.step(bucket, inputs, sample)

        async def raw_steps() -> list[float]:
            out = []
            for _ in range(a.steps):
                t = time.perf_counter()
                await eng.deployment.step(bucket, inputs, sample)
                out.append(time.perf_counter() - t)
            return out
        raw = await raw_steps()

        async def raw_ahead() -> float | None:
            rows = [[r, r] for r in range(a.seqs)]
            sent: list[asyncio.Future] = []
            prev = None
            t = time.perf_counter()
            for _ in range(a.steps):
                number = eng.deployment.reserve(bucket)
                if number is None:
                    return None   # the plan cannot feed tokens on a device
                sent.append(asyncio.ensure_future(eng.deployment.step(
                    bucket, inputs, sample, (), number, rows if prev is not None else [],
                    prev if prev is not None else -1)))
                prev = number
                if len(sent) >= 2:
                    await sent[-2]   # two in flight, as the engine keeps them
            await asyncio.gather(*sent)
            return (time.perf_counter() - t) / a.steps
        ahead = await raw_ahead()
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (a.prompt,), generator=gen).tolist() for _ in range(a.seqs)]
        params = SamplingParams(max_tokens=a.out, ignore_eos=True)

        prefilled = [asyncio.Event() for _ in prompts]
        snap = {}

        async def one(i, p):
            n = 0
            async for o in eng.generate(p, params):
                n += len(o.token_ids)
                if n == 1:
                    prefilled[i].set()
            return n

        async def steady():   # from the moment every prompt is in: decode steps only, all rows busy
            await asyncio.gather(*(e.wait() for e in prefilled))
            snap["steps"] = list(eng.step_time.get(bucket, [0, 0.0]))
            snap["t"] = time.perf_counter()
        t = time.perf_counter()
        made, _ = await asyncio.gather(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), steady())
        served_s = time.perf_counter() - t
        n0, s0 = snap["steps"]
        n1, s1 = eng.step_time[bucket]
        engine_step = (s1 - s0) / (n1 - n0)
        cadence = (time.perf_counter() - snap["t"]) / (n1 - n0)   # wall time per decode step, engine loop included
        raw += await raw_steps()   # before and after the served trace: the machine's drift shows in both
        raw_med = statistics.median(raw)
        res = {"model": a.model, "size": a.size, "layers": a.layers, "dtype": a.dtype, "devices": a.devices,
               "bucket": bucket, "start_s": started, "raw_step_s_median": raw_med, "raw_step_s_mean": statistics.mean(raw),
               "engine_step_s_mean": engine_step, "engine_step_cadence_s": cadence,
               "engine_over_raw": cadence / raw_med,
               "raw_ahead_step_s": ahead, "engine_over_raw_ahead": cadence / ahead if ahead else None,
               "lookahead": a.lookahead, "lookahead_steps": eng.stats()["lookahead_steps"],
               "served_output_tokens": sum(made), "served_s": served_s,
               "served_output_tok_s": sum(made) / served_s, "decode_steps": n1 - n0,
               "placement": eng.stats()["placement"], **provenance()}
    finally:
        await eng.stop()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--size", default="real")
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (0: the model's)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--out", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lookahead", type=int, default=1, help="EngineConfig.lookahead (0: each decode step "
                    "waits for the previous one's tokens)")
    ap.add_argument("--json", default="")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="sys.setswitchinterval for the run (a diagnostic of GIL hand-over; 0: Python's default)")
    a = ap.parse_args()
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    res = asyncio.run(run(a))
    res["switch_interval_s"] = sys.getswitchinterval()
    ahead = res["raw_ahead_step_s"]
    print(f"{'model':10} {'devices':18} {'bucket':12} {'raw step':>10} {'raw ahead':>10} {'engine step':>12} "
          f"{'/raw':>6} {'/ahead':>6} {'served tok/s':>12}")
    print(f"{a.model:10} {a.devices:18} {res['bucket']:12} {res['raw_step_s_median'] * 1e3:8.2f}ms "
          + (f"{ahead * 1e3:8.2f}ms " if ahead else f"{'-':>10} ")
          + f"{res['engine_step_cadence_s'] * 1e3:10.2f}ms {res['engine_over_raw']:6.3f} "
          + (f"{res['engine_over_raw_ahead']:6.3f} " if ahead else f"{'-':>6} ")
          + f"{res['served_output_tok_s']:12.1f}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
