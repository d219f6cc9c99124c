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
* serving faults (kill -9 of one of two nodes under 8 concurrent streams,
  a bad token id rejected in < 100 ms) go through the serving engine:
  ``benchmarks/bench_serving_faults.py`` measures them; ``serving_faults``
  here is the hook that says so.

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
            "ok": all(e["exit_code"] == 3 for e in exits) and worst <= 10.0}


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


async def serving_faults(args) -> dict:
    """The serving-engine parts (kill -9 of one of two nodes under 8
    concurrent streams: all complete with identical tokens, stall <= 3 s; a
    bad token id rejected in < 100 ms, the service still serving) are
    measured through the public AsyncEngine by benchmarks/bench_serving_faults.py
    (issue 10); this program does not repeat them."""
    return {"skipped": "see benchmarks/bench_serving_faults.py (AsyncEngine)", "ok": None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--malformed", type=int, default=20000)
    ap.add_argument("--lease", type=float, default=7.0, help="node lease (--lease of the nodes), <= 10 s")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "reliability.json"))
    args = ap.parse_args()
    results = {}
    for name, part in (("flood", part_flood), ("scheduler_killed", part_scheduler_killed),
                       ("node_restarted", part_node_restarted), ("serving_faults", serving_faults)):
        t0 = time.perf_counter()
        results[name] = asyncio.run(part(args))
        results[name]["wall_s"] = time.perf_counter() - t0
    f, k, r = results["flood"], results["scheduler_killed"], results["node_restarted"]
    rows = [
        (f"{f['sent']} malformed messages to a live node", f"alive={f['alive_after']}, RSS "
         f"{f['rss_before'] / 2**20:.1f} -> {f['rss_after'] / 2**20:.1f} MiB ({100 * f['rss_growth']:+.2f} %), "
         f"{f['answers']} error answers, {f['seconds']:.1f} s", "alive, RSS growth < 5 %", f["ok"]),
        ("scheduler process killed (2 nodes)", ", ".join(f"{e['node']} exit {e['exit_code']} after "
                                                         f"{e['seconds']:.2f} s" for e in k["exits"]),
         f"lease {k['lease_s']:g} s + exit, <= 10 s", k["ok"]),
        ("node killed, restarted under its name", f"rejoined {r['rejoined_after_start_s']:.2f} s after its "
         f"ready line (process start {r['process_start_s']:.2f} s)", "rejoins", r["ok"]),
        ("serving: kill -9 under 8 streams; bad token id", results["serving_faults"]["skipped"], "(hook)", None),
    ]
    print(f"{'case':48} {'result':92} {'target':30} ok")
    for case, result, target, ok in rows:
        print(f"{case:48} {result:92} {target:30} {'-' if ok is None else ('yes' if ok else 'NO')}")
    results["provenance"] = {
        "git_commit": git_commit() or "unknown", "command": [sys.executable, *sys.argv], "date": datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_1min": os.getloadavg()[0]}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"wrote {args.out}")
    return 0 if all(ok is not False for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
