"""An attacker on the same host, against a node daemon started as the
README says (here by ``LocalCluster``) and a scheduler: an unauthenticated
local process (raw ZeroMQ, no keys - or CURVE with the public server key and
a keypair of its own) tries to ping, describe, register, install a plan,
read stats, uninstall and shut down, and gets nowhere; an authenticated but
hostile peer cannot install ``aten.from_file`` or a 1 TiB allocation, nor
make the node read a symlinked, foreign or shrunk shared-memory segment;
the authenticated peers keep working throughout."""
import asyncio
import json
import os
import subprocess
import sys

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from actors.scheduler import SchedulerActor
from tessera_actors.cluster import LocalCluster
from tessera_actors.runtime.errors import RemoteError
from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.runtime.messages import Describe, ErrorReply, GetStats, InstallPlan, Ping, Pong
from tessera_actors.plan import ContiguousPlanner, plan_to_dict, single_device_plan
from transport.system import ActorSystem
from transport import auth, codec, shm
from transport.codec import OP_ASK, OP_FAILED, OP_RELEASE, OP_REPLY, Envelope

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture
async def target():
    """A scheduler in this (authenticated) process and one node daemon."""
    async with ActorSystem("control") as system:
        await system.spawn(SchedulerActor(ContiguousPlanner()), "scheduler")
        scheduler = await system.listen()
        async with LocalCluster(["cpu"]) as cluster:
            yield system, scheduler, cluster.nodes[0]


