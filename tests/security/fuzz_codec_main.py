"""Codec fuzz program, run by test_codec_fuzz.py in a subprocess (so a crash
of the interpreter fails that test, not the test runner).

``python fuzz_codec_main.py N SEED`` decodes N inputs - random bytes, mutated
valid messages (with tensor frames, nested messages, tuples), deep nesting
(arrays, maps, ext types up to hundreds of levels) and huge declared sizes -
and prints one JSON line ``{"inputs": .., "ok": .., "codec_errors": .., "other": [..]}``.
Every input must decode or raise ``CodecError``; anything else is listed in
``other`` and makes the exit status 1.
"""
import json
import random
import sys

import msgpack
import numpy as np
import torch

from tessera_actors.runtime.errors import CodecError
from tessera_actors.runtime.messages import ErrorReply, Heartbeat, Ping, Register, Stats
from transport import codec
from transport.codec import OP_ASK, Envelope

HEADER, HEADER_T = codec.HEADER_BYTES, codec._HEADER_WITH_TENSORS


def valid_messages() -> list[list]:
    msgs = [
        Ping(b"payload"), Register("node0", "tcp://127.0.0.1:1", ["cpu", "cpu?threads=1"], 42),
        Heartbeat("node0", 7), ErrorReply("X", "y"), Stats({"a": [1, 2.5, None, True], "b": {"c": "d"}}),
        Ping((1, (2, (3, Ping(b"in"))))),
        Ping([torch.arange(6, dtype=torch.float32).reshape(2, 3), np.arange(4, dtype="<i2"),
              torch.ones(3, dtype=torch.bfloat16)]),
        [1, "reply", {"k": (b"v", -1)}],
    ]
    return [codec.encode(m, Envelope(OP_ASK, 9, "device0")) for m in msgs]


def nest_ext(depth: int, code: int = 3) -> bytes:
    doc = msgpack.packb([0])
    for _ in range(depth):
        doc = msgpack.packb([msgpack.ExtType(code, doc)])   # a tuple holding a tuple ...
    return doc


def nest_message(depth: int) -> bytes:
    doc = msgpack.packb(["Ping", {"payload": b""}])
    for _ in range(depth):
        doc = msgpack.packb(["Ping", {"payload": msgpack.ExtType(1, doc)}])
    return msgpack.packb(msgpack.ExtType(1, doc))


def envelope(inner: bytes) -> bytes:
    return b"\x95\x01\x01\xa1x\xc0" + inner   # [op, rid, "x", None, <inner>]


def deep_inputs(rng: random.Random):
    depth = rng.choice([rng.randint(1, 40), rng.randint(150, 260), rng.randint(1000, 5000)])
    kind = rng.randrange(5)
    if kind == 0:
        inner = nest_ext(min(depth, 400), rng.choice([1, 3]))
    elif kind == 1:
        inner = nest_message(min(depth, 300))
    elif kind == 2:
        inner = b"\x91" * depth + b"\x00"
    elif kind == 3:
        inner = b"\x81\x00" * depth + b"\x00"
    else:
        inner = b"\x91\xc7\x02\x03\x91" * (depth // 4) + b"\x00"   # mixed, truncated ext lengths
    return [HEADER, envelope(inner)]


HUGE_HEADS = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
              b"\xc9\xff\xff\xff\xff\x03", b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff", b"\xde\xff\xff",
              b"\xc5\xff\xff", b"\xc8\xff\xff\x02"]


def huge_inputs(rng: random.Random):
    if rng.random() < 0.5:
        inner = rng.choice(HUGE_HEADS) + rng.randbytes(rng.randint(0, 16))
        return [HEADER, envelope(inner)]
    # a tensor descriptor declaring a huge shape / bad dtype for a small frame
    shape = rng.choice([[1 << 62], [1 << 31, 1 << 31], [-1], [0, 1 << 62], [3, 3], [2] * 64, "x", [1.5]])
    dtype = rng.choice(["float32", "bool", "<f8", "O", "uint8", "nope", 7, "|V16", "<U4"])
    lib = rng.choice([0, 1, 2])
    index = rng.choice([0, 1, -1, 1 << 40])
    desc = msgpack.ExtType(2, msgpack.packb([index, lib, dtype, shape]))
    body = msgpack.packb([1, 1, "x", None, [desc]])
    return [HEADER_T, body, rng.randbytes(rng.choice([0, 4, 36, 64]))]


def mutate(rng: random.Random, frames: list) -> list:
    frames = [bytes(f) for f in frames]
    i = 1 if len(frames) < 3 or rng.random() < 0.8 else rng.randrange(len(frames))
    data = bytearray(frames[i])
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[min(pos, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            data[min(pos, len(data) - 1)] = rng.randrange(256)
        elif op == 2:
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3:
            del data[pos:pos + rng.randint(1, 8)]
        elif op == 4:
            data = data[:pos]
        else:
            data[pos:pos] = rng.choice(HUGE_HEADS)
    frames[i] = bytes(data)
    if rng.random() < 0.05:
        frames = frames[:rng.randint(0, len(frames))] if rng.random() < 0.5 else frames + [b"\x00" * 4]
    return frames


def random_input(rng: random.Random):
    body = rng.randbytes(rng.randint(0, 48))
    if rng.random() < 0.5:
        body = b"\x95" + body
    header = rng.choice([HEADER, HEADER_T, rng.randbytes(6), b"TSRA\x02\x00", b""])
    frames = [header, body] + [rng.randbytes(rng.randint(0, 16)) for _ in range(rng.choice([0, 0, 1, 2]))]
    return frames


def main(count: int, seed: int) -> int:
    rng = random.Random(seed)
    valid = valid_messages()
    stats = {"inputs": 0, "ok": 0, "codec_errors": 0, "other": []}
    for n in range(count):
        roll = rng.random()
        if roll < 0.35:
            frames = random_input(rng)
        elif roll < 0.80:
            frames = mutate(rng, rng.choice(valid))
        elif roll < 0.90:
            frames = deep_inputs(rng)
        else:
            frames = huge_inputs(rng)
        stats["inputs"] += 1
        try:
            codec.decode(frames)
            stats["ok"] += 1
        except CodecError:
            stats["codec_errors"] += 1
        except BaseException as exc:   # noqa: BLE001 - anything else is the finding
            if len(stats["other"]) < 20:
                stats["other"].append(f"input {n}: {type(exc).__name__}: {exc}"[:300])
            else:
                stats["other"].append("...")
                break
        codec.decode_envelope(frames)   # must never raise either
    print(json.dumps(stats), flush=True)
    return 1 if stats["other"] else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
