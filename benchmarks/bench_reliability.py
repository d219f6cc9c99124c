"""Reliability benchmark: what faults and hostile input do to live node daemons.

    python benchmarks/bench_reliability.py [--malformed 20000] [--lease 8]

Parts, each against real node processes (``LocalCluster``, authenticated as
by default):

* flood: ``--malformed`` malformed messages (random bytes, mutated valid
  messages, deep nesting, huge declared sizes; the codec fuzz generators)
  from an authenticated peer to a live node; the node must stay alive and
  answer, its RSS must grow < 5 %;
* scheduler killed: a scheduler process (kill -9) with two registered
  nodes; each node must leave after its lease (``--lease``, default 7 s)
  and its process be gone within 10 s of the kill;
* node restarted: a registered node killed (kill -9) and started again
  under its name must rejoin the scheduler;
* pauses (issue 27), through the public ``AsyncEngine`` on two node
  daemons (``--model``/``--size``, default smollm2 tiny, 6 greedy streams):
  a 2 s SIGSTOP of each node in turn, a 10 s SIGSTOP, and a kill -9 of one
  node, each under a fresh wave of streams.  Per fault: every stream must
  end with the tokens of a fault-free run (``lost_tokens`` counts the
  differences), the stall (the longest gap between two tokens of a stream
  after the fault began: failover and re-admission) <= 3 s, and a paused
  node back in service (``health()["lost"]`` empty, both nodes placed);
  ``--runs`` times (default 3), the 1-minute load average beside each;
* serving faults at real size (kill -9 under 8 streams, a bad token id) are
  ``benchmarks/bench_serving_faults.py``'s.

Prints a table and writes JSON (git commit, command line, machine, date) to
``benchmarks/results/reliability.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "security"))

import zmq  # noqa: E402

import fuzz_codec_main as fuzz  # noqa: E402
from tessera_actors import AsyncEngine, SamplingParams  # noqa: E402
from tessera_actors.cluster import LocalCluster  # noqa: E402
from tessera_actors.provenance import git_commit  # noqa: E402
from tessera_actors.runtime.messages import GetStats, Ping, Pong  # noqa: E402
from transport.system import ActorSystem  # noqa: E402
from transport import auth, codec  # noqa: E402
from transport.codec import OP_ASK, Envelope  # noqa: E402

SCHEDULER = textwrap.dedent("""
    import asyncio, sys
    from actors.scheduler import SchedulerActor
    from tessera_actors.plan import ContiguousPlanner
    from transport.system import ActorSystem

    async def main():
        async with ActorSystem("scheduler-process") as system:
            await system.spawn(SchedulerActor(ContiguousPlanner()), "scheduler")
            print(await system.listen(), flush=True)
            await asyncio.Event().wait()

    asyncio.run(main())
""")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def malformed(rng: random.Random, valid: list) -> list:
    roll = rng.random()
    if roll < 0.3:
        frames = fuzz.random_input(rng)
    elif roll < 0.8:
        frames = fuzz.mutate(rng, rng.choice(valid))
    elif roll < 0.9:
        frames = fuzz.deep_inputs(rng)
    else:
        frames = fuzz.huge_inputs(rng)
    return frames or [b""]   # ZeroMQ cannot send a message of no frames


def flood_node(endpoint: str, keys, count: int, seed: int) -> dict:
    """Send ``count`` malformed messages (asks to the node actor) on one
    authenticated socket, draining answers as they come (blocking; run in a thread)."""
    rng = random.Random(seed)
    valid = [codec.encode(Ping(b"p" * 64), Envelope(OP_ASK, 9, "node"))] + fuzz.valid_messages()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    auth.secure_client(sock, keys)
    sock.connect(endpoint)
    answers = 0
    t0 = time.perf_counter()
    try:
        for i in range(count):
            sock.send_multipart(malformed(rng, valid), copy=False)
            if i % 200 == 199:
                while sock.poll(0):
                    sock.recv_multipart()
                    answers += 1
        sock.send_multipart(codec.encode(Ping(b"still there?"), Envelope(OP_ASK, 1 << 40, "node")))
        alive = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sock.poll(int((deadline - time.monotonic()) * 1000) + 1):
            frames = sock.recv_multipart()
            answers += 1
            try:
                env, value = codec.decode(frames)
            except Exception:
                continue
            if env.request_id == 1 << 40:
                alive = value == Pong(b"still there?")
                break
    finally:
        sock.close()
        ctx.term()
    return {"sent": count, "answers": answers, "alive": alive, "seconds": time.perf_counter() - t0}


async def part_flood(args) -> dict:
    async with ActorSystem("bench") as system, LocalCluster(["cpu"]) as cluster:
        node = cluster.nodes[0]
        warm = await asyncio.to_thread(flood_node, node.endpoint, system.keys, 2000, 1)   # allocator warm-up
        rss0 = rss_bytes(node.proc.pid)
        flood = await asyncio.to_thread(flood_node, node.endpoint, system.keys, args.malformed, 2)
        rss1 = rss_bytes(node.proc.pid)
        ref = await system.remote_ref(node.endpoint, "node")
        pong = await ref.ask(Ping(b"after"), timeout=10) == Pong(b"after")
    growth = (rss1 - rss0) / rss0
    return {**flood, "warmup_alive": warm["alive"], "rss_before": rss0, "rss_after": rss1,
            "rss_growth": growth, "alive_after": flood["alive"] and pong and node.exit_code == 0,
            "ok": flood["alive"] and pong and growth < 0.05}


async def _wait_registered(system, address: str, names: list[str], endpoints: dict | None = None,
                           timeout: float = 60.0) -> float:
    """Poll the scheduler's stats until ``names`` are registered and not lost (at ``endpoints`` if given)."""
    sched = await system.remote_ref(address, "scheduler")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while loop.time() - t0 < timeout:
        stats = (await sched.ask(GetStats(), timeout=10)).values
        seen = stats.get("endpoints", {})
        if (all(n in stats["nodes"] and n not in stats["lost"] for n in names)
                and all(seen.get(n) == ep for n, ep in (endpoints or {}).items())):
            return loop.time() - t0
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{names} did not register at {address} within {timeout} s")


