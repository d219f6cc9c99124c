"""The node daemon as a user runs it: a real process, real sockets, signals."""
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from tessera_actors.cluster import LocalCluster
from tessera_actors.runtime.messages import Describe, GetStats, Shutdown
from transport.system import ActorSystem

ROOT = Path(__file__).resolve().parent.parent


def start_node(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "tessera_actors.node", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    line = proc.stdout.readline()
    return proc, line


def test_node_serves_and_exits_zero_on_sigterm_within_5s():
    proc, line = start_node("--listen", "tcp://127.0.0.1:0", "--devices", "cpu,cpu?threads=1", "--name", "n1")
    try:
        assert line.startswith("tessera-node n1 ready tcp://127.0.0.1:"), line + proc.stderr.read()
        endpoint = line.split()[-1]

        async def describe():
            async with ActorSystem("t") as system:
                node = await system.remote_ref(endpoint, "node")
                info = await node.ask(Describe(), timeout=5)
                dev = await (await system.remote_ref(endpoint, "device1")).ask(GetStats(), timeout=5)
                return info, dev
        info, dev = asyncio.run(describe())
        assert info.node == "n1" and info.devices == ["cpu", "cpu?threads=1"] and info.pid == proc.pid
        assert dev.values["steps"] == 0
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()


def test_node_rejects_bad_device_with_clear_error():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "tessera_actors.node", "--devices", "tpu:0"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2 and "unknown device 'tpu:0'" in r.stderr


def test_node_with_unreachable_scheduler_exits_nonzero_with_reason():
    proc, line = start_node("--devices", "cpu", "--scheduler", "tcp://127.0.0.1:9", "--name", "lonely",
                            "--register-timeout", "1")
    try:
        assert "ready" in line
        assert proc.wait(timeout=10) == 1
        assert "could not register with the scheduler at tcp://127.0.0.1:9" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_shutdown_message_and_local_cluster_stop():
    async with LocalCluster(["cpu", "cpu?threads=1"]) as cluster:
        assert all(n.endpoint.startswith("tcp://") for n in cluster.nodes)
        async with ActorSystem("t") as system:
            node = await system.remote_ref(cluster.nodes[0].endpoint, "node")
            await node.ask(Shutdown(), timeout=5)
            assert await asyncio.wait_for(cluster.nodes[0].proc.wait(), 5) == 0
    assert [n.exit_code for n in cluster.nodes] == [0, 0]
