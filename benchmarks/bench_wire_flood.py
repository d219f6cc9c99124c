"""Unauthenticated connections against a node daemon: what they cost its memory.

    python benchmarks/bench_wire_flood.py [--connections 10000] [--under-limit 1000] [--runs 3]

A node daemon (``python -m tessera_actors.node``, started by ``LocalCluster``,
authenticated as by default) and a raw TCP attacker without keys that speaks
just enough ZMTP (a greeting naming CURVE) to reach the node's frame decoder.
Per run, three floods, each in batches of ``--batch`` connections (the
attacker's descriptors; each batch closed before the next):

* ``greeting``: ``--connections`` connections that send the greeting and stay;
* ``oversized``: ``--connections`` connections that declare a 1 GiB frame and
  send 64 KiB of it (refused at the header: ``ZMQ_MAXMSGSIZE``);
* ``under_limit``: ``--under-limit`` connections that each send a whole frame of
  ``wire.PIECE_BYTES`` (under the limit): bounded only by the connection gate,
  ``max_unproven`` frames at a time (``transport.gate``).

Per flood: the node's RSS before, its peak (sampled after every batch) and
growth (target < 64 MiB; for the third ``max_unproven * MAX_WIRE_FRAME``
is the part the frames may take), its peak descriptor count,
how many connections it shut, the worst round trip of an authenticated ping
sent after every batch (the node keeps serving), wall time and the 1-minute
load average beside it.  Prints a table; writes JSON (git commit, command,
machine, date) to ``--out``.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import resource
import select
import socket
import struct
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tessera_actors.cluster import LocalCluster
from tessera_actors.provenance import provenance
from tessera_actors.runtime.messages import Ping, Pong
from tessera_actors.serving.launch import rss_bytes
from transport import wire
from transport.gate import ConnectionLimits
from transport.system import ActorSystem

MiB = 1 << 20
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\0" + b"\0" * 31
LONG_MESSAGE = 0x02   # ZMTP frame flags: a message frame with an 8-byte size
TARGET = 64 * MiB


def raise_fd_limit(want: int) -> int:
    """Raise this process's soft descriptor limit towards ``want`` (the hard limit caps it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if new > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def payload(mode: str) -> bytes:
    if mode == "greeting":
        return GREETING
    if mode == "oversized":
        return GREETING + bytes([LONG_MESSAGE]) + struct.pack("!Q", 1 << 30) + b"\xab" * (64 << 10)
    return GREETING + bytes([LONG_MESSAGE]) + struct.pack("!Q", wire.PIECE_BYTES) + b"\xab" * wire.PIECE_BYTES


def open_batch(host: str, port: int, n: int, data: bytes) -> list[socket.socket]:
    """``n`` connections, each sending as much of ``data`` as the kernel takes at once (blocking: a thread)."""
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, port), timeout=30)
        s.setblocking(False)
        try:
            s.send(data)
        except OSError:
            pass
        socks.append(s)
    return socks


def hung_up(socks: list, want: int, timeout: float) -> int:
    """Wait up to ``timeout`` s until ``want`` of ``socks`` are closed by the node; how many were."""
    deadline, closed = time.monotonic() + timeout, set()
    poller, by_fd = select.poll(), {s.fileno(): s for s in socks}   # (select() stops at descriptor 1024)
    for fd in by_fd:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while len(closed) < want and time.monotonic() < deadline:
        for fd, _ in poller.poll(max(0, int(1000 * (deadline - time.monotonic())))):
            s = by_fd[fd]
            try:
                if not s.recv(1 << 16):
                    closed.add(s)
            except BlockingIOError:
                pass
            except OSError:
                closed.add(s)
            if s in closed:
                poller.unregister(fd)
    return len(closed)


async def flood(ref, pid: int, host: str, port: int, mode: str, total: int, batch: int) -> dict:
    data, keep = payload(mode), ConnectionLimits().max_unproven
    before = peak = rss_bytes(pid)
    fds = shut = 0
    worst_ping = 0.0
    t0 = time.perf_counter()
    for start in range(0, total, batch):
        n = min(batch, total - start)
        socks = await asyncio.to_thread(open_batch, host, port, n, data)
        shut += await asyncio.to_thread(hung_up, socks, n - keep if mode != "oversized" else n, 10)
        peak = max(peak, rss_bytes(pid))
        fds = max(fds, len(os.listdir(f"/proc/{pid}/fd")))
        p0 = time.perf_counter()
        assert await ref.ask(Ping(b"there?"), timeout=30) == Pong(b"there?")
        worst_ping = max(worst_ping, time.perf_counter() - p0)
        for s in socks:
            s.close()
    wall = time.perf_counter() - t0
    after = rss_bytes(pid)
    bound = TARGET
    return {"mode": mode, "connections": total, "batch": batch, "rss_before": before, "rss_peak": peak,
            "rss_after": after, "growth": peak - before, "bound": bound, "ok": peak - before < bound,
            "node_fds_peak": fds, "shut_by_node": shut, "worst_ping_s": worst_ping, "wall_s": wall,
            "connections_per_s": total / wall, "load_avg_1min": os.getloadavg()[0]}


async def one_run(args) -> list[dict]:
    async with ActorSystem("bench") as system, LocalCluster(["cpu"]) as cluster:
        node = cluster.nodes[0]
        ref = await system.remote_ref(node.endpoint, "node")
        assert await ref.ask(Ping(b"warm"), timeout=30) == Pong(b"warm")
        host, port = node.endpoint[len("tcp://"):].rsplit(":", 1)
        rows = []
        for mode, total in (("greeting", args.connections), ("oversized", args.connections),
                            ("under_limit", args.under_limit)):
            rows.append(await flood(ref, node.proc.pid, host, int(port), mode, total, args.batch))
        assert await ref.ask(Ping(b"after"), timeout=30) == Pong(b"after")
    for row in rows:
        row["node_exit_code"] = node.exit_code
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--under-limit", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=1000, help="connections open at once (attacker descriptors)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "wire_flood_cpu.json"))
    args = ap.parse_args()
    fd_limit = raise_fd_limit(args.batch + 256)
    runs = []
    for run in range(args.runs):
        runs.append({"run": run, "rows": asyncio.run(one_run(args))})
    print(f"{'run':>3} {'flood':12} {'conns':>6} {'RSS before':>10} {'peak':>8} {'growth':>8} {'bound':>7} "
          f"{'shut':>6} {'fds':>5} {'ping max':>9} {'conn/s':>7} {'wall':>6} {'load':>5} ok")
    for r in runs:
        for x in r["rows"]:
            print(f"{r['run']:>3} {x['mode']:12} {x['connections']:>6} {x['rss_before'] / MiB:>8.1f}Mi "
                  f"{x['rss_peak'] / MiB:>6.1f}Mi {x['growth'] / MiB:>6.1f}Mi {x['bound'] / MiB:>5.0f}Mi "
                  f"{x['shut_by_node']:>6} {x['node_fds_peak']:>5} {1e3 * x['worst_ping_s']:>7.1f}ms "
                  f"{x['connections_per_s']:>7.0f} {x['wall_s']:>5.1f}s {x['load_avg_1min']:>5.1f} "
                  f"{'yes' if x['ok'] and x['node_exit_code'] == 0 else 'NO'}")
    doc = {**provenance(), "bench_fd_limit": fd_limit, "max_wire_frame": wire.MAX_WIRE_FRAME,
           "limits": dataclasses.asdict(ConnectionLimits()),
           "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {args.out}")
    return 0 if all(x["ok"] and x["node_exit_code"] == 0 for r in runs for x in r["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
