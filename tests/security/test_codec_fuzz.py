"""The codec survives hostile input: >= 100,000 fuzzed inputs (random bytes,
mutated valid messages, deep nesting incl. hundreds of nested ext types,
huge declared sizes) decode or raise ``CodecError`` - in a subprocess, so
a segfault or a hang fails this test instead of killing the runner."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_codec_main.py")
INPUTS = 100_000


def test_codec_fuzz_no_crash_no_hang_only_codec_errors():
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, PROGRAM, str(INPUTS), "20261201"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["inputs"] == INPUTS and stats["other"] == []
    assert stats["codec_errors"] > INPUTS // 2 and stats["ok"] > 0   # the inputs reached both outcomes


def test_the_724_byte_nested_ext_message_is_a_codec_error():
    sys.path.insert(0, os.path.dirname(PROGRAM))
    from fuzz_codec_main import envelope, nest_ext
    import pytest
    from tessera_actors.runtime.errors import CodecError
    from transport import codec
    for depth in (17, 195, 400):
        with pytest.raises(CodecError, match="nested deeper"):
            codec.decode([codec.HEADER_BYTES, envelope(nest_ext(depth))])
    assert codec.decode([codec.HEADER_BYTES, envelope(nest_ext(8))])[1] is not None


def test_large_bodies_are_bounds_checked_before_unpacking():
    import struct

    import msgpack
    import pytest
    from tessera_actors.runtime.errors import CodecError
    from tessera_actors.runtime.messages import Stats
    from transport import codec
    sys.path.insert(0, os.path.dirname(PROGRAM))
    from fuzz_codec_main import envelope
    many = b"\xdd" + struct.pack("!I", codec.MAX_ITEMS + 1) + b"\xc0" * (codec.MAX_ITEMS + 1)
    with pytest.raises(CodecError, match="more than"):   # 1 MiB of nils would be 8 MiB of pointers
        codec.decode([codec.HEADER_BYTES, envelope(many)])
    with pytest.raises(CodecError, match="declares"):
        codec.decode([codec.HEADER_BYTES, envelope(b"\xdd\xff\xff\xff\xff" + b"\x00" * 4000)])
    with pytest.raises(CodecError, match="nesting deeper"):
        codec.decode([codec.HEADER_BYTES, envelope(b"\x91" * 3000 + b"\x00")])
    big = Stats({"names": [f"node{i}" for i in range(1000)]})
    frames = codec.encode(big)
    assert len(frames[1]) > codec.SCAN_ABOVE and codec.decode(frames)[1] == big
    assert msgpack.unpackb(frames[1])[3] == "Stats"
