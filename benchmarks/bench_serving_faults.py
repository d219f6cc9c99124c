"""Serving under faults and at idle, through the public AsyncEngine, on node
processes (a program, not a test).

Measures, in one run:
  idle TTFT   - time to first token of a 290-token prompt on an idle engine:
                one in-process device with every core, and the two nodes;
  kill stall  - ``--streams`` concurrent greedy streams on two node
                processes; one node is killed with SIGKILL mid-stream; the
                stall is the longest gap between two tokens of any stream
                across the kill (failure detection + re-placement + the
                re-prefill of every running request); every stream must end
                with the tokens of a fault-free run;
  bad input   - a token id outside the vocabulary is refused (how fast), and
                the engine still serves afterwards.
Prints a table and writes JSON (git commit, command line) to ``--json``.

  python benchmarks/bench_serving_faults.py --model smollm2 --size real --json benchmarks/results/serving_faults_cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

from tessera_actors import AsyncEngine, SamplingParams
from tessera_actors.serving import InvalidRequest
from tessera_actors.provenance import provenance


async def stream(eng, prompt, params, stamps: list | None = None) -> list[int]:
    toks = []
    async for out in eng.generate(prompt, params):
        toks += out.token_ids
        if stamps is not None and out.token_ids:
            stamps.append(time.perf_counter())
    return toks


async def idle_ttft(eng, prompt, times: int = 3) -> list[float]:
    out = []
    for _ in range(times):
        t0 = time.perf_counter()
        async for _out in eng.generate(prompt, SamplingParams(max_tokens=1)):
            pass
        out.append(time.perf_counter() - t0)
    return out


async def run(a) -> dict:
    nodes = [f"cpu?threads={a.threads}"] * 2
    common = dict(model=a.model, size=a.size, max_seqs=max(a.streams, 1), max_model_len=a.context)
    detector = dict(watch_processes=a.detector == "exit")
    greedy = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
    res: dict = {}
    async with AsyncEngine(devices=",".join(nodes[:1]), **common) as one:   # fault-free reference, one device
        prompts = [one.tokenizer.encode(f"Story {i}: the weather in the city was") if one.tokenizer else
                   [i + 1, 2, 3, 4, 5] for i in range(a.streams)]
        reference = await asyncio.gather(*(stream(one, p, greedy) for p in prompts))
        long_prompt = (one.tokenizer.encode(" ".join(["word"] * 400)) if one.tokenizer else list(range(1, 400)))[:290]
    async with AsyncEngine(devices="cpu", **common) as whole:   # one device with every core
        await whole.wait_placed()   # idle: every prompt-chunk bucket placed
        res["idle_ttft_290_one_device_s_all"] = await idle_ttft(whole, long_prompt)
        res["idle_ttft_290_one_device_s"] = min(res["idle_ttft_290_one_device_s_all"])
    async with AsyncEngine(nodes=nodes, **common, **detector) as eng:
        await eng.wait_placed()
        res["idle_ttft_290_s_all"] = await idle_ttft(eng, long_prompt)
        res["idle_ttft_290_s"] = min(res["idle_ttft_290_s_all"])
        stamps = [[] for _ in prompts]
        tasks = [asyncio.ensure_future(stream(eng, p, greedy, stamps[i])) for i, p in enumerate(prompts)]
        while min(len(s) for s in stamps) < a.tokens // 3:
            await asyncio.sleep(0.01)
        victim = eng.deployment.cluster.nodes[1].proc
        killed = time.perf_counter()
        os.kill(victim.pid, signal.SIGKILL)
        got = await asyncio.gather(*tasks)
        gaps = []
        for s in stamps:
            before = [t for t in s if t <= killed]
            after = [t for t in s if t > killed]
            if before and after:
                gaps.append(after[0] - before[-1])
        res["kill_stall_s"] = max(gaps) if gaps else None
        res["kill_first_token_after_s"] = min(s2[0] for s2 in ([t for t in s if t > killed] for s in stamps) if s2) - killed
        res["kill_streams_identical"] = got == reference
        res["kill_recoveries"] = eng.stats()["recoveries"]
        t0 = time.perf_counter()
        try:
            await stream(eng, [10 ** 9], SamplingParams(max_tokens=2))
            res["bad_token_refused"] = False
        except InvalidRequest:
            res["bad_token_refused"] = True
        res["bad_token_refused_in_s"] = time.perf_counter() - t0
        res["serves_after"] = len(await stream(eng, prompts[0], SamplingParams(max_tokens=3))) == 3
    res.update(model=a.model, size=a.size, streams=a.streams, tokens=a.tokens, nodes=nodes, detector=a.detector,
               **provenance())
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--size", default="real")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--detector", default="ping", choices=["ping", "exit"],
                    help="ping: heartbeat pings alone (0.25 s, lost after 1.0 s, or at once when a late node's "
                         "port refuses a connection), as for nodes on other machines; "
                         "exit: also the exit of the node processes the engine started")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    res = asyncio.run(run(a))
    rows = [("idle TTFT, 290-token prompt, one device (every core)", f"{res['idle_ttft_290_one_device_s'] * 1e3:.0f} ms"),
            (f"idle TTFT, 290-token prompt, two nodes (cpu?threads={a.threads} each)",
             f"{res['idle_ttft_290_s'] * 1e3:.0f} ms"),
            (f"stall after kill -9 of 1 of 2 nodes ({a.streams} streams, detector {a.detector})",
             f"{res['kill_stall_s'] * 1e3:.0f} ms"),
            ("streams identical to a fault-free run", str(res["kill_streams_identical"])),
            ("bad token id refused", f"{res['bad_token_refused']} in {res['bad_token_refused_in_s'] * 1e3:.1f} ms"),
            ("serving after all that", str(res["serves_after"]))]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    ok = res["kill_streams_identical"] and res["bad_token_refused"] and res["serves_after"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
