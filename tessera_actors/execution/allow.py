"""What a plan may run: the allow-list of aten kernels, checked at install.

A node runs kernels sent to it by whoever installs a plan, so every kernel
record is checked before it is bound (``check_aten_call``), and an install
with one bad kernel fails as a whole with a ``KernelRefused`` naming it:

* only ops of the ``aten`` namespace, by schema;
* no op that reaches outside the device's memory: files and processes
  (``from_file`` or any schema with a ``filename``/``path`` string),
  storages from pointers or other storages (any ``Storage`` argument,
  ``set_``, ``_nested_view_from_buffer``), unchecked stride views
  (``_reshape_alias``), data-dependent output sizes that the sender controls
  (``bincount``, ``repeat_interleave``);
* allocations bounded before they happen (``check_allocation``): every
  kernel is run once on meta tensors at install, and one whose outputs (or
  the growth of an argument it writes) would take more bytes than the
  plan's memory cap is refused - whatever argument asks for them (``pad``,
  ``repeats``, scale factors, a factory's size, an ``out=`` to resize).
  An op whose output size its values decide is bounded by its inputs
  (boolean-mask indexing, ``masked_select``, ``nonzero``) or refused.

Triton kernels (``check_triton_record``) load only modules from inductor's
cache directory or the source the graph carries.

The cap is the device's ``mem=`` budget, or else ``default_cap(device)``:
the memory the device has (host RAM for CPUs, the GPU's memory for CUDA).
Checks on the schema and argument values, and meta-tensor runs: no device
memory is touched.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch

DENIED = frozenset({
    "from_file", "_from_file", "set_", "_set_", "_nested_view_from_buffer",
    "_nested_view_from_buffer_copy", "_nested_tensor_from_tensor_list", "_reshape_alias", "_reshape_alias_copy",
    "bincount", "_pin_memory", "pin_memory", "share_memory_", "_share_memory_",
    "_cufft_set_plan_cache_max_size", "_cufft_clear_plan_cache",
})
_FILE_ARGS = frozenset({"filename", "path", "file", "f"})


class KernelRefused(RuntimeError):
    """A kernel that a node will not run (not on the allow-list, or over the memory cap)."""


def default_cap(device: torch.device) -> int:
    """Bytes a plan may use on ``device`` when its spec sets no ``mem=``."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


_ALLOWED: dict[str, Any] = {}   # op name -> its overload, once allowed (a graph names the same ops again and again)


def resolve_allowed(name: Any):
    """The ``torch.ops`` overload of ``aten.op.overload`` if the allow-list
    takes it; ``KernelRefused`` otherwise."""
    fn = _ALLOWED.get(name) if isinstance(name, str) else None
    if fn is None:
        fn = _ALLOWED[name] = _resolve(name)
    return fn


def _resolve(name: Any):
    if not isinstance(name, str) or name.count(".") != 2:
        raise KernelRefused(f"op name {name!r} is not namespace.op.overload")
    ns, op, overload = name.split(".")
    if ns != "aten":
        raise KernelRefused(f"op {name!r}: only aten ops may run on a node")
    if op in DENIED or op.rstrip("_") in DENIED:
        raise KernelRefused(f"op {name!r} is not allowed on a node (file, process, storage or "
                            f"unbounded-allocation op)")
    try:
        fn = getattr(getattr(torch.ops.aten, op), overload)
    except AttributeError:
        raise KernelRefused(f"unknown op {name!r} in this torch {torch.__version__}") from None
    for arg in fn._schema.arguments:
        kind = str(arg.type)
        if "Storage" in kind or (arg.name in _FILE_ARGS and "str" in kind):
            raise KernelRefused(f"op {name!r} takes {arg.name}: {kind}; ops reaching storages or files "
                                f"are not allowed")
    return fn


_SIZED: dict[tuple, int | str] = {}   # (op, argument signature) -> bytes one run allocates, or why unknown
_SIZED_MAX = 1 << 16
# ops whose output size the values decide (no meta kernel can size them): their bound from the inputs
_DATA_SIZED = {"index": "self", "masked_select": "broadcast", "nonzero": "coordinates", "argwhere": "coordinates"}


