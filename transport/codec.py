"""One codec for every wire message: msgpack body + zero-copy tensor frames.

Frames of one encoded message::

    0: header  b"TSRA" + protocol version (u8) + flags (u8: 1 = tensor frames,
               2 = shared-memory table last, resolved by ``transport.shm``)
    1: body    msgpack [op, request_id, target, kind, fields]
    2..: raw tensor bytes, one frame per tensor, referenced from the body

``value`` is usually a registered message (see ``tessera_actors.runtime.messages``) but
may be any msgpack-able value (a handler's reply).  Messages, tuples and tensors
are msgpack ext types.  Tensor frames are ``memoryview``s of the (contiguous)
tensor storage: nothing is copied when encoding, so the sender must not mutate
a tensor until the receiver answered.  Decoding wraps received buffers without
copying; torch tensors come back as torch, numpy arrays as numpy.

This module never imports torch at import time (control plane stays
torch-free); torch is touched only when a message carries torch tensors.
Every decoding failure raises ``CodecError``.  Encoding and decoding are
synchronous and O(fields) host work; tensor bytes are never touched except to
make a non-contiguous tensor contiguous.
"""
from __future__ import annotations

import math
import struct
import sys
import threading
from typing import Any, NamedTuple, Sequence

import msgpack

from tessera_actors.graph import GraphError, dtype_from_name
from tessera_actors.runtime import messages as _messages
from tessera_actors.runtime.errors import CodecError
from transport.msgscan import scan as _scan

MAGIC = b"TSRA"
PROTOCOL_VERSION = 1
_HEADER = struct.Struct("!4sBB")
HEADER_BYTES = _HEADER.pack(MAGIC, PROTOCOL_VERSION, 0)
_HEADER_WITH_TENSORS = _HEADER.pack(MAGIC, PROTOCOL_VERSION, 1)
FLAG_TENSORS = 1

DEFAULT_MAX_FRAME = 4 << 30   # bytes per tensor frame
DEFAULT_MAX_BODY = 64 << 20   # bytes of msgpack body
MAX_DEPTH = 32            # containers and nested ext documents, counted together
MAX_EXT_DEPTH = 16        # ext documents inside ext documents (each level is a C recursion in msgpack)
MAX_ITEMS = 1 << 17       # objects in one body (unpacking 2**17 nested ones: ~40 ms of C holding the GIL)
MAX_CONTAINER = 1 << 20   # elements of one array or map
SCAN_ABOVE = 2048         # bodies longer than this are bounds-checked (transport.msgscan) before unpacking

# envelope ops; OP_RELEASE and OP_SHM_HELLO belong to the shared-memory path (transport.shm)
OP_TELL, OP_ASK, OP_REPLY, OP_RAISED, OP_FAILED, OP_STOP, OP_RELEASE, OP_SHM_HELLO = range(8)

_EXT_MESSAGE, _EXT_TENSOR, _EXT_TUPLE = 1, 2, 3
_LIB_TORCH, _LIB_NUMPY = 0, 1


class Envelope(NamedTuple):
    """Routing info travelling with a message.

    ``op``: OP_TELL / OP_ASK / OP_STOP (requests), OP_REPLY / OP_RAISED /
    OP_FAILED (answers).  ``request_id`` pairs an ask with its answer (0 for
    tells).  ``target`` is the actor name on the receiving system.
    """
    op: int
    request_id: int = 0
    target: str = ""


_TELL = Envelope(OP_TELL)


def encode(msg: Any, envelope: Envelope = _TELL) -> list:
    """Encode ``msg`` into frames (``bytes`` / ``memoryview``); non-blocking.

    Body: ``[op, request_id, target, kind, fields]`` for a registered message,
    ``[op, request_id, target, None, value]`` for any other value.
    Raises ``CodecError`` for values the wire cannot carry.
    """
    try:
        state = _local.state
    except AttributeError:
        state = _state()
    tensors = state.tensors = []
    op, request_id, target = envelope
    names = _messages._FIELD_NAMES.get(type(msg))
    if names is not None:
        body = [op, request_id, target, msg.__wire_kind__, {f: getattr(msg, f) for f in names}]
    else:
        body = [op, request_id, target, None, msg]
    try:
        packed = state.packer.pack(body)
    except BaseException as exc:
        state.packer.reset()   # a failed pack may leave partial output behind
        if isinstance(exc, (TypeError, ValueError, OverflowError)) and not isinstance(exc, CodecError):
            raise CodecError(f"cannot encode {type(msg).__qualname__}: {exc}") from exc
        raise
    finally:
        state.tensors = None
    if not tensors:
        return [HEADER_BYTES, packed]
    return [_HEADER_WITH_TENSORS, packed, *tensors]


# One msgpack Packer per thread (encode may run in worker threads): building a
# Packer per message costs more than packing a small message.  ``tensors`` is
# the frame list of the encode in progress on that thread.
_local = threading.local()


