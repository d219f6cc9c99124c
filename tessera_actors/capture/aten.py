"""Record one forward pass as a kernel program at the aten-op level.

Every aten op that computes (not a pure view) becomes a :class:`Kernel` whose
accesses are the exact byte ranges of the tensors it reads and writes, read
from the op's schema (``Tensor(a!)`` = written; ``out`` arguments = written
only).  Storages become buffers; temporaries are then packed into reusable
slots (as inductor and the caching allocator do), so WAR/WAW edges are real.

The payload of each kernel is a msgpack-able call record interpreted by the
``aten`` device backends (``tessera_actors/execution``): the op's qualified name and
its arguments, with tensors as references ``{"t": [buffer, byte_offset,
shape, strides, dtype]}``.  The same graph therefore runs on a CPU or a CUDA
device.

What a user writes is taken as it is: inputs and outputs may be any pytree
(``ModelOutput``, dicts, tuples, objects holding tensors) and plain keywords
are constants of the bucket (``pytree``); host reads (``.item()``,
``bool(t)``, ``.tolist()``) keep the branch taken at capture and add a guard
checked at every replay (``hostreads``); random ops with dropout 0 (the SDPA
variants in eval mode) are recorded like any other op.

Limits, reported as :class:`CaptureError` naming the op and the model's
source line (never a silently wrong graph): data-dependent output shapes,
random ops that draw numbers (dropout > 0 in training mode).
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera_actors.capture.errors import CaptureError
from tessera_actors.capture.fused import whole_ops
from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph, dtype_name as _dtype_name, shared_value
from tessera_actors.capture.hostreads import allowed_random, python_level_reads, record_guard, user_site
from tessera_actors.capture.pytree import encode_constant, flatten_inputs, flatten_outputs

_FULL_OVERWRITE = {"aten::copy_", "aten::fill_", "aten::zero_"}
_MATMUL = {"aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear", "aten::baddbmm",
           # quantized weights (models/quantized.py): activations [M, K] first, 2 M N K as a dense matmul
           "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
           # a mixture of experts' grouped GEMM (models/moe.py): rows [M, K] first, 2 M N K whatever the groups
           "aten::_grouped_mm"}


@dataclass
class CaptureResult:
    """The graph, the initial bytes of every weight/state buffer (flat uint8
    CPU tensors, keyed by buffer id) and the outputs the captured run gave."""

    graph: KernelGraph
    values: dict[int, torch.Tensor]
    outputs: list[torch.Tensor] = field(default_factory=list)


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the whole storage behind ``t``."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last+1) bytes of its storage that ``t`` can touch."""
    if t.numel() == 0:
        return (0, 0)
    item = t.element_size()
    start = t.storage_offset() * item
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return (start, start + (last + 1) * item)


