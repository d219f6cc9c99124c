"""``tessera bench serve --launch``: a ``tessera serve`` child process as a
user starts it, timed from the command to its first ``/health`` 200, with
its resident memory, and stopped with SIGINT (timed too).

The server may run another checkout's code (``--launch-from DIR``: its
``tessera serve``, with ``DIR`` first on ``PYTHONPATH``), so one benchmark
program compares an older commit's start-up and memory with this one's on
the same machine.  An older server that does not answer ``/health`` before
it is ready is simply not listening yet: the clock runs until it is.
"""
from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tessera_actors.provenance import git_commit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int | str = "self") -> int:
    """Resident bytes of process ``pid`` (default: this one; 0 once it is
    gone, or where /proc is not there)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Launched:
    """What a launch measured (seconds from the command; bytes of RSS)."""
    checkout: str
    commit: str | None
    args: list
    health_ok_s: float | None = None        # the first /health 200
    all_placed_s: float | None = None       # /health reports every bucket placed (or: the first 200 when it does not say)
    rss: dict = field(default_factory=dict)  # bytes at: ready, placed, after_trace
    exit_s: float | None = None              # SIGINT to exit
    exit_code: int | None = None


class LaunchedServer:
    def __init__(self, args: str, checkout: str | None = None) -> None:
        """``args``: ``tessera serve`` flags (one string); ``checkout``: the
        tree whose code runs it (default: this package's)."""
        self.checkout = Path(checkout).resolve() if checkout else Path(__file__).resolve().parents[2]
        self.port = _free_port()
        self.args = shlex.split(args) + ["--port", str(self.port)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.report = Launched(str(self.checkout), git_commit(self.checkout), self.args)

    async def start(self, session, timeout: float = 900.0) -> str:
        """Start the server; return its URL once ``/health`` says every
        bucket is placed (``RuntimeError`` with its output if it exits or
        times out first)."""
        env = dict(os.environ, PYTHONPATH=str(self.checkout) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "tessera_actors.cli", "serve", *self.args],
                                     cwd=self.checkout, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(os.devnull, "w"), stdin=subprocess.DEVNULL)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tessera serve ({self.checkout}) exited with {self.proc.returncode}")
            body, status = await self._health(session)
            now = time.perf_counter() - t0
            if status == 200 and self.report.health_ok_s is None:
                self.report.health_ok_s = now
                self.report.rss["ready"] = rss_bytes(self.proc.pid)
            if status == 200 and body.get("buckets_placed", 0) >= body.get("buckets", 0):
                self.report.all_placed_s = now
                await asyncio.sleep(1.0)   # the engine gives its copy of the weights back once all are placed
                self.report.rss["placed"] = rss_bytes(self.proc.pid)
                return self.url
            await asyncio.sleep(0.1)
        raise RuntimeError(f"tessera serve ({self.checkout}) not placed within {timeout:.0f} s")

    async def _health(self, session) -> tuple[dict, int | None]:
        import aiohttp
        try:
            async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return (await r.json(content_type=None) or {}), r.status
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return {}, None

    def stop(self) -> Launched:
        """SIGINT, and the seconds until the process exited (killed after 60)."""
        if self.proc is None:
            return self.report
        self.report.rss["after_trace"] = rss_bytes(self.proc.pid)
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.report.exit_code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.report.exit_code = self.proc.wait()
        self.report.exit_s = time.perf_counter() - t0
        return self.report
