"""Node daemons launched by Ray, through the public AsyncEngine (a program, not a test).

Starts its own Ray cluster of ``--hosts`` nodes on loopback (``ray.cluster_utils``,
one CPU each, a small object store), then measures in one run:
  start        - AsyncEngine(ray=...) from the call to serving (Ray connect, capture,
                 daemons started in a placement group, every bucket placed), beside
                 the same engine on node processes it starts itself (nodes=...);
  kill -9      - ``--streams`` concurrent greedy streams; one daemon's process is
                 killed with SIGKILL: the longest gap between two tokens of any
                 stream across the kill (loss found, re-placed on the survivor,
                 every request re-prefilled);
  restart      - from the kill until Ray's restarted daemon serves again, and until
                 the engine has placed on it again (re-admission), with the longest
                 gap across that re-placement;
every stream must end with the tokens of a fault-free single-device run.
Prints a table and writes JSON (git commit, command line) to ``--json``.

  python benchmarks/bench_launch_ray.py --json benchmarks/results/launch_ray_cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # before ray: every address on loopback

from tessera_actors import AsyncEngine, SamplingParams  # noqa: E402
from tessera_actors.provenance import provenance  # noqa: E402


async def stream(eng, prompt, params, stamps: list) -> list[int]:
    toks = []
    async for out in eng.generate(prompt, params):
        toks += out.token_ids
        stamps += [time.perf_counter()] * len(out.token_ids)
    return toks


def longest_gap(stamps: list[list[float]], at: float) -> float | None:
    gaps = [next(t for t in s if t > at) - max(t for t in s if t <= at)
            for s in stamps if any(t <= at for t in s) and any(t > at for t in s)]
    return max(gaps) if gaps else None


async def run(a, address: str) -> dict:
    common = dict(model=a.model, size=a.size, max_seqs=a.streams, max_model_len=a.context)
    greedy = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    prompts = [f"Story {i}: the weather in the city was" for i in range(a.streams)]
    res: dict = {}
    async with AsyncEngine(devices="cpu", **common) as one:
        reference = await asyncio.gather(*(stream(one, p, greedy, []) for p in prompts))
    t0 = time.perf_counter()
    async with AsyncEngine(nodes=["cpu"] * a.hosts, **common):
        res["start_local_nodes_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    async with AsyncEngine(ray=address, **common) as eng:
        res["start_ray_s"] = time.perf_counter() - t0
        launcher = eng.deployment.launcher
        res["ray_connect_s"], res["ray_daemons_serving_s"] = launcher.connect_s, launcher.started_s
        stamps = [[] for _ in prompts]
        tasks = [asyncio.ensure_future(stream(eng, p, greedy, stamps[i])) for i, p in enumerate(prompts)]
        while min(len(s) for s in stamps) < a.tokens // 8:
            await asyncio.sleep(0.005)
        victim = await launcher.actors[-1].info.remote()
        killed = time.perf_counter()
        os.kill(victim.pid, signal.SIGKILL)
        async with eng.placement_changed:
            await asyncio.wait_for(eng.placement_changed.wait_for(lambda: victim.endpoint not in (
                eps := eng.deployment.node_endpoints()) and len(eps) == a.hosts), 300)
        readmitted = time.perf_counter()
        back = await launcher.actors[-1].info.remote()
        got = await asyncio.gather(*tasks)
        st = eng.stats()
    res.update(kill_stall_s=longest_gap(stamps, killed), readmitted_after_kill_s=readmitted - killed,
               readmission_stall_s=longest_gap(stamps, readmitted - 1e-3),
               restarted_pid_differs=back.pid != victim.pid, streams_identical=got == reference,
               recoveries=st["recoveries"], readmissions=st["readmissions"],
               daemon_restart_s=launcher.restarts)
    res.update(model=a.model, size=a.size, streams=a.streams, tokens=a.tokens, hosts=a.hosts,
               load_average=os.getloadavg(), **provenance())
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--hosts", type=int, default=2, help="Ray nodes of the loopback cluster (one daemon each)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    from ray.cluster_utils import Cluster
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 * 2 ** 20,
                                                             "include_dashboard": False})
    try:
        for _ in range(a.hosts - 1):
            cluster.add_node(num_cpus=1, object_store_memory=100 * 2 ** 20)
        cluster.wait_for_nodes()
        started = time.perf_counter() - t0
        res = asyncio.run(run(a, cluster.address))
    finally:
        cluster.shutdown()
    res["ray_cluster_start_s"] = started
    rows = [(f"Ray cluster of {a.hosts} nodes on loopback started", f"{res['ray_cluster_start_s']:.1f} s"),
            ("engine start, nodes=... (local node processes)", f"{res['start_local_nodes_s']:.1f} s"),
            ("engine start, ray=... (connect, capture, daemons, placement)", f"{res['start_ray_s']:.1f} s"),
            ("  of which: connecting to Ray", f"{res['ray_connect_s']:.1f} s"),
            ("  of which: placement groups ready, every daemon serving", f"{res['ray_daemons_serving_s']:.1f} s"),
            (f"stall after SIGKILL of 1 of {a.hosts} daemons ({a.streams} streams)", f"{res['kill_stall_s']:.2f} s"),
            ("death notice -> Ray's restarted daemon serving",
             ", ".join(f"{t:.2f} s" for t in res["daemon_restart_s"]) or "-"),
            ("kill -> restarted daemon re-admitted (placed on again)", f"{res['readmitted_after_kill_s']:.2f} s"),
            ("stall at the re-admission", f"{res['readmission_stall_s'] or 0:.2f} s"),
            ("streams identical to a fault-free single-device run", str(res["streams_identical"]))]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print(f"load average {res['load_average']}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["streams_identical"] and res["restarted_pid_differs"] else 1


if __name__ == "__main__":
    sys.exit(main())
