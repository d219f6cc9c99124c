"""Messaging benchmark: ask round trips in-process and across processes, and
64 MiB tensor-frame throughput across processes (tcp loopback).

    python benchmarks/bench_messaging.py [--rounds 5000] [--frames 40]

Prints a table with the targets and writes benchmarks/results/messaging.json.
The second process is this program run with ``--serve``; it hosts the echo
actor and prints its address.  Everything runs under uvloop.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time

import uvloop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tessera_actors.actor import Actor, handler  # noqa: E402
from tessera_actors.messages import Ok, Ping, Pong, message  # noqa: E402
from tessera_actors.system import ActorSystem  # noqa: E402

TARGETS = {"in_process_p50_us": 20.0, "cross_process_p50_us": 150.0, "frames_64mib_gbps": 1.5}
FRAME_BYTES = 64 << 20


@message
class BenchTensor:
    tensor: object = None


class Echo(Actor):
    mailbox_size = 64

    @handler(Ping)
    def ping(self, msg):
        return Pong(msg.payload)

    @handler(BenchTensor)
    def take(self, msg):
        return Ok(str(msg.tensor.nbytes))   # received (decoded zero-copy), not sent back


def percentiles(samples: list[float]) -> dict:
    samples = sorted(samples)
    pick = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))] * 1e6  # noqa: E731
    return {"p50_us": round(pick(0.50), 2), "p99_us": round(pick(0.99), 2), "n": len(samples)}


async def round_trips(ref, rounds: int) -> dict:
    ping = Ping()
    for _ in range(min(500, rounds)):   # warm-up
        await ref.ask(ping)
    clock, samples = time.perf_counter, []
    for _ in range(rounds):
        start = clock()
        await ref.ask(ping)
        samples.append(clock() - start)
    return percentiles(samples)


async def frame_throughput(ref, count: int, window: int, trials: int) -> dict:
    """``trials`` runs of ``count`` 64 MiB asks (``window`` in flight); the
    median trial is the result (the machine may be shared)."""
    import torch
    tensor = torch.ones(FRAME_BYTES // 4)
    msg = BenchTensor(tensor)
    for _ in range(3):
        await ref.ask(msg, timeout=30)
    runs = sorted([await _frames_once(ref, msg, count, window) for _ in range(trials)])
    gbps = [round(count * FRAME_BYTES / seconds / 1e9, 3) for seconds in runs]
    return {"frames_per_trial": count, "frame_bytes": FRAME_BYTES, "window": window,
            "trial_gbps": gbps, "gbps": gbps[len(gbps) // 2], "best_gbps": max(gbps)}


async def _frames_once(ref, msg, count: int, window: int) -> float:
    start = time.perf_counter()
    pending: set = set()
    for _ in range(count):
        pending.add(asyncio.ensure_future(ref.ask(msg, timeout=30)))
        if len(pending) >= window:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                fut.result()
    for fut in pending:
        await fut
    return time.perf_counter() - start


async def serve(recycle: bool) -> None:
    if recycle:
        from transport.tuning import recycle_receive_buffers
        recycle_receive_buffers()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with ActorSystem("bench-server") as system:
        await system.spawn(Echo(), "echo")
        print(await system.listen("tcp://127.0.0.1:0"), flush=True)
        await stop.wait()


async def run(args) -> dict:
    results: dict = {}
    async with ActorSystem("bench") as system:
        local = await system.spawn(Echo(), "echo")
        results["in_process"] = await round_trips(local, args.rounds)
        async with _server_process(system) as remote:
            results["cross_process"] = await round_trips(remote, args.rounds)
            results["frames_64mib"] = await frame_throughput(remote, args.frames, args.window, args.trials)
        async with _server_process(system, "--recycle") as remote:
            results["frames_64mib_recycled"] = await frame_throughput(
                remote, args.frames, args.window, args.trials)
    return results


@contextlib.asynccontextmanager
async def _server_process(system: ActorSystem, *flags: str):
    """This program run with --serve in a second process; yields a ref to its echo actor."""
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", *flags],
                             stdout=subprocess.PIPE, text=True)
    try:
        address = (await asyncio.to_thread(child.stdout.readline)).strip()
        yield await system.remote_ref(address, "echo")
    finally:
        child.terminate()
        if await asyncio.to_thread(child.wait, 10) != 0:
            raise RuntimeError(f"echo server exited with {child.returncode}")


def report(results: dict) -> list[tuple]:
    rows = [
        ("in-process ask round trip", results["in_process"]["p50_us"], results["in_process"]["p99_us"],
         "us", f"p50 <= {TARGETS['in_process_p50_us']:g}",
         results["in_process"]["p50_us"] <= TARGETS["in_process_p50_us"]),
        ("cross-process ask round trip (tcp)", results["cross_process"]["p50_us"],
         results["cross_process"]["p99_us"], "us", f"p50 <= {TARGETS['cross_process_p50_us']:g}",
         results["cross_process"]["p50_us"] <= TARGETS["cross_process_p50_us"]),
    ]
    for key, label in (("frames_64mib", "64 MiB frames, default malloc"),
                       ("frames_64mib_recycled", "64 MiB frames, recycled buffers")):
        gbps = results[key]["gbps"]
        rows.append((label, gbps, None, "GB/s", f">= {TARGETS['frames_64mib_gbps']:g}",
                     gbps >= TARGETS["frames_64mib_gbps"]))
    print(f"{'measurement':<38}{'p50 / rate':>12}{'p99':>10}  {'unit':<6}{'target':<12}{'met'}")
    for name, value, p99, unit, target, met in rows:
        p99_text = f"{p99:.1f}" if p99 is not None else "-"
        print(f"{name:<38}{value:>12.2f}{p99_text:>10}  {unit:<6}{target:<12}{'yes' if met else 'NO'}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="run as the echo server (internal)")
    parser.add_argument("--recycle", action="store_true",
                        help="server: recycle receive buffers (transport.tuning, internal)")
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--frames", type=int, default=20, help="64 MiB frames per trial")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--window", type=int, default=1, help="64 MiB asks in flight")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "messaging.json"))
    args = parser.parse_args()
    if args.serve:
        uvloop.run(serve(args.recycle))
        return
    load_before = os.getloadavg()[0]
    results = uvloop.run(run(args))
    rows = report(results)
    results["targets"] = TARGETS
    results["all_targets_met"] = all(row[-1] for row in rows[:2]) and any(row[-1] for row in rows[2:])
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform(),
                          "load_avg_1min_before_after": [load_before, os.getloadavg()[0]]}
    print(f"machine: {os.cpu_count()} CPUs, 1-min load average {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after (other processes share these cores)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