def _state():
    state = getattr(_local, "state", None)
    if state is None:
        state = _local.state = _EncodeState()
    return state


class _EncodeState:
    __slots__ = ("packer", "tensors")

    def __init__(self):
        self.packer = msgpack.Packer(default=_default, use_bin_type=True, strict_types=True)
        self.tensors: list | None = None


def _default(obj):
    """msgpack ``default`` of ``encode``: messages, tuples and tensors as ext types."""
    fields = _messages._FIELD_NAMES.get(type(obj))
    if fields is not None:
        return msgpack.ExtType(_EXT_MESSAGE, msgpack.packb(
            [obj.__wire_kind__, {f: getattr(obj, f) for f in fields}],
            default=_default, use_bin_type=True, strict_types=True))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(
            list(obj), default=_default, use_bin_type=True, strict_types=True))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor_ext(_torch_frame(torch, obj), _local.state.tensors)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return _tensor_ext(_numpy_frame(np, obj), _local.state.tensors)
    if np is not None and isinstance(obj, np.generic):
        return obj.item()
    for plain in (bool, int, float, str, bytes, list, dict):  # subclasses, e.g. IntEnum
        if isinstance(obj, plain):
            return plain(obj)
    raise CodecError(f"cannot encode value of type {type(obj).__qualname__}")


def _tensor_ext(frame_info, tensors: list):
    lib, dtype, shape, view = frame_info
    tensors.append(view)
    return msgpack.ExtType(_EXT_TENSOR, msgpack.packb([len(tensors) - 1, lib, dtype, shape]))


def _torch_frame(torch, t):
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    # bf16 / fp8 have no numpy dtype: ship the raw bytes through a uint8 view
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return _LIB_TORCH, dtype, list(t.shape), memoryview(raw)


def _numpy_frame(np, a):
    if a.dtype.hasobject:
        raise CodecError("numpy arrays of Python objects cannot travel on the wire")
    if not a.flags.c_contiguous:
        a = a.copy(order="C")   # (np.ascontiguousarray would turn 0-d into 1-d)
    return _LIB_NUMPY, a.dtype.str, list(a.shape), memoryview(a.reshape(-1).view(np.uint8))


def decode(frames: Sequence, *, max_frame: int = DEFAULT_MAX_FRAME,
           max_body: int = DEFAULT_MAX_BODY) -> tuple[Envelope, Any]:
    """Decode frames (bytes, memoryviews or zmq Frames) into ``(envelope, value)``.

    Tensors wrap the received buffers without copying.  Raises ``CodecError``
    on anything malformed; never hangs.
    """
    bufs = [_buffer(f) for f in frames]
    body = _check_framing(bufs, max_frame, max_body)
    if len(body) > SCAN_ABOVE:
        _scan(body, MAX_DEPTH, MAX_ITEMS)
    tensors = _TensorFrames(bufs[2:])
    try:
        op, request_id, target, kind, value = _unpack(body, tensors.ext_hook)
        if type(op) is not int or type(request_id) is not int or type(target) is not str:
            raise CodecError(f"malformed envelope {op!r}, {request_id!r}, {target!r}")
        if kind is not None:
            value = _build_message(kind, value)
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises many types on garbage
        raise CodecError(f"malformed body: {type(exc).__name__}: {exc}") from exc
    if len(tensors.used) != len(tensors.bufs):
        raise CodecError(f"{len(tensors.bufs) - len(tensors.used)} tensor frame(s) not referenced by the body")
    return _new_tuple(Envelope, (op, request_id, target)), value   # (= Envelope(...), faster)


_new_tuple = tuple.__new__


def _unpack(data, ext_hook):
    return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False,
                           max_array_len=MAX_CONTAINER, max_map_len=MAX_CONTAINER)


class _TensorFrames:
    """Ext hook of one decode: builds messages, tuples and tensors, records
    which tensor frames were used, and bounds the ext nesting depth (msgpack
    recurses through this hook, in C, once per nested ext document)."""

    __slots__ = ("bufs", "used", "depth")

    def __init__(self, bufs: list):
        self.bufs = bufs
        self.used: set[int] = set()
        self.depth = 0

    def ext_hook(self, code, data):
        if code == _EXT_MESSAGE or code == _EXT_TUPLE:
            if self.depth >= MAX_EXT_DEPTH:
                raise CodecError(f"ext types nested deeper than {MAX_EXT_DEPTH}")
            self.depth += 1
            try:
                inner = _unpack(data, self.ext_hook)
            finally:
                self.depth -= 1
            if code == _EXT_TUPLE:
                if type(inner) is not list:
                    raise CodecError(f"tuple payload is a {type(inner).__name__}, not an array")
                return tuple(inner)
            if type(inner) is not list or len(inner) != 2:
                raise CodecError("message payload is not [kind, fields]")
            return _build_message(inner[0], inner[1])
        if code == _EXT_TENSOR:
            if not self.bufs:
                raise CodecError("tensor refers to a missing frame")
            try:
                index, lib, dtype, shape = msgpack.unpackb(data, raw=False)
            except (ValueError, TypeError) as exc:
                raise CodecError(f"malformed tensor descriptor: {exc}") from None
            if not (type(index) is int and 0 <= index < len(self.bufs)):
                raise CodecError(f"tensor refers to missing frame {index}")
            if index in self.used:
                raise CodecError(f"tensor frame {index} referenced twice")
            self.used.add(index)
            return _build_tensor(self.bufs[index], lib, dtype, shape)
        raise CodecError(f"unknown ext type {code}")


