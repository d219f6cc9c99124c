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
* allocations bounded before they happen: size-like integer arguments
  (``size``, ``repeats``, ``pad``, ``output_size``, ..., every integer of a
  factory op such as ``eye``, the bounds of ``arange``/``linspace``) may not
  ask for more elements than the plan's memory cap has bytes.

Triton kernels (``check_triton_record``) load only modules from inductor's
cache directory or the source the graph carries.

The cap is the device's ``mem=`` budget, or else ``default_cap(device)``:
the memory the device has (host RAM for CPUs, the GPU's memory for CUDA).
Pure checks on the schema and argument values; no torch work is run.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

DENIED = frozenset({
    "from_file", "_from_file", "set_", "_set_", "_nested_view_from_buffer",
    "_nested_view_from_buffer_copy", "_nested_tensor_from_tensor_list", "_reshape_alias", "_reshape_alias_copy",
    "bincount", "_pin_memory", "pin_memory", "share_memory_", "_share_memory_",
    "_cufft_set_plan_cache_max_size", "_cufft_clear_plan_cache",
})
_FILE_ARGS = frozenset({"filename", "path", "file", "f"})
_SIZE_LISTS = frozenset({"size", "sizes", "repeats", "pad", "output_size", "shape"})
_DATA_SIZED = frozenset({"repeat_interleave"})   # allowed only with a fixed output_size when repeats is a tensor
_RANGES = frozenset({"arange", "range", "linspace", "logspace"})   # their number arguments set the length
_SIZE_SCALARS = frozenset({"repeats", "minlength", "num_samples", "output_size", "bins", "steps", "n", "m", "row", "col"})


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


def resolve_allowed(name: Any):
    """The ``torch.ops`` overload of ``aten.op.overload`` if the allow-list
    takes it; ``KernelRefused`` otherwise."""
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


def check_allocation(name: str, fn, args: list, kwargs: dict, cap: int) -> None:
    """Refuse size-like arguments that ask for more elements than ``cap``
    bytes, and output sizes that tensor values would decide."""
    schema = fn._schema.arguments
    factory = not any("Tensor" in str(a.type) for a in schema)
    values = dict(zip((a.name for a in schema), args))
    values.update(kwargs)
    if name.split(".")[1] in _DATA_SIZED and any("Tensor" in str(a.type) for a in schema if a.name == "repeats") \
            and values.get("output_size") is None:
        raise KernelRefused(f"op {name!r}: tensor repeats without output_size make the output size data-dependent")
    for arg in schema:
        if arg.name not in values:
            continue
        v, kind = values[arg.name], str(arg.type)
        if "List[int]" in kind and (factory or arg.name in _SIZE_LISTS):
            elements = _product(v)
        elif ("int" in kind and "List" not in kind and (factory or arg.name in _SIZE_SCALARS)) or (
                kind == "number" and name.split(".")[1] in _RANGES):
            elements = abs(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0
        else:
            continue
        if elements > cap:
            raise KernelRefused(f"op {name!r}: {arg.name}={_short(v)} asks for {elements:.4g} elements, "
                                f"over the plan's memory cap of {cap} bytes")


def _product(v: Any) -> float:
    if isinstance(v, (list, tuple)):
        return math.prod(abs(x) if isinstance(x, (int, float)) else 1 for x in v) if v else 0
    return abs(v) if isinstance(v, (int, float)) else 0


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) < 60 else text[:57] + "..."


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
