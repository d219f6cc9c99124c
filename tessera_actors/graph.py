"""The kernel-graph data model: buffers, kernels, their byte-range accesses and
the dependency edges derived from them.

Pure Python (no torch): a graph captured on a GPU machine is saved with
:meth:`KernelGraph.save` and planned, simulated and tested anywhere.

Contract of an access: kernel ``k`` touches bytes ``[start, end)`` of buffer
``b`` with mode ``r`` (read), ``w`` (write) or ``rw``.  Edges come from
overlapping byte ranges in program order (kernel index order):

* RAW: a kernel reads bytes whose last writer is an earlier kernel; the edge
  carries the exact byte ranges it needs from that writer (what a transfer
  must move when the two run on different devices);
* WAR: a kernel writes bytes an earlier kernel read since their last write;
* WAW: a kernel writes bytes an earlier kernel wrote last.

Because buffers are reused (a temporary slot holds many values over one
forward pass), WAR and WAW edges are real ordering constraints.
"""
from __future__ import annotations

import bisect
import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import msgpack

ROLES = ("weight", "input", "output", "state", "temp")
KINDS = ("ptx", "library", "host")
MODES = ("r", "w", "rw")
FORMAT_VERSION = 1


class GraphError(ValueError):
    """A graph that is malformed (bad ids, ranges outside buffers, ...)."""

# The element types a graph may name (buffer views, kernel arguments): a fixed table, so a name read from
# a file or a message never reaches ``getattr(torch, ...)`` (which imports torch submodules on demand).
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int64", "int32",
               "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128")


def dtype_from_name(name: str):
    """The ``torch.dtype`` called ``name`` (``"bfloat16"``), from :data:`DTYPE_NAMES`
    only; anything else is a :class:`GraphError`.  Imports torch (the caller
    runs kernels anyway)."""
    if not isinstance(name, str) or name not in DTYPE_NAMES:
        raise GraphError(f"unknown dtype {name!r}")
    import torch
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):   # a name this torch build lacks (an older torch's float8)
        raise GraphError(f"dtype {name!r} is not available in torch {torch.__version__}")
    return dt


def dtype_name(dt) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dt).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class Buffer:
    """One allocation. ``nbytes`` is its size; ``dtype``/``shape`` describe
    the tensor it was created for (informational: kernels carry their own
    views). ``role`` says how it lives: weights and inputs are provided before
    a step, outputs are read after it, state survives across steps, temps are
    scratch that may be reused."""

    id: int
    nbytes: int
    role: str = "temp"
    name: str = ""
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise GraphError(f"buffer {self.id}: unknown role {self.role!r} (expected one of {ROLES})")
        if self.nbytes < 0:
            raise GraphError(f"buffer {self.id}: negative size {self.nbytes}")


@dataclass(frozen=True, slots=True)
class Access:
    """Bytes ``[start, end)`` of buffer ``buffer`` read and/or written."""

    buffer: int
    start: int
    end: int
    mode: str = "r"

    @property
    def reads(self) -> bool:
        return "r" in self.mode

    @property
    def writes(self) -> bool:
        return "w" in self.mode

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Kernel:
    """One kernel launch in program order.

    ``payload`` is what a device backend needs to run it (for CPU capture: the
    aten op name and argument references; for CUDA: the launch record); the
    graph model never looks inside.  ``flops`` and ``bytes`` are cost features;
    ``indirect`` kernels reach memory through loaded pointers and must stay
    with their neighbours.  ``scope`` is the module path the kernel came from
    (e.g. ``layers.3.attn.q_proj``), ``layer`` its layer index (-1: none), and
    ``signature`` is equal for kernels doing the same work (repeated layers),
    so planners can exploit repetition.
    """

    id: int
    name: str
    kind: str = "library"
    accesses: tuple[Access, ...] = ()
    indirect: bool = False
    flops: float = 0.0
    bytes: float = 0.0
    signature: str = ""
    layer: int = -1
    scope: str = ""
    payload: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GraphError(f"kernel {self.id}: unknown kind {self.kind!r}")
        for a in self.accesses:
            if a.mode not in MODES:
                raise GraphError(f"kernel {self.id}: unknown access mode {a.mode!r}")


