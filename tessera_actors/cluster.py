"""Start node daemons as child processes on this machine (demo, tests,
benchmarks) and stop them in order.

``LocalCluster`` starts ``python -m tessera_actors.node`` per node, waits for
each one's ``ready`` line (bounded by ``start_timeout``; a node that dies
first raises with its stderr), and on exit sends SIGTERM and waits
``stop_timeout`` seconds for exit status 0 before killing."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from transport import auth
from transport.auth import ClusterKeys

_ROOT = Path(__file__).resolve().parent.parent


class ClusterError(RuntimeError):
    pass


@dataclass
class NodeProcess:
    name: str
    proc: asyncio.subprocess.Process
    endpoint: str = ""
    exit_code: int | None = None


class LocalCluster:
    def __init__(self, devices_per_node: Sequence[str], scheduler: str = "", start_timeout: float = 60.0,
                 stop_timeout: float = 5.0, log_level: str = "WARNING", node_args: Sequence[str] = (),
                 keys: ClusterKeys | None = None, insecure: bool = False) -> None:
        """``node_args`` are passed to every node (e.g. ``["--data-plane", "dist"]``).  The nodes
        authenticate with ``keys`` (default: this process's, ``transport.auth.process_keys``),
        handed to them in their environment, never on the command line; ``insecure`` starts them
        with ``--insecure``."""
        self.insecure = insecure
        self.keys = None if insecure else (keys or auth.process_keys())
        self.specs = list(devices_per_node)
        self.scheduler = scheduler
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.log_level = log_level
        self.node_args = list(node_args)
        self.nodes: list[NodeProcess] = []

    async def start(self) -> list[NodeProcess]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH", "")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        for name in (auth.ENV_KEYS, auth.ENV_SECRET_FILE, auth.ENV_SECRET, auth.ENV_INSECURE):
            env.pop(name, None)
        if self.keys is not None:
            env.update(dict(self.keys.env))
        for i, devs in enumerate(self.specs):
            args = [sys.executable, "-m", "tessera_actors.node", "--devices", devs, "--name", f"node{i}",
                    "--log-level", self.log_level]
            if self.scheduler:
                args += ["--scheduler", self.scheduler]
            if self.insecure:
                args.append("--insecure")
            args += self.node_args
            proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE, env=env)
            self.nodes.append(NodeProcess(f"node{i}", proc))
        await asyncio.gather(*(self._ready(n) for n in self.nodes))
        return self.nodes

    async def _ready(self, node: NodeProcess) -> None:
        try:
            line = await asyncio.wait_for(node.proc.stdout.readline(), self.start_timeout)
        except asyncio.TimeoutError:
            raise ClusterError(f"{node.name} did not report ready within {self.start_timeout} s") from None
        text = line.decode().strip()
        if not text.startswith("tessera-node "):
            err = (await node.proc.stderr.read()).decode()[-2000:]
            raise ClusterError(f"{node.name} failed to start (exit {await node.proc.wait()}): {err}")
        node.endpoint = text.split()[-1]

    async def stop(self) -> list[int | None]:
        for n in self.nodes:
            if n.proc.returncode is None:
                n.proc.send_signal(signal.SIGTERM)
        for n in self.nodes:
            try:
                n.exit_code = await asyncio.wait_for(n.proc.wait(), self.stop_timeout)
            except asyncio.TimeoutError:
                n.proc.kill()
                n.exit_code = await n.proc.wait()
        return [n.exit_code for n in self.nodes]

    async def __aenter__(self) -> "LocalCluster":
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
