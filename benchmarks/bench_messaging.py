"""Messaging benchmark: ask round trips in-process and across processes, and
64 MiB tensor-frame throughput across processes (tcp loopback), through the
shared-memory path (same host, the default) and as pure ZeroMQ frames.

    python benchmarks/bench_messaging.py [--rounds 5000] [--frames 20] [--trials 3] [--window 1]

Prints a table with the targets and writes benchmarks/results/messaging.json.
The second process is this program run with ``--serve``; it hosts the echo
actor and prints its address.  Everything runs under uvloop.

Frame throughput is bounded on small VMs by the receiver's page faults: ZeroMQ
allocates a fresh buffer per message, i.e. 16k first-touch faults per 64 MiB
frame.  So the same measurements are also taken with bare pyzmq (blocking
DEALER/ROUTER, no codec, no actors) in the same run: the ratio is the cost of
this stack, the bare numbers are the machine's floor.  The shared-memory path
(``transport.shm``) avoids those faults: the sender copies into a reused
segment and the receiver's tensor is a view of it.
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

from tessera_actors.runtime.actor import Actor, handler  # noqa: E402
from tessera_actors.runtime.messages import Ok, Ping, Pong, message  # noqa: E402
from transport.system import ActorSystem  # noqa: E402
from transport.shm import ShmConfig  # noqa: E402
from tessera_actors.provenance import provenance  # noqa: E402

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


def throughput(seconds: list[float], frames: int) -> dict:
    gbps = sorted(round(frames * FRAME_BYTES / s / 1e9, 3) for s in seconds)
    return {"frames_per_trial": frames, "frame_bytes": FRAME_BYTES, "trial_gbps": gbps,
            "gbps": gbps[len(gbps) // 2]}


async def ask_samples(ref, rounds: int) -> list[float]:
    ping, clock, samples = Ping(), time.perf_counter, []
    for _ in range(rounds):
        start = clock()
        await ref.ask(ping)
        samples.append(clock() - start)
    return samples


async def frames_seconds(ref, msg, count: int, window: int) -> float:
    """Seconds for ``count`` 64 MiB asks with ``window`` of them in flight."""
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


class BareClient:
    """Blocking bare-pyzmq DEALER (run it in a thread): the machine's floor."""

    def __init__(self, address: str):
        import zmq
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.big = memoryview(bytearray(FRAME_BYTES))

    def ask_samples(self, rounds: int) -> list[float]:
        clock, samples = time.perf_counter, []
        for _ in range(rounds):
            start = clock()
            self.sock.send_multipart([b"h", b"ping"])
            self.sock.recv()
            samples.append(clock() - start)
        return samples

    def frames_seconds(self, count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            self.sock.send_multipart([b"h", self.big], copy=False)
            self.sock.recv()
        return time.perf_counter() - start

    def close(self) -> None:
        self.sock.close()


def serve_raw() -> None:
    """Bare pyzmq echo: answers every message with one small frame."""
    import zmq
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    print(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}", flush=True)
    while not stop:
        if sock.poll(100):
            identity, *_ = sock.recv_multipart(copy=False)
            sock.send_multipart([identity, b"k"])
    sock.close()


async def serve() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with ActorSystem("bench-server") as system:
        await system.spawn(Echo(), "echo")
        print(await system.listen("tcp://127.0.0.1:0"), flush=True)
        await stop.wait()


async def run(args) -> dict:
    """Trials alternate between this stack (shared memory, pure ZeroMQ) and
    bare pyzmq, so all see the same machine load; medians over trials are
    reported."""
    import torch
    results: dict = {}
    async with ActorSystem("bench") as system, ActorSystem("bench-zmq", shm=ShmConfig(enabled=False)) as zsystem:
        local = await system.spawn(Echo(), "echo")
        await ask_samples(local, 500)
        results["in_process"] = percentiles(await ask_samples(local, args.rounds))
        async with _server_process() as address, _server_process("--serve-raw") as raw_address:
            remote = await system.remote_ref(address, "echo")
            remote_zmq = await zsystem.remote_ref(address, "echo")
            if not await remote._peer.shm_ready():
                raise RuntimeError("shared-memory handshake with the server failed")
            bare = BareClient(raw_address)
            msg = BenchTensor(torch.ones(FRAME_BYTES // 4))
            await ask_samples(remote, 500)
            await asyncio.to_thread(bare.ask_samples, 500)
            await frames_seconds(remote, msg, 2, 1)
            await frames_seconds(remote_zmq, msg, 2, 1)
            await asyncio.to_thread(bare.frames_seconds, 2)
            ours_rt, bare_rt, shm_s, zmq_s, bare_s = [], [], [], [], []
            for _ in range(args.trials):
                ours_rt += await ask_samples(remote, args.rounds // args.trials)
                bare_rt += await asyncio.to_thread(bare.ask_samples, args.rounds // args.trials)
                shm_s.append(await frames_seconds(remote, msg, args.frames, args.window))
                zmq_s.append(await frames_seconds(remote_zmq, msg, args.frames, args.window))
                bare_s.append(await asyncio.to_thread(bare.frames_seconds, args.frames))
            bare.close()
        results["cross_process"] = percentiles(ours_rt)
        results["frames_64mib"] = {**throughput(shm_s, args.frames), "window": args.window, "path": "shm"}
        results["frames_64mib_zmq"] = {**throughput(zmq_s, args.frames), "window": args.window, "path": "zmq"}
        results["bare_pyzmq"] = {"round_trip": percentiles(bare_rt), **throughput(bare_s, args.frames)}
    return results


@contextlib.asynccontextmanager
async def _server_process(mode: str = "--serve"):
    """This program run with ``mode`` in a second process; yields its address
    (its echo actor is named "echo")."""
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), mode],
                             stdout=subprocess.PIPE, text=True)
    try:
        yield (await asyncio.to_thread(child.stdout.readline)).strip()
    finally:
        child.terminate()
        try:
            code = await asyncio.to_thread(child.wait, 10)
        except subprocess.TimeoutExpired:
            child.kill()
            raise RuntimeError(f"{mode} server did not exit on SIGTERM") from None
        if code != 0:
            raise RuntimeError(f"{mode} server exited with {code}")


def report(results: dict) -> list[tuple]:
    """Print the table; returns (name, value, target_met) rows."""
    bare = results["bare_pyzmq"]
    rows = [
        ("in-process ask round trip", results["in_process"], None, "us", "p50 <= 20",
         results["in_process"]["p50_us"] <= TARGETS["in_process_p50_us"]),
        ("cross-process ask round trip (tcp)", results["cross_process"], bare["round_trip"], "us", "p50 <= 150",
         results["cross_process"]["p50_us"] <= TARGETS["cross_process_p50_us"]),
        ("64 MiB tensors cross-process (shm)", results["frames_64mib"], bare, "GB/s", ">= 1.5",
         results["frames_64mib"]["gbps"] >= TARGETS["frames_64mib_gbps"]),
        ("64 MiB tensors cross-process (zmq)", results["frames_64mib_zmq"], bare, "GB/s", "(info)",
         None),
    ]
    print(f"{'measurement':<36}{'p50|rate':>10}{'p99':>9}{'bare zmq':>10}{'ratio':>7}  {'unit':<5}{'target':<11}met")
    for name, ours, base, unit, target, met in rows:
        key = "gbps" if unit == "GB/s" else "p50_us"
        value = ours[key]
        p99 = f"{ours['p99_us']:.1f}" if "p99_us" in ours else "-"
        base_text = f"{base[key]:.2f}" if base else "-"
        ratio = f"{value / base[key]:.2f}" if base else "-"
        met_text = "-" if met is None else "yes" if met else "NO"
        print(f"{name:<36}{value:>10.2f}{p99:>9}{base_text:>10}{ratio:>7}  {unit:<5}{target:<11}{met_text}")
    return [(name, ours, met) for name, ours, _, _, _, met in rows if met is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="run as the echo server (internal)")
    parser.add_argument("--serve-raw", action="store_true", help="run as the bare pyzmq server (internal)")
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--frames", type=int, default=20, help="64 MiB frames per trial")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--window", type=int, default=1, help="64 MiB asks in flight")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "messaging.json"))
    args = parser.parse_args()
    if args.serve:
        uvloop.run(serve())
        return
    if args.serve_raw:
        serve_raw()
        return
    load_before = os.getloadavg()[0]
    results = uvloop.run(run(args))
    rows = report(results)
    results["targets"] = TARGETS
    results["all_targets_met"] = all(row[-1] for row in rows)
    results.update(provenance())
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