def signature(v: Any) -> Any:
    """A hashable key of a kernel's argument records that holds everything
    its output sizes depend on: tensor references as shape, strides and
    dtype (not which buffer, nor where in it), every other value with its
    type (``1``, ``1.0`` and ``True`` make different dtypes)."""
    t = type(v)
    if t is list or t is tuple:
        return tuple(map(signature, v))
    if t is dict:
        ref = v.get("t")
        if len(v) == 1 and type(ref) is list and len(ref) == 5:
            return ("t", signature(ref[2]), signature(ref[3]), ref[4])
        return ("d", tuple(sorted((str(k), signature(x)) for k, x in v.items())))
    return (t, v)


def check_allocation(name: str, fn, key: Any, on_meta: Callable[[], tuple[list, dict]], cap: int) -> None:
    """Refuse a kernel whose run would allocate more than ``cap`` bytes.
    What it allocates - its outputs that alias no argument, and what it
    grows an argument by (``out=``, ``resize_``) - is measured by running it
    on meta tensors (``on_meta()``: its arguments as such), before any
    device memory is touched; an op whose output size its values decide is
    bounded from its inputs, or refused when it cannot be.  The result is
    cached by ``(name, key)`` (:func:`signature`): the bucket plans of a
    model repeat their layers' kernels, and a re-placement installs them
    again.  Runs once per kernel, at install; a step pays nothing."""
    cache = key is not None
    try:
        sized = _SIZED.get((name, key)) if cache else None
    except TypeError:   # an unhashable value in the records
        cache, sized = False, None
    if sized is None:
        args, kwargs = on_meta()
        sized = meta_bytes(name, fn, args, kwargs)
        if cache:
            if len(_SIZED) >= _SIZED_MAX:
                _SIZED.pop(next(iter(_SIZED)))
            _SIZED[(name, key)] = sized
    if isinstance(sized, str):
        raise KernelRefused(f"op {name!r}: {sized}")
    if sized > cap:
        raise KernelRefused(f"op {name!r} would allocate {sized} bytes, over the plan's memory cap of {cap} bytes")


def meta_bytes(name: str, fn, args: list, kwargs: dict) -> int | str:
    """Bytes one run of ``fn`` allocates, from a run on meta tensors (``args``
    and ``kwargs`` hold meta tensors where the kernel takes tensors); a
    string saying why when that cannot be known."""
    try:
        args, kwargs = _on_meta_device(fn, args, kwargs)
    except _OtherDevice as e:
        return str(e)
    tensors = list(_tensors((args, kwargs)))
    before = [t.untyped_storage().nbytes() for t in tensors]
    try:
        with torch.device("meta"):
            out = fn(*args, **kwargs)
    except Exception as e:   # noqa: BLE001 - whatever a meta kernel raises, the size is unknown
        wide = _bf16_sized(fn, args, kwargs)
        if wide is not None:
            return wide
        bound = _data_sized(name, args, kwargs)
        if bound is not None:
            return bound
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return f"its output sizes cannot be known before it runs ({type(e).__name__}: {why})"
    grown = sum(max(0, t.untyped_storage().nbytes() - n) for t, n in zip(tensors, before))
    return _fresh_bytes(fn, out) + grown


def _fresh_bytes(fn, out, float_size: int = 0) -> int:
    """Bytes of the results of ``fn`` (its output ``out``) that are not a
    view of an argument nor an argument written in place; ``float_size``:
    count floating results at that element size instead of their own."""
    returns = fn._schema.returns
    outs = out if isinstance(out, (tuple, list)) and len(returns) != 1 else [out]
    return sum(t.numel() * (float_size if float_size and t.is_floating_point() else t.element_size())
               for r, o in zip(returns, outs) if r.alias_info is None for t in _tensors(o))