@dataclass(frozen=True, slots=True)
class Edge:
    """``src`` must run before ``dst``. For RAW edges ``ranges`` are the bytes
    of ``buffer`` that ``dst`` needs from ``src``."""

    src: int
    dst: int
    kind: str
    buffer: int
    ranges: tuple[tuple[int, int], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(e - s for s, e in self.ranges)


class _IntervalMap:
    """Per-buffer map from disjoint byte segments to (last writer, readers
    since that write). Segments are split on demand."""

    __slots__ = ("starts", "segs")

    def __init__(self, nbytes: int) -> None:
        self.starts = [0]
        self.segs: list[list[Any]] = [[0, max(nbytes, 1), None, []]]

    def _split(self, pos: int) -> None:
        i = bisect.bisect_right(self.starts, pos) - 1
        if i < 0:
            return
        s, e, w, r = self.segs[i]
        if s < pos < e:
            self.segs[i] = [s, pos, w, list(r)]
            self.segs.insert(i + 1, [pos, e, w, list(r)])
            self.starts.insert(i + 1, pos)

    def overlapping(self, start: int, end: int) -> Iterator[list[Any]]:
        self._split(start)
        self._split(end)
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while i < len(self.segs) and self.segs[i][0] < end:
            if self.segs[i][1] > start:
                yield self.segs[i]
            i += 1


def compute_edges(kernels: Iterable[Kernel], buffers: dict[int, Buffer]) -> list[Edge]:
    """Exact RAW/WAR/WAW edges of a kernel program (see module docstring).

    Each kernel's reads are resolved before its writes, so a read-modify-write
    kernel depends on the previous writer and not on itself."""
    maps: dict[int, _IntervalMap] = {}
    raw: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    order: dict[tuple[int, int, str, int], None] = {}
    for k in kernels:
        for a in k.accesses:
            if a.buffer not in buffers:
                raise GraphError(f"kernel {k.id} ({k.name}) accesses unknown buffer {a.buffer}")
            if a.start < 0 or a.end > buffers[a.buffer].nbytes or a.start > a.end:
                raise GraphError(
                    f"kernel {k.id} ({k.name}) accesses bytes [{a.start}, {a.end}) of buffer "
                    f"{a.buffer} which has {buffers[a.buffer].nbytes} bytes")
        live = [a for a in k.accesses if a.end > a.start]
        for a in live:
            if not a.reads:
                continue
            imap = maps.setdefault(a.buffer, _IntervalMap(buffers[a.buffer].nbytes))
            for seg in imap.overlapping(a.start, a.end):
                if seg[2] is not None and seg[2] != k.id:
                    raw[(seg[2], k.id, a.buffer)].append((seg[0], seg[1]))
                if k.id not in seg[3]:
                    seg[3].append(k.id)
        for a in live:
            if not a.writes:
                continue
            imap = maps.setdefault(a.buffer, _IntervalMap(buffers[a.buffer].nbytes))
            for seg in imap.overlapping(a.start, a.end):
                if seg[2] is not None and seg[2] != k.id:
                    order[(seg[2], k.id, "WAW", a.buffer)] = None
                for r in seg[3]:
                    if r != k.id:
                        order[(r, k.id, "WAR", a.buffer)] = None
                seg[2], seg[3] = k.id, []
    edges = [Edge(s, d, "RAW", b, tuple(_merge(rs))) for (s, d, b), rs in raw.items()]
    edges += [Edge(s, d, kind, b) for (s, d, kind, b) in order]
    edges.sort(key=lambda e: (e.dst, e.src, e.kind, e.buffer))
    return edges


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


@dataclass
class KernelGraph:
    """Kernels in program order plus the buffers they touch; edges are derived.

    ``meta`` holds free-form facts about the capture (model, bucket, device,
    dtype) and ``inputs``/``outputs`` name the buffers fed before and read
    after a step, in the order of the captured function's arguments/results."""

    kernels: list[Kernel]
    buffers: dict[int, Buffer]
    inputs: dict[str, int] = field(default_factory=dict)
    outputs: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    _edges: list[Edge] | None = field(default=None, repr=False)
    _state_groups: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for i, k in enumerate(self.kernels):
            if k.id != i:
                raise GraphError(f"kernel ids must be 0..n-1 in program order; position {i} has id {k.id}")

    @property
    def edges(self) -> list[Edge]:
        if self._edges is None:
            self._edges = compute_edges(self.kernels, self.buffers)
        return self._edges

    def forget_edges(self) -> None:
        """Drop the derived edges (:attr:`edges` computes them again when
        asked): a served bucket's graph needs them to be placed, not to run,
        and a real-size model's take over a megabyte a bucket."""
        self._edges = None

    def preds(self) -> list[list[int]]:
        """Predecessor kernel ids of every kernel (any edge kind)."""
        p: list[set[int]] = [set() for _ in self.kernels]
        for e in self.edges:
            p[e.dst].add(e.src)
        return [sorted(s) for s in p]

    def buffers_by_role(self) -> dict[str, int]:
        """Total bytes per buffer role."""
        out = {r: 0 for r in ROLES}
        for b in self.buffers.values():
            out[b.role] += b.nbytes
        return out

    def state_groups(self) -> list[list[int]]:
        """Kernel ids that touch each state buffer: each group must share a
        device, because state persists on the device across steps.  Derived
        once, like :attr:`edges` (a graph is not changed after it is built)."""
        if self._state_groups is None:
            groups: dict[int, set[int]] = defaultdict(set)
            for k in self.kernels:
                for a in k.accesses:
                    if self.buffers[a.buffer].role == "state":
                        groups[a.buffer].add(k.id)
            self._state_groups = tuple(tuple(sorted(g)) for _, g in sorted(groups.items()))
        return [list(g) for g in self._state_groups]

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = defaultdict(int)
        for e in self.edges:
            kinds[e.kind] += 1
        return {
            "kernels": len(self.kernels),
            "buffers": len(self.buffers),
            "edges": dict(kinds),
            "indirect": sum(k.indirect for k in self.kernels),
            "bytes_by_role": self.buffers_by_role(),
        }

    # -- serialisation --------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "meta": self.meta,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "buffers": [[b.id, b.nbytes, b.role, b.name, b.dtype, list(b.shape)]
                        for b in self.buffers.values()],
            "kernels": [[k.id, k.name, k.kind,
                         [[a.buffer, a.start, a.end, a.mode] for a in k.accesses],
                         k.indirect, k.flops, k.bytes, k.signature, k.layer, k.scope, k.payload]
                        for k in self.kernels],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KernelGraph":
        """The graph of a ``to_dict`` value; anything malformed (wrong types,
        missing fields, dangling buffer ids, ranges outside their buffer) is
        a ``GraphError`` that says what is wrong."""
        if not isinstance(d, dict):
            raise GraphError(f"a graph is a map, got {type(d).__name__}")
        if d.get("version") != FORMAT_VERSION:
            raise GraphError(f"graph format version {d.get('version')!r}, expected {FORMAT_VERSION}")
        try:
            buffers = {}
            for b in _records(d, "buffers", 6):
                _ints(b[0:2], "buffer")
                buffers[b[0]] = Buffer(b[0], b[1], _str(b[2]), _str(b[3]), _str(b[4]), tuple(_ints(b[5], "shape")))
            kernels, same = [], {}
            for k in _records(d, "kernels", 11):
                _ints(k[0:1], "kernel id")
                accesses = []
                for a in _list(k[3], "accesses"):
                    if not isinstance(a, list) or len(a) != 4:
                        raise GraphError(f"kernel {k[0]}: malformed access {a!r}")
                    buf, start, end, mode = _ints(a[0:3], "access") + [a[3]]
                    size = buffers[buf].nbytes if buf in buffers else None
                    if size is None or not 0 <= start <= end <= size:
                        raise GraphError(f"kernel {k[0]}: access {a!r} outside buffer {buf} ({size} bytes)")
                    accesses.append(shared_value(Access(buf, start, end, _str(mode)), same))
                name, sig, scope = (shared_value(_str(x), same) for x in (k[1], k[7], k[9]))
                kernels.append(Kernel(k[0], name, _str(k[2]), tuple(accesses), bool(k[4]), _num(k[5]),
                                      _num(k[6]), sig, _ints([k[8]], "layer")[0], scope, shared_value(k[10], same)))
            inputs, outputs, meta = d["inputs"], _list(d["outputs"], "outputs"), d["meta"]
            if not isinstance(inputs, dict) or not isinstance(meta, dict):
                raise GraphError("inputs and meta must be maps")
            for b in list(inputs.values()) + outputs:
                if type(b) is not int or b not in buffers:
                    raise GraphError(f"inputs/outputs name unknown buffer {b!r}")
            return cls(kernels, buffers, dict(inputs), list(outputs), dict(meta))
        except GraphError:
            raise
        except (KeyError, TypeError, IndexError, ValueError, AttributeError, RecursionError) as e:
            raise GraphError(f"malformed graph: {type(e).__name__}: {e}") from None

    def save(self, path: str | Path) -> None:
        """Write ``FILE_MAGIC``, the SHA-256 of the body, then the msgpack body."""
        body = msgpack.packb(self.to_dict(), use_bin_type=True)
        Path(path).write_bytes(FILE_MAGIC + hashlib.sha256(body).digest() + body)

    @classmethod
    def load(cls, path: str | Path) -> "KernelGraph":
        """Read a graph file; a file whose checksum does not match, or that is
        not a graph at all, is a ``GraphError`` naming the reason.  Files
        written before checksums (plain msgpack) still load, validated the same."""
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise GraphError(f"{path}: cannot read graph file: {e.strerror}") from None
        if data.startswith(FILE_MAGIC):
            digest, body = data[len(FILE_MAGIC):len(FILE_MAGIC) + 32], data[len(FILE_MAGIC) + 32:]
            if hashlib.sha256(body).digest() != digest:
                raise GraphError(f"{path}: checksum mismatch (the file is corrupt or was modified)")
        else:
            body = data
        try:
            d = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception as e:   # msgpack raises many types on garbage
            raise GraphError(f"{path}: not a kernel graph file ({type(e).__name__}: {e})") from None
        try:
            return cls.from_dict(d)
        except GraphError as e:
            raise GraphError(f"{path}: {e}") from None