async def part_scheduler_killed(args) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO}
    sched = subprocess.Popen([sys.executable, "-c", SCHEDULER], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        address = (await asyncio.to_thread(sched.stdout.readline)).strip()
        async with ActorSystem("bench") as system, LocalCluster(
                ["cpu", "cpu"], scheduler=address, node_args=["--lease", str(args.lease)]) as cluster:
            await _wait_registered(system, address, ["node0", "node1"])
            loop = asyncio.get_running_loop()
            sched.kill()
            killed = loop.time()
            exits = []
            for n in cluster.nodes:
                try:
                    rc = await asyncio.wait_for(n.proc.wait(), args.lease + 20)
                except asyncio.TimeoutError:
                    rc = None
                exits.append({"node": n.name, "exit_code": rc, "seconds": loop.time() - killed})
    finally:
        if sched.poll() is None:
            sched.kill()
        sched.wait()
    worst = max(e["seconds"] for e in exits)
    return {"lease_s": args.lease, "exits": exits, "worst_s": worst,
            "load_avg_1min": os.getloadavg()[0],
            "ok": all(e["exit_code"] == 3 for e in exits) and worst <= args.lease + 1.0}


async def part_node_restarted(args) -> dict:
    from actors.scheduler import SchedulerActor
    from tessera_actors.plan import ContiguousPlanner
    async with ActorSystem("bench") as system:
        await system.spawn(SchedulerActor(ContiguousPlanner()), "scheduler")
        address = await system.listen()
        async with LocalCluster(["cpu"], scheduler=address) as cluster:
            await _wait_registered(system, address, ["node0"])
            old = cluster.nodes[0]
            old.proc.kill()
            await old.proc.wait()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            again = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tessera_actors.node", "--devices", "cpu", "--name", "node0",
                "--scheduler", address, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
            try:
                line = (await asyncio.wait_for(again.stdout.readline(), 60)).decode().split()
                started = loop.time() - t0
                rejoin = await _wait_registered(system, address, ["node0"], {"node0": line[-1]}, timeout=30)
                stats = (await system.ref("scheduler").ask(GetStats())).values
            finally:
                again.send_signal(signal.SIGTERM)
                await again.wait()
    return {"process_start_s": started, "rejoined_after_start_s": rejoin, "nodes": stats["nodes"],
            "devices": stats["devices"], "ok": stats["nodes"] == ["node0"] and stats["devices"] == ["cpu"]}


PROMPTS = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(6)]


async def _stream(eng, prompt, params, stamps: list) -> list[int]:
    toks = []
    async for out in eng.generate(prompt, params):
        toks += out.token_ids
        stamps.extend([time.perf_counter()] * len(out.token_ids))
    return toks


async def _until(cond, timeout: float) -> float | None:
    """Seconds until ``cond()`` holds (polled every 20 ms), None past ``timeout``."""
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            return None
        await asyncio.sleep(0.02)
    return time.perf_counter() - t0


async def _fault(eng, reference, params, fault: str, node: int, seconds: float) -> dict:
    """One wave of streams; once each has 4 tokens, ``fault`` (pause | kill) node ``node``."""
    stamps = [[] for _ in PROMPTS]
    tasks = [asyncio.ensure_future(_stream(eng, p, params, stamps[i])) for i, p in enumerate(PROMPTS)]
    await _until(lambda: min(len(s) for s in stamps) >= 4, 120)
    info = eng.deployment.cluster.nodes[node]
    load = os.getloadavg()[0]
    began = time.perf_counter()
    if fault == "kill":
        info.proc.kill()
    else:
        os.kill(info.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(seconds)   # the pause itself
        os.kill(info.proc.pid, signal.SIGCONT)
    back = asyncio.ensure_future(_until(lambda: fault == "pause" and eng.health()["lost"] == [] and
                                        len(eng.stats()["placement"].get("devices", [])) == 2, 120 * (fault == "pause")))
    got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 600)
    back = await back
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if b > began]
    lost = sum(sum(x != y for x, y in zip(g, r)) + abs(len(g) - len(r)) if isinstance(g, list) else len(r)
               for g, r in zip(got, reference))
    ok = lost == 0 and max(gaps, default=0.0) <= 3.0 and (fault == "kill" or back is not None)
    return {"fault": fault, "node": f"node{node}", "seconds": seconds, "stall_s": max(gaps, default=None),
            "lost_tokens": lost, "streams_identical": lost == 0, "back_in_service_after_cont_s": back,
            "node_alive": info.proc.returncode is None, "load_avg_1min": load, "ok": ok}


