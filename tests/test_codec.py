"""Codec: every registered message round-trips; tensors keep dtype, shape and
values; malformed input raises CodecError."""
import dataclasses
import subprocess
import sys
import types
import typing

import msgpack
import numpy as np
import pytest
import torch

from tessera_actors.runtime import messages
from tessera_actors.runtime.errors import CodecError
from tessera_actors.runtime.messages import ErrorReply, Ping, message
from transport import codec
from transport.codec import OP_ASK, Envelope, decode, encode


@message
class CodecSample:
    tensors: list = dataclasses.field(default_factory=list)
    nested: object = None
    shape: tuple = (2, 3)
    table: dict = dataclasses.field(default_factory=dict)
    blob: bytes = b""


def deep_equal(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and np.array_equal(a, b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            deep_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(deep_equal, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(deep_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def sample_value(tp, depth=0):
    """A non-default sample for a field annotation (None when unknown)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is not type(None) and (value := sample_value(arg, depth)) is not None:
                return value
        return None
    if origin in (list, typing.List):
        return [sample_value(args[0], depth + 1)] if args else [1, "two"]
    if origin in (tuple, typing.Tuple):
        if len(args) == 2 and args[1] is Ellipsis:
            return (sample_value(args[0], depth + 1),)
        return tuple(sample_value(a, depth + 1) for a in args) if args else (1, 2)
    if origin in (dict, typing.Dict):
        return {"k": sample_value(args[1], depth + 1)} if args else {"k": 1}
    simple = {str: "text", int: 7, float: 2.5, bool: True, bytes: b"\x00\xff", type(None): None}
    if tp in simple:
        return simple[tp]
    if tp is torch.Tensor:
        return torch.arange(6, dtype=torch.float32).reshape(2, 3)
    if tp is np.ndarray:
        return np.arange(6, dtype=np.int32).reshape(3, 2)
    if isinstance(tp, type) and tp in messages.registry().values() and depth < 3:
        return sample_instance(tp, depth + 1)
    return None


def sample_instance(cls, depth=0):
    try:
        hints = typing.get_type_hints(cls)
    except Exception:   # annotation names not importable at runtime: use defaults
        hints = {}
    kwargs = {}
    for f in dataclasses.fields(cls):
        value = sample_value(hints.get(f.name, typing.Any), depth)
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if value is not None or no_default:
            kwargs[f.name] = value
    return cls(**kwargs)


@pytest.mark.parametrize("kind", sorted(messages.registry()))
def test_every_registered_message_round_trips(kind):
    cls = messages.registry()[kind]
    for msg in (sample_instance(cls),) + ((cls(),) if _has_all_defaults(cls) else ()):
        env, back = decode(encode(msg, Envelope(OP_ASK, 42, "target")))
        assert env == Envelope(OP_ASK, 42, "target")
        assert deep_equal(msg, back), (msg, back)


def _has_all_defaults(cls):
    return all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
               for f in dataclasses.fields(cls))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool,
                                   torch.complex64])
def test_torch_dtypes_round_trip(dtype):
    t = (torch.randn(3, 5) * 10).to(dtype)
    frames = encode(CodecSample(tensors=[t]))
    assert len(frames) == 3 and frames[2].nbytes == t.numel() * t.element_size()
    _, back = decode(frames)
    assert deep_equal(back.tensors[0], t)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(24, dtype=torch.bfloat16).reshape(4, 6).t(),     # non-contiguous bf16
    lambda: torch.arange(40, dtype=torch.int64).reshape(5, 8)[:, ::3],    # strided slice
    lambda: torch.empty(0, 7, dtype=torch.bfloat16),                      # empty
    lambda: torch.tensor(3.5, dtype=torch.bfloat16),                      # 0-d
    lambda: torch.tensor([True, False, True]).expand(2, 3),               # broadcast view, bool
    lambda: torch.ones(2, 3, requires_grad=True) * 2,                     # needs grad
], ids=["transposed_bf16", "strided_int64", "empty_bf16", "zero_dim", "expanded_bool", "grad"])
def test_torch_layouts_round_trip(make):
    t = make()
    _, back = decode(encode(CodecSample(tensors=[t], nested=t)))
    for got in (back.tensors[0], back.nested):
        assert got.shape == t.shape and got.dtype == t.dtype and torch.equal(got, t.detach())


def test_numpy_arrays_round_trip_as_numpy():
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4).T, np.zeros((0, 2), np.int16),
              np.array(7, dtype=np.uint64), np.array([1, 0, 1], dtype=bool)]
    _, back = decode(encode(CodecSample(tensors=arrays)))
    assert deep_equal(back.tensors, arrays)


def test_tensor_frames_are_zero_copy():
    t = torch.arange(1024, dtype=torch.float32)
    frames = encode(CodecSample(tensors=[t]))
    assert np.frombuffer(frames[2], dtype=np.float32).ctypes.data == t.data_ptr()
    received = [bytearray(bytes(f)) for f in frames]
    _, back = decode(received)
    received[2][:4] = b"\x00\x00\x80\x3f"   # decoded tensor shares the received buffer
    assert back.tensors[0][0].item() == 1.0


def test_nested_messages_tuples_and_reply_values():
    msg = CodecSample(nested=Ping(b"p"), shape=(1, (2, 3)), table={"a": [1, 2.5, None, True]},
                      blob=b"\x00" * 10)
    assert deep_equal(decode(encode(msg))[1], msg)
    for value in (None, 3, "text", [1, {"x": b"y"}], (Ping(), torch.ones(2))):
        assert deep_equal(decode(encode(value))[1], value)


def test_unknown_fields_ignored_and_missing_fields_defaulted():
    body = msgpack.packb([0, 0, "", "CodecSample", {"blob": b"x", "added_by_a_newer_peer": 1}],
                         use_bin_type=True)
    _, msg = decode([codec.HEADER_BYTES, body])
    assert deep_equal(msg, CodecSample(blob=b"x"))
    nested = msgpack.packb([0, 0, "", None, msgpack.ExtType(1, msgpack.packb(["Ping", {"extra": 1}]))])
    assert decode([codec.HEADER_BYTES, nested])[1] == Ping()


def test_codec_does_not_import_torch():
    code = ("import sys, transport.codec as c, tessera_actors.runtime.messages as m;"
            "c.decode(c.encode(m.Ping(b'x'))); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unencodable_value_is_codec_error():
    with pytest.raises(CodecError):
        encode(CodecSample(nested=object()))
    with pytest.raises(CodecError):
        encode(CodecSample(tensors=[np.array([object()])]))


def _ask_frames(msg=Ping(b"x")):
    return encode(msg, Envelope(OP_ASK, 9, "t"))


@pytest.mark.parametrize("frames", [
    [],
    [b"garbage"],
    [b"\x00" * 6, b"\x01\x02"],
    [b"XXXX\x01\x00", _ask_frames()[1]],                       # wrong magic
    [b"TSRA\x63\x00", _ask_frames()[1]],                       # future protocol version
    [codec.HEADER_BYTES, b"\xc1\xc1\xc1"],                     # not msgpack
    [codec.HEADER_BYTES, msgpack.packb([1, 2])],               # wrong body shape
    [codec.HEADER_BYTES, msgpack.packb(["x", 1, 2, None, 1])], # wrong envelope types
    [codec.HEADER_BYTES, msgpack.packb([1, 1, "t", "Ping", [1]])],  # fields not a map
    [codec.HEADER_BYTES, _ask_frames()[1], b"extra"],          # tensor frame without flag
], ids=["empty", "one_frame", "zero_header", "magic", "version", "body", "body_shape", "envelope",
     "fields", "stray_frame"])
def test_malformed_frames_raise_codec_error(frames):
    with pytest.raises(CodecError):
        decode(frames)


def test_unknown_kind_keeps_envelope_readable():
    body = msgpack.packb([OP_ASK, 9, "t", "NoSuchKind", {}])
    frames = [codec.HEADER_BYTES, body]
    with pytest.raises(CodecError, match="NoSuchKind"):
        decode(frames)
    assert codec.decode_envelope(frames) == Envelope(OP_ASK, 9, "t")


def test_truncated_and_missing_tensor_frames():
    frames = encode(CodecSample(tensors=[torch.ones(16)]), Envelope(OP_ASK, 3, "t"))
    with pytest.raises(CodecError, match="bytes"):
        decode([frames[0], frames[1], bytes(frames[2])[:-1]])
    with pytest.raises(CodecError, match="missing frame"):
        decode(frames[:2])


def test_size_limits():
    frames = encode(CodecSample(tensors=[torch.ones(1024)], blob=b"x" * 2000))
    with pytest.raises(CodecError, match="exceeds"):
        decode(frames, max_frame=1000)
    with pytest.raises(CodecError, match="exceeds"):
        decode(frames, max_body=1000)


def test_required_field_missing_is_codec_error():
    body = msgpack.packb([0, 0, "", "ErrorReply", {"kind": "x"}])
    with pytest.raises(CodecError, match="ErrorReply"):
        decode([codec.HEADER_BYTES, body])
    assert decode(encode(ErrorReply("k", "m")))[1] == ErrorReply("k", "m")


def test_a_decode_steps_rows_cross_the_wire_as_ints_and_typed_rows():
    rows = messages.StepRows(4, [2, 0], [messages.SampleRow(2, 0, 0.7, 0.9, 40, -3, 5, {"top": 2, "bias": [[1, -100.0]]},
                                                            17, 9)], 63, [], [[1, {"out": [3, 4], "allow": b"\xff\x01"}]])
    msg = messages.RunStep("g0:decode:4@0", 5, {}, [], False, False, rows)
    _, back = decode(encode(msg, Envelope(OP_ASK, 1, "device0")))
    assert back == msg and isinstance(back.rows.new[0], messages.SampleRow)
    assert len(encode(msg)) == 2   # the header and one msgpack body: no tensor frames