class _Recorder(TorchDispatchMode):
    def __init__(self, roles: dict[int, tuple[str, str]], scope: list[str]) -> None:
        super().__init__()
        self.roles = roles          # storage key -> (role, name) for known storages
        self.scope = scope
        self.keep: list[Any] = []   # keeps storages alive so keys stay unique
        self.storages: dict[int, dict[str, Any]] = {}
        self.records: list[dict[str, Any]] = []
        self.guards: list[dict[str, Any]] = []
        # snapshot the initial bytes of named weights and state too (False: the caller has them by name;
        # a served model's would be copies of every weight and of the whole KV cache)
        self.snapshot_named = True

    def _where(self) -> str:
        return f"at {user_site()}" + (f" in module {self.scope[-1]!r}" if self.scope[-1] else "")

    def _dispatch(self, func, args) -> Any:
        return self.__torch_dispatch__(func, (), tuple(args), {})

    def guard_tolist(self, t: torch.Tensor, value: Any) -> None:
        if t.numel():
            record_guard(self._dispatch, t, value, user_site(), self.guards)

    def _storage(self, t: torch.Tensor, producing: bool) -> int:
        st = t.untyped_storage()
        key = st._cdata
        info = self.storages.get(key)
        if info is None:
            role, name = self.roles.get(key, ("temp" if producing else "weight", ""))
            if not producing and role == "temp":
                role = "weight"
            info = {"id": len(self.storages), "nbytes": st.nbytes(), "role": role, "name": name,
                    "dtype": _dtype_name(t.dtype), "shape": tuple(t.shape), "tensor": t,
                    "initial": None if producing or (name and not self.snapshot_named)
                    else storage_bytes(t).clone()}
            self.storages[key] = info
            self.keep.append(t)
        return info["id"]

    def _ref(self, t: torch.Tensor, producing: bool = False) -> dict[str, Any]:
        b = self._storage(t, producing)
        return {"t": [b, t.storage_offset() * t.element_size(), list(t.shape), list(t.stride()),
                      _dtype_name(t.dtype)]}

    def _encode(self, v: Any, accesses: list, mode_of: Callable[[], str]) -> Any:
        if isinstance(v, torch.Tensor):
            ref = self._ref(v)
            s, e = byte_span(v)
            mode = mode_of()
            if mode == "w" and e - s != v.numel() * v.element_size():
                mode = "rw"  # a view with gaps: the bytes between its elements keep older values
            accesses.append((ref["t"][0], s, e, mode))
            return ref
        if isinstance(v, (list, tuple)):
            return [self._encode(x, accesses, mode_of) for x in v]
        if isinstance(v, torch.dtype):
            return {"dt": _dtype_name(v)}
        if isinstance(v, torch.device):
            return {"dev": v.type}
        if isinstance(v, torch.layout):
            return {"layout": str(v).removeprefix("torch.")}
        if isinstance(v, torch.memory_format):
            return {"mf": str(v).removeprefix("torch.")}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise CaptureError(f"cannot record argument of type {type(v).__name__}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        qual = func._schema.name
        if qual == "aten::_local_scalar_dense":  # .item(), bool(t), int(t): keep the value, guard it
            if args[0].is_meta:
                raise CaptureError(f"host read of a tensor value {self._where()} while capturing on the meta "
                                   "device: the value does not exist there (capture on a real device)")
            value = func(*args, **kwargs)
            record_guard(self._dispatch, args[0], value, user_site(), self.guards)
            return value
        if torch.Tag.dynamic_output_shape in func.tags and not _static_indexing(qual, args):
            raise CaptureError(f"{qual} has a data-dependent output shape ({self._where()}): a static kernel "
                               "program needs shapes known at capture")
        if torch.Tag.nondeterministic_seeded in func.tags and not allowed_random(func, args, kwargs):
            raise CaptureError(f"{qual} draws random numbers ({self._where()}); capture in eval mode "
                               "(dropout 0)")
        # Snapshot storages seen for the first time before the op mutates them.
        for v in list(args) + list(kwargs.values()):
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor):
                    self._storage(t, producing=False)
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        return self._record(func, qual, args, kwargs, out)

    def record_whole(self, func, args: tuple, kwargs: dict):
        """Record ``func`` (a composite op such as
        ``aten.scaled_dot_product_attention``) as one kernel: its result is
        computed with this recorder off (on the meta device: its shape), so
        the ops it decomposes into here are not recorded; each device runs
        the op as its own dispatch does (``tessera_actors.capture.fused``)."""
        from torch.utils._python_dispatch import _disable_current_modes
        for v in list(args) + list(kwargs.values()):
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor):
                    self._storage(t, producing=False)
        with _disable_current_modes():
            out = func(*args, **kwargs)
        return self._record(func, func._schema.name, args, kwargs, out)

    def _record(self, func, qual: str, args: tuple, kwargs: dict, out):
        in_keys = {t.untyped_storage()._cdata for v in list(args) + list(kwargs.values())
                   for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)}
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        mutates = func._schema.is_mutable
        fresh = [t for t in outs if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in in_keys]
        if not mutates and not fresh and qual != "aten::_assert_async":
            return out  # an alias of an input (e.g. _unsafe_view): no kernel
        accesses: list[tuple[int, int, int, str]] = []
        schema_args = func._schema.arguments
        enc_args = []
        try:
            for i, v in enumerate(args):
                enc_args.append(self._encode(v, accesses, lambda i=i: _mode(qual, schema_args[i] if i < len(schema_args) else None)))
            by_name = {a.name: a for a in schema_args}
            enc_kwargs = {k: self._encode(v, accesses, lambda k=k: _mode(qual, by_name.get(k))) for k, v in kwargs.items()}
        except CaptureError as e:
            raise CaptureError(f"{qual}: {e} ({self._where()})") from None
        enc_outs = []
        for t in outs:
            if not isinstance(t, torch.Tensor):
                enc_outs.append(None)
                continue
            alias = t.untyped_storage()._cdata in in_keys
            ref = self._ref(t, producing=not alias)
            if not alias:
                s, e = byte_span(t)
                accesses.append((ref["t"][0], s, e, "w" if e - s == t.numel() * t.element_size() else "rw"))
            enc_outs.append({"ref": ref, "alias": alias})
        if qual == "aten::_assert_async":  # a guard: whatever reads its flag runs after it
            temps = {i["id"] for i in self.storages.values() if i["role"] == "temp"}
            accesses = [(b, st, e, "rw" if b in temps else m) for b, st, e, m in accesses]
        self.records.append({"op": str(func), "qual": qual, "args": enc_args, "kwargs": enc_kwargs,
                             "outs": enc_outs, "accesses": accesses, "scope": self.scope[-1],
                             "sig": _signature(func, args, kwargs), "flops": _flops(qual, args, outs)})
        return out