def decode_envelope(frames: Sequence) -> Envelope | None:
    """Best-effort envelope of frames that failed to decode (None if unreadable).

    Lets a receiver answer a broken ask with an error reply.
    """
    try:
        bufs = [_buffer(f) for f in frames]
        if len(bufs) < 2 or bytes(bufs[0][:4]) != MAGIC:
            return None
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(bufs[1]) or 1)
        unpacker.feed(bufs[1])
        if unpacker.read_array_header() < 4:
            return None
        op, request_id, target = unpacker.unpack(), unpacker.unpack(), unpacker.unpack()
        return Envelope(int(op), int(request_id), str(target))
    except Exception:
        return None


def _buffer(frame):
    buf = getattr(frame, "buffer", frame)   # zmq.Frame -> memoryview
    return buf if isinstance(buf, (bytes, memoryview)) else memoryview(buf)


def _check_framing(bufs, max_frame: int, max_body: int):
    if len(bufs) == 2 and bufs[0] == HEADER_BYTES and len(bufs[1]) <= max_body:
        return bufs[1]   # the common case: a small message without tensors
    if len(bufs) < 2:
        raise CodecError(f"expected at least 2 frames, got {len(bufs)}")
    header = bufs[0]
    if len(header) != _HEADER.size:
        raise CodecError(f"bad header length {len(header)}")
    magic, version, flags = _HEADER.unpack(header)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise CodecError(f"protocol version {version} not supported (this side speaks {PROTOCOL_VERSION})")
    if not flags & FLAG_TENSORS and len(bufs) > 2:
        raise CodecError("tensor frames present but header says none")
    if len(bufs[1]) > max_body:
        raise CodecError(f"body of {len(bufs[1])} bytes exceeds limit {max_body}")
    for b in bufs[2:]:
        if len(b) > max_frame:
            raise CodecError(f"frame of {len(b)} bytes exceeds limit {max_frame}")
    return bufs[1]


_FIELD_SETS: dict[type, frozenset] = {}   # per class: its field names, for a one-step check


def _build_message(kind, fields):
    cls = _messages._REGISTRY.get(kind) if type(kind) is str else None
    if cls is None:
        raise CodecError(f"unknown message kind {kind!r}")
    if not isinstance(fields, dict):
        raise CodecError(f"fields of {kind} are not a map")
    names = _FIELD_SETS.get(cls)
    if names is None:
        names = _FIELD_SETS[cls] = frozenset(_messages._FIELD_NAMES[cls])
    if fields.keys() != names:
        fields = {k: v for k, v in fields.items() if k in names}   # newer or older peer
    try:
        return cls(**fields)
    except TypeError as exc:
        raise CodecError(f"cannot build {kind}: {exc}") from exc


def _build_tensor(buf, lib, dtype, shape):
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CodecError(f"bad tensor shape {shape!r}")
    numel = math.prod(shape)
    if lib == _LIB_NUMPY:
        import numpy as np
        try:
            np_dtype = np.dtype(dtype)
        except TypeError as exc:
            raise CodecError(f"unknown numpy dtype {dtype!r}") from exc
        if np_dtype.hasobject:
            raise CodecError("object arrays are not allowed")
        _check_size(buf, numel * np_dtype.itemsize, dtype, shape)
        return np.frombuffer(buf, dtype=np.uint8).view(np_dtype).reshape(shape)
    if lib == _LIB_TORCH:
        try:   # a fixed table: a name from the wire never reaches getattr(torch, ...) (which imports submodules)
            torch_dtype = dtype_from_name(dtype)
        except GraphError:
            raise CodecError(f"unknown torch dtype {dtype!r}") from None
        import torch
        _check_size(buf, numel * torch_dtype.itemsize, dtype, shape)
        if numel == 0:
            return torch.empty(shape, dtype=torch_dtype)
        if isinstance(buf, bytes):
            buf = bytearray(buf)   # torch wants writable memory; only small test inputs arrive as bytes
        return torch.frombuffer(buf, dtype=torch.uint8).view(torch_dtype).reshape(shape)
    raise CodecError(f"unknown tensor library code {lib!r}")


def _check_size(buf, expected: int, dtype, shape):
    if len(buf) != expected:
        raise CodecError(f"tensor frame has {len(buf)} bytes, {dtype}{shape} needs {expected}")