def _bf16_sized(fn, args: list, kwargs: dict) -> int | None:
    """Fresh output bytes of ``fn`` from a meta run with its floating tensors
    in bfloat16, counted at the widest floating input's element size: some
    meta kernels take bf16 only (``aten._grouped_mm``) while the CPU kernel
    runs float32 too.  None when that run fails as well."""
    floats = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
    if not floats or all(t.dtype == torch.bfloat16 for t in floats):
        return None
    wide = max(t.element_size() for t in floats)

    def cast(v):
        if isinstance(v, torch.Tensor):
            return v.to(torch.bfloat16) if v.is_floating_point() else v
        if isinstance(v, (list, tuple)):
            return type(v)(cast(x) for x in v)
        return v
    try:
        with torch.device("meta"):
            out = fn(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})
    except Exception:   # noqa: BLE001 - the size stays unknown
        return None
    return _fresh_bytes(fn, out, wide)


def _on_meta_device(fn, args: list, kwargs: dict) -> tuple[list, dict]:
    """``args``/``kwargs`` with every ``Device`` argument of ``fn``'s schema
    set to the meta device, given or not (a factory op left to its default
    device, or told another one, would allocate for real)."""
    args, kwargs = list(args), dict(kwargs)
    meta = torch.device("meta")
    for i, a in enumerate(fn._schema.arguments):
        if "Device" not in str(a.type):
            continue
        positional = i < len(args) and not a.kwarg_only
        given = args[i] if positional else kwargs.get(a.name)
        if given is not None and given != meta:   # {"dev": ...} records became meta; a name would be another device
            raise _OtherDevice(f"its {a.name} argument names {given!r}: a kernel runs on its plan's device "
                               f"(a device record), not on one it names")
        if positional:
            args[i] = meta
        else:
            kwargs[a.name] = meta
    return args, kwargs


class _OtherDevice(Exception):
    """A kernel naming a device of its own."""


def warm_meta() -> None:
    """Size one kernel on meta tensors (``constant_pad_nd``, whose meta
    kernel is Python): the lazy imports that takes (seconds, once a process)
    happen here - a device calls it on its worker when it opens, while the
    engine still starts - not in the first install."""
    x = torch.empty(1, device="meta")
    meta_bytes("aten.constant_pad_nd.default", torch.ops.aten.constant_pad_nd.default, [x, [0, 1]], {})


def _tensors(v: Any):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _tensors(x)


def _data_sized(name: str, args: list, kwargs: dict) -> int | None:
    """The most an op of :data:`_DATA_SIZED` can allocate, from its inputs'
    sizes (a boolean-mask index selects each element at most once; the
    coordinates of nonzero elements are ndim int64s each); else None."""
    rule = _DATA_SIZED.get(name.split(".")[1])
    first = args[0] if args else kwargs.get("self", kwargs.get("input"))
    if rule is None or not isinstance(first, torch.Tensor):
        return None
    if rule == "self":
        return first.numel() * first.element_size()
    if rule == "coordinates":
        return first.numel() * max(1, first.dim()) * 8
    mask = args[1] if len(args) > 1 else kwargs.get("mask")
    if not isinstance(mask, torch.Tensor):
        return None
    try:
        shape = torch.broadcast_shapes(first.shape, mask.shape)
    except RuntimeError:
        return None
    return math.prod(shape) * first.element_size()


def check_triton_record(payload: dict, has_source: bool) -> str:
    """The module file a Triton launch record may be loaded from: only one
    inside inductor's cache directory (else a plan could make the node
    import any Python file on its disk); any other is ignored in favour of
    the source the graph carries ("" = use that source), and without one the
    kernel is refused.  The kernel name must be an identifier.  The source
    in the graph is code of the installing capture: only authenticated
    peers can install (``transport.auth``)."""
    name = payload.get("triton")
    if not isinstance(name, str) or not name.isidentifier():
        raise KernelRefused(f"Triton kernel name {name!r} is not an identifier")
    file = payload.get("file") or ""
    if file:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        root = os.path.realpath(cache_dir())
        real = os.path.realpath(file) if isinstance(file, str) else ""
        if real.endswith(".py") and real.startswith(root + os.sep):
            return file
    if not has_source:
        raise KernelRefused(f"Triton kernel {name!r}: module {file!r} is outside inductor's cache directory and "
                            f"the graph carries no source for it")
    return ""