_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _static_indexing(qual: str, args) -> bool:
    """Advanced indexing with integer (not boolean) indices has a static shape."""
    if qual not in _INDEXING or len(args) < 2:
        return False
    return all(i is None or (isinstance(i, torch.Tensor) and i.dtype != torch.bool) for i in args[1])


def _mode(qual: str, arg: Any) -> str:
    if arg is None or arg.alias_info is None or not arg.alias_info.is_write:
        return "r"
    if arg.is_out or qual in _FULL_OVERWRITE:
        return "w"
    return "rw"


def _signature(func, args, kwargs) -> str:
    def sh(v):
        if isinstance(v, torch.Tensor):
            return f"{_dtype_name(v.dtype)}{list(v.shape)}"
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(sh(x) for x in v) + "]"
        return repr(v) if isinstance(v, (int, float, bool, str, type(None))) else type(v).__name__
    return f"{func}({','.join(sh(a) for a in args)};{','.join(f'{k}={sh(v)}' for k, v in sorted(kwargs.items()))})"


def _flops(qual: str, args, outs) -> float:
    tensors = [t for t in outs if isinstance(t, torch.Tensor)]
    n = float(sum(t.numel() for t in tensors))
    if qual in _MATMUL:
        mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
        if mats:
            k = mats[0].shape[-1]
            return 2.0 * n * k
    return n