async def part_pauses(args) -> dict:
    common = dict(model=args.model, size=args.size, max_seqs=8, max_model_len=512, decode_buckets=(1, 2, 4, 8),
                  prefill_buckets=(16, 64))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(devices="cpu", **common) as one:
        reference = await asyncio.gather(*(_stream(one, p, params, []) for p in PROMPTS))
    runs = []
    for run in range(args.runs):
        async with AsyncEngine(nodes=["cpu?threads=1"] * 2, watch_processes=False, **common) as eng:
            await eng.wait_placed()
            rows = [await _fault(eng, reference, params, "pause", 1, 2.0),
                    await _fault(eng, reference, params, "pause", 0, 2.0),
                    await _fault(eng, reference, params, "pause", 1, 10.0),
                    await _fault(eng, reference, params, "kill", 1, 0.0)]
            runs.append({"run": run, "rows": rows, "error": eng.health()["error"]})
    return {"model": args.model, "size": args.size, "streams": len(PROMPTS), "tokens": args.tokens, "runs": runs,
            "ok": all(r["ok"] for run in runs for r in run["rows"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--malformed", type=int, default=20000)
    ap.add_argument("--lease", type=float, default=7.0, help="node lease (--lease of the nodes), <= 10 s")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--tokens", type=int, default=400, help="greedy tokens per stream")
    ap.add_argument("--runs", type=int, default=3, help="runs of the pause and kill faults")
    ap.add_argument("--parts", default="flood,scheduler_killed,node_restarted,pauses")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "reliability.json"))
    args = ap.parse_args()
    parts = {"flood": part_flood, "scheduler_killed": part_scheduler_killed, "node_restarted": part_node_restarted,
             "pauses": part_pauses}
    results = {}
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        results[name] = asyncio.run(parts[name](args))
        results[name]["wall_s"] = time.perf_counter() - t0
    rows = table_rows(results)
    print(f"{'case':44} {'result':100} {'target':26} ok")
    for case, result, target, ok in rows:
        print(f"{case:44} {result:100} {target:26} {'yes' if ok else 'NO'}")
    results.update(git_commit=git_commit(), command=[sys.executable, *sys.argv], date=datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"),
        machine={"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                 "load_avg_1min": os.getloadavg()[0]})
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"wrote {args.out}")
    return 0 if all(ok for *_, ok in rows) else 1


def table_rows(results: dict) -> list[tuple]:
    rows = []
    if "flood" in results:
        f = results["flood"]
        rows.append((f"{f['sent']} malformed messages to a live node", f"alive={f['alive_after']}, RSS "
                     f"{f['rss_before'] / 2**20:.1f} -> {f['rss_after'] / 2**20:.1f} MiB "
                     f"({100 * f['rss_growth']:+.2f} %), {f['answers']} error answers, {f['seconds']:.1f} s",
                     "alive, RSS growth < 5 %", f["ok"]))
    if "scheduler_killed" in results:
        k = results["scheduler_killed"]
        rows.append(("engine (scheduler) process killed, 2 nodes", ", ".join(
            f"{e['node']} exit {e['exit_code']} after {e['seconds']:.2f} s" for e in k["exits"])
            + f" (load {k['load_avg_1min']:.1f})", f"exit <= lease {k['lease_s']:g} + 1 s", k["ok"]))
    if "node_restarted" in results:
        r = results["node_restarted"]
        rows.append(("node killed, restarted under its name", f"rejoined {r['rejoined_after_start_s']:.2f} s "
                     f"after its ready line (process start {r['process_start_s']:.2f} s)", "rejoins", r["ok"]))
    for run in results.get("pauses", {}).get("runs", []):
        for x in run["rows"]:
            what = f"{x['seconds']:g} s SIGSTOP of {x['node']}" if x["fault"] == "pause" else f"kill -9 of {x['node']}"
            back = (f", back in service {x['back_in_service_after_cont_s']:.2f} s after SIGCONT"
                    if x["back_in_service_after_cont_s"] is not None else (", NOT back" if x["fault"] == "pause"
                                                                           else ""))
            rows.append((f"run {run['run']}: {what}", f"stall {x['stall_s']:.2f} s, {x['lost_tokens']} tokens lost, "
                         f"identical={x['streams_identical']}{back} (load {x['load_avg_1min']:.1f})",
                         "stall <= 3 s, 0 lost, back", x["ok"]))
    return rows


if __name__ == "__main__":
    sys.exit(main())
