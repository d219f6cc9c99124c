"""Run kernels recorded by the aten capture on one torch device.

:class:`AtenProgram` owns the device memory of one plan's buffers (an arena:
one flat uint8 tensor per buffer) and pre-binds every kernel to tensor views
into it, so running a segment is a loop of op calls with no per-step
decoding.  Blocking: every method runs torch work synchronously on the
calling thread (device actors call it from their worker thread).
"""
from __future__ import annotations

import functools
import itertools
import sys
from typing import Any, Callable, Iterable, Sequence

import torch

from tessera_actors.graph import dtype_from_name
from tessera_actors.graph import KernelGraph

from tessera_actors.devices import other_device_op
from tessera_actors.execution.allow import KernelRefused, check_allocation, default_cap, resolve_allowed, signature
from tessera_actors.execution.variants import cpu_variant


class BackendError(RuntimeError):
    """A kernel that cannot be bound or run on this device."""


_OUT: dict[Any, Any] = {}


def out_variant(op):
    """The ``out=`` overload of ``op`` (``mm.default`` -> ``mm.out``,
    ``where.self`` -> ``where.self_out``) when it takes exactly ``op``'s
    arguments plus one written ``out`` tensor, else None.  Running a kernel
    into its output buffer this way skips the fresh result tensor and its
    copy (on CPU a large fresh tensor also costs page faults)."""
    if op in _OUT:
        return _OUT[op]
    found = None
    try:
        if any(t in op.tags for t in (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)):
            _OUT[op] = None   # its result's size depends on the values: out= would resize the buffer
            return None
        name = op._overloadname
        packet = op.overloadpacket
        want = [(a.name, str(a.type)) for a in op._schema.arguments]
        for cand in ([f"{name}_out"] if name != "default" else []) + ["out"]:
            if cand not in packet.overloads():
                continue
            o = getattr(packet, cand)
            written = [a for a in o._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            rest = [(a.name, str(a.type)) for a in o._schema.arguments
                    if not (a.alias_info is not None and a.alias_info.is_write)]
            if [a.name for a in written] == ["out"] and rest == want and len(o._schema.returns) == 1:
                found = o
                break
    except (AttributeError, RuntimeError):
        found = None
    _OUT[op] = found
    return found


def _in_place(name: str) -> bool:
    """Whether ``aten.x_.overload`` is an in-place op (its name ends in ``_``)."""
    parts = str(name).split(".")
    return parts[1 if len(parts) > 1 else 0].endswith("_")


def resolve_op(name: str):
    """``aten.mm.default`` -> ``torch.ops.aten.mm.default``, for ops on the
    allow-list only (``tessera_actors.execution.allow``; else ``KernelRefused``)."""
    return resolve_allowed(name)


class AtenProgram:
    capturable = True   # its runs may be captured as CUDA graphs (see tessera_actors/execution/streaming.py)

    def __init__(self, graph: KernelGraph, device: torch.device, buffer_ids: Iterable[int],
                 memory_limit: int | None = None, shared: dict[int, torch.Tensor] | None = None) -> None:
        """Allocate the buffers ``buffer_ids`` on ``device``; those found in
        ``shared`` (e.g. weights shared by several micro-batch programs) are
        used as they are, not allocated or counted."""
        self.graph = graph
        self.device = device
        shared = shared or {}
        ids = sorted(set(buffer_ids))
        own = [b for b in ids if b not in shared]
        need = sum(graph.buffers[b].nbytes for b in own)
        if memory_limit is not None and need > memory_limit:
            raise BackendError(f"{device}: plan needs {need} bytes of buffers, budget is {memory_limit} "
                               f"(short by {need - memory_limit})")
        self.cap = memory_limit if memory_limit is not None else default_cap(device)
        if need > self.cap:
            raise KernelRefused(f"{device}: plan needs {need} bytes of buffers, over the memory cap of {self.cap}")
        self.arena: dict[int, torch.Tensor] = {b: shared[b] for b in ids if b in shared}
        for b in own:
            self.arena[b] = torch.zeros(max(graph.buffers[b].nbytes, 1), dtype=torch.uint8, device=device)
        self.nbytes = need
        self._bound: dict[int, Callable[[], None]] = {}
        self.variants = 0   # kernels bound to the device's own variant of their op (execution/variants.py)
        # a tensor reference's view, made once for every kernel that names it (the kernels of one
        # bucket name the same few hundred references thousands of times); in-place ops get their own
        self._views: dict[tuple, torch.Tensor] = {}

    # -- memory ---------------------------------------------------------
    def view(self, ref: Sequence[Any]) -> torch.Tensor:
        b, off, shape, stride, dt = ref
        dtype = dtype_from_name(dt)
        item = torch.empty((), dtype=dtype).element_size()
        try:
            base = self.arena[b]
        except KeyError:
            raise BackendError(f"buffer {b} is not resident on {self.device}") from None
        _check_view(ref, item, base.numel())
        # a buffer may be a view into a larger allocation (a staging ring's bytes): offsets count from its start
        start = base.storage_offset() * base.element_size() + off
        if start % item:
            raise BackendError(f"buffer {b}: a {dt} view at byte {start} of its storage is not aligned")
        return torch.empty(0, dtype=dtype, device=self.device).set_(
            base.untyped_storage(), start // item, tuple(shape), tuple(stride))

    def load(self, values: dict[int, torch.Tensor]) -> None:
        """Copy initial bytes (flat uint8) into resident buffers; others ignored."""
        for b, v in values.items():
            if b in self.arena:
                self.arena[b][: v.numel()].copy_(v.reshape(-1).view(torch.uint8))

    def read(self, buffer: int, ranges: Sequence[Sequence[int]], pinned: bool = False) -> torch.Tensor:
        """The bytes of ``ranges`` concatenated (a new tensor: a snapshot);
        ``pinned``: as :meth:`reader` says."""
        return self.reader(buffer, ranges, pinned)()

    def reader(self, buffer: int, ranges: Sequence[Sequence[int]], pinned: bool = False) -> Callable[[], torch.Tensor]:
        """A call taking the snapshot :meth:`read` takes, with the views into
        the arena made once (a transfer's are made at install: its hot path
        is one copy).  ``pinned``: the snapshot goes straight into pinned host
        memory (queued on the current stream when the arena is on a GPU:
        settled once that stream is); on a machine without CUDA it is plain
        host memory."""
        a = self.arena[buffer]
        views = [a[s:e] for s, e in ranges]
        n = sum(e - s for s, e in ranges)
        if pinned and torch.cuda.is_available():
            queued = a.is_cuda
            # two pinned buffers made here (at install) and taken in turn, never one allocated and freed
            # per step: freeing a block of the caching host allocator records an event on every stream
            # that used it, and when another device actor's worker is capturing a CUDA graph on one of
            # them the event joins that capture; the next pinned allocation that polls it fails with
            # "CUDA error: invalid argument" (seen on an H200, cuda:0 beside a cpu device)
            ring = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            turn = itertools.count()

            def into_pinned() -> torch.Tensor:
                i = next(turn) % 2
                if sys.getrefcount(ring[i]) > 2:   # the receiver still holds it from two sends ago
                    ring[i] = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                out = ring[i]
                if len(views) == 1:
                    out.copy_(views[0], non_blocking=queued)
                    return out
                pos = 0
                for v in views:
                    out[pos:pos + v.numel()].copy_(v, non_blocking=queued)
                    pos += v.numel()
                return out
            return into_pinned
        if len(views) == 1:
            return views[0].clone
        return lambda: torch.cat(views)

    def write(self, buffer: int, ranges: Sequence[Sequence[int]], data: torch.Tensor) -> None:
        self.writer(buffer, ranges)(data)

    def writer(self, buffer: int, ranges: Sequence[Sequence[int]]) -> Callable[[torch.Tensor], None]:
        """A call writing bytes into ``ranges`` of ``buffer`` (a flat uint8
        tensor, or any tensor taken as its bytes), the views made once."""
        a = self.arena[buffer]
        views = [a[s:e] for s, e in ranges]
        n = sum(e - s for s, e in ranges)
        # into device memory the copy is ordered on the stream the kernels run on; into host memory
        # the CPU kernels read it next, so it must be done when this returns (a device-to-host copy
        # into pageable memory is not guaranteed synchronous with non_blocking)
        queued = a.is_cuda

        def write(data: torch.Tensor) -> None:
            if data.dtype != torch.uint8 or data.dim() != 1:
                data = data.reshape(-1).view(torch.uint8)
            if data.numel() != n:
                raise BackendError(f"buffer {buffer}: received {data.numel()} bytes for ranges of {n}")
            if data.is_cuda:
                # the copy below is queued, not done: keep the sender's block from
                # being reused until the stream that reads it got past the copy
                data.record_stream(torch.cuda.current_stream(data.device))
            if len(views) == 1:
                views[0].copy_(data, non_blocking=queued)
                return
            pos = 0
            for v in views:
                v.copy_(data[pos:pos + v.numel()], non_blocking=queued)
                pos += v.numel()
        return write

    # -- kernels --------------------------------------------------------
    def _arg(self, v: Any, meta: bool = False, own: bool = True) -> Any:
        """A kernel's argument record as the op takes it: tensor references
        as views into the arena (``own``: a view of its own, else the one
        every kernel shares), or (``meta``) as meta tensors of their
        shape, strides and dtype, on the meta device (the allocation check)."""
        if isinstance(v, dict):
            if "t" in v:
                if meta:
                    _, _, shape, stride, dt = v["t"]
                    return torch.empty_strided(shape, stride, dtype=dtype_from_name(dt), device="meta")
                return self.view(v["t"]) if own else self.shared_view(v["t"])
            if "dt" in v:
                return dtype_from_name(v["dt"])
            if "dev" in v:
                return torch.device("meta") if meta else self.device
            if "layout" in v:
                return _torch_constant(v["layout"], torch.layout)
            if "mf" in v:
                return _torch_constant(v["mf"], torch.memory_format)
            raise BackendError(f"unknown argument record {v!r}")
        if isinstance(v, list):
            return [self._arg(x, meta, own) for x in v]
        return v

    def shared_view(self, ref: Sequence[Any]) -> torch.Tensor:
        """:meth:`view` of ``ref``, one tensor for every kernel argument that
        names it (the kernels share it: none may change its shape or strides)."""
        b, off, shape, stride, dt = ref
        key = (b, off, tuple(shape), tuple(stride), dt)
        t = self._views.get(key)
        if t is None:
            t = self._views[key] = self.view(ref)
        return t

    def bind(self, kid: int) -> Callable[[], None]:
        fn = self._bound.get(kid)
        if fn is None:
            fn = self._bound[kid] = self._bind(kid)
        return fn

    def _bind(self, kid: int) -> Callable[[], None]:
        k = self.graph.kernels[kid]
        p = k.payload
        other = other_device_op(p["op"], self.device.type)
        if other is not None:
            raise KernelRefused(f"kernel {kid} ({p['op']}) is a {other} kernel, bound on {self.device}: the "
                                f"graph was captured on a {other} device (capture on meta, or record the "
                                "composite whole: tessera_actors/capture/fused.py)")
        op = resolve_op(p["op"])
        # an in-place op (``unsqueeze_``, ``resize_``, ``index_put_``) may change its argument's shape or
        # strides, not just its bytes: it gets views of its own; every other kernel shares them
        own = _in_place(p["op"])
        args = self._arg(p["args"], own=own)
        kwargs = {n: self._arg(v, own=own) for n, v in p["kwargs"].items()}
        check_allocation(p["op"], op, signature((p["args"], p["kwargs"])), lambda: (
            self._arg(p["args"], True), {n: self._arg(v, True) for n, v in p["kwargs"].items()}), self.cap)
        # an out= run that resizes its output is restored at once (_Into), so outputs may share views too
        copies = [(i, self.view(o["ref"]["t"]) if own else self.shared_view(o["ref"]["t"]))
                  for i, o in enumerate(p["outs"]) if o is not None and not o["alias"]]
        call = _raw(op)
        if not copies:
            return functools.partial(call, *args, **kwargs)
        if len(p["outs"]) == 1:
            dst = copies[0][1]
            variant = cpu_variant(self, p, dst) if self.device.type == "cpu" else None
            if variant is not None:
                self.variants += 1
                return variant

            def run_one() -> None:
                dst.copy_(call(*args, **kwargs))
            into = out_variant(op)
            return run_one if into is None else _Into(into, args, kwargs, dst, run_one, self._bound, kid)

        def run_many() -> None:
            res = call(*args, **kwargs)
            for i, d in copies:
                d.copy_(res[i])
        return run_many

    def run_kernels(self, kernel_ids: Iterable[int]) -> None:
        """The kernels, one after the other, on the current stream (what a
        device's runner captures and replays as one unit)."""
        bound = self._bound
        for kid in kernel_ids:
            fn = bound.get(kid)
            if fn is None:
                fn = self.bind(kid)
            fn()

    def run(self, kernel_ids: Iterable[int]) -> None:
        """The kernels, eagerly (a device actor runs them through its runner)."""
        self.run_kernels(kernel_ids)


def _raw(op) -> Callable[..., Any]:
    """The C++ callable behind a ``torch.ops`` overload (what its
    ``__call__`` calls: one Python frame less a kernel), else ``op``."""
    call = getattr(op, "_op", None)
    return call if callable(call) else op


class _Into:
    """A kernel run into its output buffer (``out=``).  The first run checks
    that the op wrote into the buffer as it is - same storage, offset, shape
    and strides (a resize would detach the view from the arena); if so the
    kernel is from then on a ``functools.partial`` of the op's C++ callable
    (put in ``bound``, the program's table, in its place: no Python frame of
    ours a run), else the view is restored and the result-and-copy run
    takes its place for good."""

    __slots__ = ("fn", "into", "args", "kwargs", "dst", "copy", "bound", "kid")

    def __init__(self, into, args, kwargs, dst: torch.Tensor, copy: Callable[[], None],
                 bound: dict[int, Callable[[], None]], kid: int) -> None:
        self.into, self.args, self.kwargs, self.dst, self.copy = into, args, kwargs, dst, copy
        self.bound, self.kid = bound, kid
        self.fn = self._first

    def __call__(self) -> None:
        self.fn()

    def _first(self) -> None:
        d = self.dst
        storage, where = d.untyped_storage(), (d.data_ptr(), d.storage_offset(), d.shape, d.stride())
        run = functools.partial(_raw(self.into), *self.args, **self.kwargs, out=d)
        try:
            run()
            ok = (d.data_ptr(), d.storage_offset(), d.shape, d.stride()) == where
        except (RuntimeError, TypeError):
            ok = False
        if ok:
            self.fn = self.bound[self.kid] = run
            return
        d.set_(storage, where[1], where[2], where[3])
        self.fn = self.bound[self.kid] = self.copy
        self.copy()


# the layouts and memory formats a kernel argument may name: a fixed table (as graph.DTYPE_NAMES), so a
# name from an installed plan never reaches getattr(torch, ...), which imports torch submodules on demand
_CONSTANT_NAMES = {"layout": ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc"),
                   "memory_format": ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")}


def _torch_constant(name, kind: type):
    known = _CONSTANT_NAMES["layout" if kind is torch.layout else "memory_format"]
    value = getattr(torch, name, None) if isinstance(name, str) and name in known else None
    if not isinstance(value, kind):
        raise KernelRefused(f"{name!r} is not a torch {kind.__name__}")
    return value


def _check_view(ref, item: int, storage_bytes: int) -> None:
    """A tensor reference must stay inside its buffer (no negative strides or offsets)."""
    _, off, shape, stride, _ = ref
    if not (isinstance(off, int) and off >= 0 and off % item == 0 and len(shape) == len(stride)
            and all(isinstance(x, int) and x >= 0 for x in (*shape, *stride))):
        raise KernelRefused(f"malformed tensor reference {ref!r}")
    if 0 in shape:
        return
    last = off + item * (1 + sum((n - 1) * s for n, s in zip(shape, stride)))
    if last > storage_bytes:
        raise KernelRefused(f"tensor reference {ref!r} reaches byte {last} of a {storage_bytes}-byte buffer")
