"""Messages cost what they are allowed to: a tensor dtype names an entry of a
fixed table (a name such as ``_inductor`` imports nothing), and a large or
complex message is decoded off the node's event loop, so the node keeps
answering its other peers meanwhile."""
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

DECODE_DTYPE = textwrap.dedent("""
    import sys, time, msgpack, torch
    from transport import codec
    from tessera_actors.runtime.errors import CodecError
    ext = msgpack.ExtType(2, msgpack.packb([0, 0, sys.argv[1], [1]]))   # one tensor of dtype argv[1]
    frames = [codec._HEADER_WITH_TENSORS, msgpack.packb([1, 7, "node", None, ext]), b"\\0"]
    try:
        codec.decode(frames)
        print("decoded")
    except CodecError as e:
        print("refused", sum(map(len, frames)), "torch._inductor" in sys.modules, "torch._dynamo" in sys.modules)
""")


@pytest.mark.parametrize("dtype", ["_inductor", "_dynamo", "testing", "float8_e4m3fnuz_"])
def test_a_tensor_dtype_outside_the_table_is_refused_and_imports_nothing(dtype):
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", DECODE_DTYPE, dtype], capture_output=True, text=True, env=env, check=False,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    verdict, size, inductor, dynamo = out.stdout.split()
    assert verdict == "refused" and int(size) < 64
    assert (inductor, dynamo) == ("False", "False")   # no torch submodule was imported to look the name up


def test_every_dtype_of_the_table_still_travels():
    import torch

    from tessera_actors.graph import DTYPE_NAMES, dtype_from_name
    from transport import codec
    for name in DTYPE_NAMES:
        t = torch.zeros(3, dtype=dtype_from_name(name))
        _, back = codec.decode(codec.encode([t]))
        assert back[0].dtype == t.dtype and back[0].shape == t.shape


async def test_a_node_keeps_answering_pings_while_heavy_messages_are_decoded():
    """Eight 1 MiB bodies of a million nested empty arrays each (under the
    body limit; checking and unpacking one held the loop ~0.9 s) sent to a
    live node while another peer pings it: every ping is answered promptly."""
    import asyncio
    import time

    import msgpack
    import zmq

    from tessera_actors.cluster import LocalCluster
    from tessera_actors.runtime.messages import Ping, Pong
    from transport import auth, codec
    from transport.system import ActorSystem
    body = msgpack.packb([1, 9, "node", None, [[]] * ((1 << 20) - 16)])
    heavy = [codec.HEADER_BYTES, body]
    async with ActorSystem("pinger") as system, LocalCluster(["cpu"]) as cluster:
        node = await system.remote_ref(cluster.nodes[0].endpoint, "node")
        assert await node.ask(Ping(b"warm"), timeout=30) == Pong(b"warm")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        auth.secure_client(sock, system.keys)
        sock.connect(cluster.nodes[0].endpoint)
        try:
            for _ in range(8):
                sock.send_multipart(heavy)
            worst = 0.0
            answers = 0
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while answers < 8 and loop.time() < deadline:   # until the node answered every heavy message
                t0 = time.perf_counter()
                assert await node.ask(Ping(b"there?"), timeout=30) == Pong(b"there?")
                worst = max(worst, time.perf_counter() - t0)
                while sock.poll(0):
                    sock.recv_multipart()
                    answers += 1
                await asyncio.sleep(0.01)   # the ping rate
        finally:
            sock.close()
            ctx.term()
    assert answers == 8   # each refused with a CodecError answer (too many objects)
    assert worst < 0.3, f"a ping waited {worst:.3f} s"