def _pack_temps(records: list[dict], storages: list[dict]) -> dict[int, tuple[int, int]]:
    """Assign temporaries with disjoint lifetimes to shared slots (best fit).
    Returns storage id -> (slot buffer id, slot size)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, r in enumerate(records):
        for b, _, _, _ in r["accesses"]:
            first.setdefault(b, i)
            last[b] = i
    frees: dict[int, list[int]] = {}
    for b, i in last.items():
        frees.setdefault(i, []).append(b)
    slot_of: dict[int, int] = {}
    slot_size: list[int] = []
    free: list[int] = []
    for i in range(len(records)):
        for b in sorted(b for b, f in first.items() if f == i):
            if storages[b]["role"] != "temp":
                continue
            need = storages[b]["nbytes"]
            fits = [s for s in free if slot_size[s] >= need]
            if fits:
                s = min(fits, key=lambda s: (slot_size[s], s))
                free.remove(s)
            else:
                s = len(slot_size)
                slot_size.append(need)
            slot_of[b] = s
        for b in frees.get(i, []):
            if b in slot_of:
                free.append(slot_of[b])
    return {b: (s, slot_size[s]) for b, s in slot_of.items()}


@contextlib.contextmanager
def _module_scopes(module: torch.nn.Module | None, scope: list[str]):
    """While inside: ``scope[-1]`` is the path of the innermost module of
    ``module`` whose forward runs (hooks on every module; removed after)."""
    if module is None:
        yield
        return
    names = {m: n for n, m in module.named_modules()}

    def enter(m, args) -> None:
        scope.append(names.get(m, scope[-1]))

    def leave(m, args, out) -> None:  # must return None: a value would replace the output
        if len(scope) > 1:
            scope.pop()
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _buffers(storages: list[dict], packed: dict, base: int, remap: dict[int, int]) -> dict[int, Buffer]:
    """The graph's buffers: every storage not packed into a temp slot, then the slots."""
    buffers: dict[int, Buffer] = {}
    for s in storages:
        if s["id"] in remap:
            continue
        buffers[s["id"]] = Buffer(s["id"], s["nbytes"], s["role"], s["name"], s["dtype"], s["shape"])
    for b, (slot, size) in packed.items():
        bid = base + slot
        if bid not in buffers:
            buffers[bid] = Buffer(bid, size, "temp", f"slot{slot}", "uint8", (size,))
    return buffers


def _kernels(records: list[dict], remap: dict[int, int]) -> list[Kernel]:
    """One kernel per recorded op, its accesses and payload on the packed buffers
    (equal parts shared: ``graph.shared_value``)."""
    kernels, same = [], {}
    for i, r in enumerate(records):
        acc = tuple(shared_value(Access(remap.get(b, b), s, e, m), same) for b, s, e, m in r["accesses"])
        payload = _remap_payload({"op": r["op"], "args": r["args"], "kwargs": r["kwargs"], "outs": r["outs"]}, remap)
        payload = shared_value(payload, same)
        m = re.search(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)(?:\.|$)", r["scope"])
        kernels.append(Kernel(i, shared_value(r["qual"].removeprefix("aten::"), same), "library", acc, False,
                              r["flops"], float(sum(a.nbytes for a in acc)), shared_value(r["sig"], same),
                              int(m.group(1)) if m else -1, shared_value(r["scope"], same), payload))
    return kernels


