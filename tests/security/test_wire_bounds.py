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