def run_attacker(specs: list) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env["PYTHONPATH"] = REPO
    proc = subprocess.run([sys.executable, os.path.join(HERE, "attacker.py"), json.dumps(specs)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


async def test_unauthenticated_process_cannot_reach_node_or_scheduler(target):
    system, scheduler, node = target
    server_public = system.keys.server_public.decode()
    attempts = [("ping", node.endpoint, "node", "ping"), ("describe", node.endpoint, "node", "describe"),
                ("install_from_file", node.endpoint, "device0", "install_from_file"),
                ("read_stats", node.endpoint, "device0", "stats"), ("uninstall", node.endpoint, "device0", "uninstall"),
                ("stop_actor", node.endpoint, "device0", "stop"), ("shutdown", node.endpoint, "node", "shutdown"),
                ("register", scheduler, "scheduler", "register")]
    specs = [{"name": f"{name}/{mode}", "endpoint": ep, "target": tgt, "message": msg, "mode": mode,
              "server_public": server_public} for mode in ("null", "curve") for name, ep, tgt, msg in attempts]
    results = await asyncio.to_thread(run_attacker, specs)
    assert [r["name"] for r in results] == [s["name"] for s in specs]
    for r in results:
        assert r["handshake"] == "failed" and not r["answered"], r
    # nothing happened: the node serves its authenticated peers, nobody registered, nothing installed
    assert node.proc.returncode is None
    ref = await system.remote_ref(node.endpoint, "node")
    assert (await ref.ask(Describe(), timeout=10)).node == "node0"
    assert (await (await system.remote_ref(node.endpoint, "device0")).ask(GetStats(), timeout=10)).values["plans"] == []
    assert (await system.ref("scheduler").ask(GetStats())).values["nodes"] == []
    assert system._authenticator.refused == 1   # the scheduler refused the curve attempt by its key


def one_kernel_plan(op: str, args: list, kwargs: dict) -> tuple[bytes, bytes]:
    out = {"ref": {"t": [0, 0, [64], [1], "uint8"]}, "alias": False}
    graph = KernelGraph([Kernel(0, "k", "library", (Access(0, 0, 64, "w"),),
                                payload={"op": op, "args": args, "kwargs": kwargs, "outs": [out]})],
                        {0: Buffer(0, 64, "output")}, outputs=[0])
    plan = single_device_plan(graph, "cpu")
    return msgpack.packb(graph.to_dict(), use_bin_type=True), msgpack.packb(plan_to_dict(plan), use_bin_type=True)


@pytest.mark.parametrize("op,args,kwargs,reason", [
    ("aten.from_file.default", ["/etc/hostname"], {"shared": False, "size": 64}, "not allowed"),
    ("aten.empty.memory_format", [[1 << 40]], {"dtype": {"dt": "uint8"}}, "memory cap"),
    ("aten.full.default", [[1 << 20, 1 << 20], 1.0], {}, "memory cap"),
    ("prims.add.default", [], {}, "only aten ops"),
])
async def test_authenticated_peer_cannot_install_disallowed_kernels(target, op, args, kwargs, reason):
    system, _, node = target
    device = await system.remote_ref(node.endpoint, "device0")
    graph, plan = one_kernel_plan(op, args, kwargs)
    with pytest.raises(RemoteError, match=reason) as info:
        await device.ask(InstallPlan("evil", 0, graph, plan, [[0, "", "device0"]]), timeout=30)
    assert info.value.kind == "KernelRefused"
    assert (await device.ask(GetStats(), timeout=10)).values["plans"] == []
    graph, plan = one_kernel_plan("aten.zeros.default", [[64]], {"dtype": {"dt": "uint8"}})
    await device.ask(InstallPlan("fine", 0, graph, plan, [[0, "", "device0"]]), timeout=30)   # allowed ops install


async def answer(sock):
    while True:
        env, value = codec.decode(await asyncio.wait_for(sock.recv_multipart(), 10))
        if env.op != OP_RELEASE:
            return env, value


async def test_forged_symlinked_foreign_and_shrunk_segments_are_refused(target, tmp_path):
    system, _, node = target
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.secure_client(sock, system.keys)   # authenticated, but hostile
    sock.connect(node.endpoint)
    pool, other = shm.SegmentPool(64 << 20), shm.SegmentPool(64 << 20)
    made = []
    try:
        hello, proof = pool.probe()
        await sock.send_multipart(codec.encode(hello, Envelope(codec.OP_SHM_HELLO, 1, "")))
        assert await answer(sock) == (Envelope(OP_REPLY, 1, ""), proof)
        secret = tmp_path / "secret.txt"
        secret.write_bytes(b"S" * 4096)
        link = pool.name(900)   # a name this connection may use, but a symlink
        os.symlink(secret, os.path.join(shm.SHM_DIR, link))
        made.append(link)
        foreign = other.acquire(4096)                       # a segment of another pool (another process's)
        shrunk = pool.acquire(1 << 20)
        shrunk.write(b"x" * (1 << 20))
        os.ftruncate(shrunk.fd, 100)                        # the peer shrinks it after describing it
        cases = [(link, 4096, "cannot open"), (foreign.name, 4096, "not made for this connection"),
                 (shrunk.name, 1 << 20, "bytes of 100-byte segment")]
        if os.geteuid() == 0:
            alien = pool.name(901)
            path = os.path.join(shm.SHM_DIR, alien)
            with open(path, "wb") as f:
                f.write(b"A" * 4096)
            os.chown(path, 65534, 65534)
            made.append(alien)
            cases.append((alien, 4096, "belongs to uid 65534"))
        header = bytes([*codec.MAGIC, codec.PROTOCOL_VERSION, 1 | shm.FLAG_SHM])
        for rid, (name, nbytes, reason) in enumerate(cases, start=10):
            frames = codec.encode(Ping(torch.zeros(nbytes, dtype=torch.uint8)), Envelope(OP_ASK, rid, "node"))
            await sock.send_multipart([header, frames[1], b"", msgpack.packb([[0, name, 1, nbytes]])])
            env, reply = await answer(sock)
            assert (env.op, env.request_id) == (OP_FAILED, rid)
            assert isinstance(reply, ErrorReply) and reply.kind == "CodecError" and reason in reply.message, reply
        # a well-formed descriptor of its own pool still works, and the node is alive
        good = pool.acquire(4096)
        good.write(b"g" * 4096)
        frames = codec.encode(Ping(b""), Envelope(OP_ASK, 99, "node"))
        await sock.send_multipart(frames)
        assert await answer(sock) == (Envelope(OP_REPLY, 99, ""), Pong(b""))
    finally:
        for name in made:
            os.unlink(os.path.join(shm.SHM_DIR, name))
        sock.close()
        ctx.term()
        pool.close()
        other.close()
    assert node.proc.returncode is None
    ref = await system.remote_ref(node.endpoint, "node")
    assert await ref.ask(Ping(b"alive"), timeout=10) == Pong(b"alive")


async def test_triton_kernel_naming_a_module_outside_inductors_cache_is_refused(target):
    system, _, node = target
    out = {"ref": {"t": [0, 0, [64], [1], "uint8"]}, "alias": False}
    graph = KernelGraph([Kernel(0, "k", "ptx", (Access(0, 0, 64, "w"),),
                                payload={"triton": "evil", "file": "/etc/hostname.py", "args": [], "outs": [out]})],
                        {0: Buffer(0, 64, "output")}, outputs=[0])
    g = msgpack.packb(graph.to_dict(), use_bin_type=True)
    p = msgpack.packb(plan_to_dict(single_device_plan(graph, "cpu")), use_bin_type=True)
    device = await system.remote_ref(node.endpoint, "device0")
    with pytest.raises(RemoteError, match="outside inductor's cache directory and the graph carries no source") as info:
        await device.ask(InstallPlan("evil-triton", 0, g, p, [[0, "", "device0"]]), timeout=30)
    assert info.value.kind == "KernelRefused"
