"""Prompt chunks pipelined over a split prompt plan, against one at a time.

Through ``AsyncEngine`` (the public API): the same deployment twice, the
prompt plan pipelined over its devices by the planner (``--planner layers``
by default), once with ``prompt_steps=1`` (one prompt-chunk step in flight,
the engine before #30 item 3) and once with ``prompt_steps=None`` (as many
as the prompt plan's micro-batches: what ``tessera advise``'s Tessera row
predicts).  Each round sends ``--prompts`` prompts of ``--prompt-len`` tokens
at once for one output token each (prefill-bound), and reports prompts/s and
the mean time to first token; the greedy first tokens of both must agree.

    python benchmarks/bench_prompt_pipeline.py [--devices cuda:0,cuda:1] [--model llama --size real]
        [--planner layers] [--prompts 32] [--prompt-len 512] [--rounds 5] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera_actors import AsyncEngine, SamplingParams  # noqa: E402
from tessera_actors.planning.inflight import prompt_inflight  # noqa: E402
from tessera_actors.provenance import provenance  # noqa: E402


async def _round(eng, prompts: list[list[int]]) -> tuple[float, float, list[list[int]]]:
    """(seconds, mean time to first token, the tokens) of ``prompts`` sent at once."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()

    async def one(p):
        toks = []
        async for out in eng.generate(p, params):
            toks += out.token_ids
        return time.perf_counter() - t0, toks
    got = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, statistics.mean(t for t, _ in got), [t for _, t in got]


async def _measure(args, prompt_steps: int | None, prompts: list[list[int]]) -> dict:
    cfg = dict(model=args.model, size=args.size, devices=args.devices, planner=args.planner,
               max_seqs=len(prompts), max_model_len=2 * args.prompt_len, decode_buckets=(1, len(prompts)),
               prefill_buckets=(args.prompt_len,), prefill_rows=(1,), prefix_caching=False, embeddings=False,
               prompt_steps=prompt_steps)
    async with AsyncEngine(**cfg) as eng:
        await eng.wait_placed()
        plan = eng.deployment.placed[f"prefill:{args.prompt_len}"].plan
        await _round(eng, prompts)   # warm: captures and first replays
        before = eng.stats()["pipelined_prompt_steps"]
        rounds = [await _round(eng, prompts) for _ in range(args.rounds)]
        pipelined = eng.stats()["pipelined_prompt_steps"] - before
    wall = statistics.median(r[0] for r in rounds)
    return {"prompt_steps": prompt_steps or prompt_inflight(plan), "plan": plan.name,
            "plan_microbatches": plan.microbatches, "kernels_per_device": plan.kernels_per_device(),
            "prompts_per_s": len(prompts) / wall, "median_round_s": wall,
            "mean_ttft_s": statistics.median(r[1] for r in rounds), "pipelined_prompt_steps": pipelined,
            "tokens": rounds[-1][2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu?threads=1,cpu?threads=1")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--planner", default="layers")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args()
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(args.prompt_len)] for i in range(args.prompts)]
    rows = [asyncio.run(_measure(args, steps, prompts)) for steps in (1, None)]
    print(f"{args.model} {args.size} on {args.devices}, planner {args.planner}, {args.prompts} prompts x "
          f"{args.prompt_len} tokens, 1 output token, median of {args.rounds} rounds")
    print(f"{'prompt steps in flight':<24}{'prompts/s':>11}{'TTFT ms':>9}{'pipelined':>11}  plan")
    for r in rows:
        print(f"{r['prompt_steps']:<24}{r['prompts_per_s']:>11.1f}{r['mean_ttft_s'] * 1e3:>9.1f}"
              f"{r['pipelined_prompt_steps']:>11}  {r['plan']} x{r['plan_microbatches']} {r['kernels_per_device']}")
    same = rows[0]["tokens"] == rows[1]["tokens"]
    print(f"pipelined / one at a time: {rows[1]['prompts_per_s'] / rows[0]['prompts_per_s']:.2f}x prompts/s; "
          f"first tokens {'equal' if same else 'DIFFER'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**provenance(), "rows": rows, "tokens_equal": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