def shared_value(v: Any, same: dict) -> Any:
    """``v`` with every part equal to one seen before (``same``: what was
    seen, one table per graph) replaced by that one object.  A kernel
    payload is plain data (maps, lists, numbers, strings) and a graph's
    payloads, accesses and names repeat the same tensor references, dtypes
    and signatures layer after layer (temporaries share slots): shared,
    they take about a ninth of the memory.  Nothing changes a graph's kernels after it is built, so the
    shared parts are never written.  Scalars compare with their type
    (``1``, ``1.0`` and ``True`` stay apart); a value that cannot be hashed
    is kept as it is."""
    t = type(v)
    if t is dict:
        v = {k: shared_value(x, same) for k, x in v.items()}
        key = ("d", tuple((k, _key(x)) for k, x in v.items()))
    elif t is list:
        v = [shared_value(x, same) for x in v]
        key = ("l", tuple(_key(x) for x in v))
    elif t is Access or t is str:
        key = v if t is Access else ("s", v)
    else:
        return v
    try:
        return same.setdefault(key, v)
    except TypeError:   # an unhashable leaf (never in a captured payload)
        return v


def _key(x: Any) -> Any:
    """The key of a part :func:`shared_value` made canonical: its identity
    for a map or list (equal ones are one object by now), else its type and value."""
    return id(x) if type(x) in (dict, list) else (type(x), x)