def capture(fn: Callable[..., Any], inputs: dict[str, Any], *,
            params: dict[str, torch.Tensor] | None = None,
            state: dict[str, torch.Tensor] | None = None,
            module: torch.nn.Module | None = None,
            reuse_temps: bool = True, meta: dict[str, Any] | None = None) -> CaptureResult:
    """Run ``fn(**inputs)`` once and record it.

    ``inputs`` are what a user passes: tensor leaves (of any nesting) become
    graph inputs named by path, other leaves constants of the bucket
    (``graph.meta["constants"]``).  The result may be any pytree of tensors;
    its tensor leaves are the outputs (``graph.meta["output_names"]``).
    ``params`` become weight buffers and ``state`` state buffers (their
    initial bytes are snapshot before the run); any other tensor read before
    it is written is a constant weight.  ``module`` (optional) supplies the
    scope (module path) of each kernel.  The call mutates ``state`` exactly as
    an ordinary forward would.  Host reads become guards
    (``graph.meta["guards"]``, see ``hostreads``).
    """
    user_inputs = inputs
    inputs, constants, rebuild = flatten_inputs(user_inputs)
    roles: dict[int, tuple[str, str]] = {}
    for name, t in (params or {}).items():
        roles[t.untyped_storage()._cdata] = ("weight", name)
    for name, t in (state or {}).items():
        roles[t.untyped_storage()._cdata] = ("state", name)
    for name, t in inputs.items():
        roles[t.untyped_storage()._cdata] = ("input", name)
    scope = [""]
    rec = _Recorder(roles, scope)
    with _module_scopes(module, scope):
        for name, t in list((params or {}).items()) + list((state or {}).items()) + list(inputs.items()):
            rec._storage(t, producing=False)
        with torch.no_grad(), python_level_reads(rec.guard_tolist), rec, whole_ops(rec):
            result = fn(**rebuild(inputs))
    named = flatten_outputs(result)
    if not named:
        raise CaptureError(f"the captured call returned no tensor (got {type(result).__name__})")
    outs = [t for _, t in named]
    storages = sorted(rec.storages.values(), key=lambda s: s["id"])
    out_ids = [rec._storage(t, producing=True) for t in outs]
    for b in out_ids:
        if storages[b]["role"] == "temp":
            storages[b]["role"] = "output"
    for r in rec.records:  # anything written that was provided is state
        for b, _, _, m in r["accesses"]:
            if "w" in m and storages[b]["role"] in ("weight", "input"):
                storages[b]["role"] = "state"
    packed = _pack_temps(rec.records, storages) if reuse_temps else {}
    base = len(storages)
    remap = {b: base + slot for b, (slot, _) in packed.items()}
    buffers = _buffers(storages, packed, base, remap)
    kernels = _kernels(rec.records, remap)
    views = {"input_views": {n: _remap_payload(rec._ref(t), remap)["t"] for n, t in inputs.items()},
             "output_views": [_remap_payload(rec._ref(t), remap)["t"] for t in outs]}
    views["output_names"] = [n for n, _ in named]
    views["constants"] = {n: encode_constant(v) for n, v in constants.items()}
    views["guards"] = rec.guards
    graph = KernelGraph(kernels, buffers, {n: rec._storage(t, False) for n, t in inputs.items()},
                        [remap.get(b, b) for b in out_ids], dict(meta or {}, backend="aten", **views))
    values = {s["id"]: s["initial"] for s in storages
              if s["role"] in ("weight", "state") and s["initial"] is not None}
    return CaptureResult(graph, values, [t.detach().clone() for t in outs])


def _remap_payload(v: Any, remap: dict[int, int]) -> Any:
    if isinstance(v, dict):
        if "t" in v and len(v) == 1:
            b, off, shape, stride, dt = v["t"]
            return {"t": [remap.get(b, b), off, shape, stride, dt]}
        return {k: _remap_payload(x, remap) for k, x in v.items()}
    if isinstance(v, list):
        return [_remap_payload(x, remap) for x in v]
    return v


def module_roles(model: torch.nn.Module, state_names: list[str] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights, state) of a module: parameters and non-state buffers are
    weights; state is the named buffers (default ``model.state_names()``)."""
    if state_names is None:
        state_names = list(model.state_names()) if hasattr(model, "state_names") else []
    named_buffers = dict(model.named_buffers())
    missing = [n for n in state_names if n not in named_buffers]
    if missing:
        raise CaptureError(f"state buffers {missing} are not buffers of the model")
    state = {n: named_buffers[n] for n in state_names}
    params = dict(model.named_parameters())
    params.update({n: b for n, b in named_buffers.items() if n not in state})
    return params, state


def capture_module(model: torch.nn.Module, inputs: dict[str, torch.Tensor], *,
                   state_names: list[str] | None = None, reuse_temps: bool = True,
                   meta: dict[str, Any] | None = None) -> CaptureResult:
    """Capture ``model(**inputs)``: parameters and non-state buffers are
    weights, the named buffers (default: ``model.state_names()`` when the
    model has it) are state. The model's state is restored after capture."""
    params, state = module_roles(model, state_names)
    saved = {n: t.clone() for n, t in state.items()}
    try:
        return capture(model, inputs, params=params, state=state, module=model,
                       reuse_temps=reuse_temps, meta=meta)
    finally:
        with torch.no_grad():
            for n, t in state.items():
                t.copy_(saved[n])