FILE_MAGIC = b"TSRAGRPH\x00\x02"   # graph files since checksums: magic + sha256(body) + body


_PARSED: dict[bytes, KernelGraph] = {}
_PARSED_MAX = 64


def graph_from_bytes(data: bytes) -> KernelGraph:
    """The graph a msgpack blob holds, parsed once per process: the
    scheduler and the devices receive the same bucket graphs again on every
    placement (a re-placement after a loss places every bucket anew), and
    parsing a real-size graph costs tens of milliseconds.  Callers treat
    the graph as read-only (plans carry their own annotations)."""
    key = hashlib.blake2b(data, digest_size=20).digest()
    g = _PARSED.get(key)
    if g is None:
        g = KernelGraph.from_dict(msgpack.unpackb(data, strict_map_key=False))
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[key] = g
    return g


def _records(d: dict, key: str, width: int) -> list:
    rows = _list(d[key], key)
    for r in rows:
        if not isinstance(r, list) or len(r) != width:
            raise GraphError(f"{key}: malformed record {str(r)[:80]} (expected {width} fields)")
    return rows


def _list(v: Any, what: str) -> list:
    if not isinstance(v, list):
        raise GraphError(f"{what}: expected a list, got {type(v).__name__}")
    return v


def _ints(values: Any, what: str) -> list:
    values = _list(values, what)
    for v in values:
        if type(v) is not int:
            raise GraphError(f"{what}: expected integers, got {v!r}")
    return values


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise GraphError(f"expected a string, got {type(v).__name__} {str(v)[:40]}")
    return v


def _num(v: Any) -> float:
    if type(v) not in (int, float):
        raise GraphError(f"expected a number, got {v!r}")
    return v
