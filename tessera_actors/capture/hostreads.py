"""Host reads during capture: where they happen, and the guards that keep a
captured program honest about them.

A model may read tensor values on the host (``.item()``, ``bool(t)``,
``int(t)``, ``.tolist()``) and take a Python branch on them - transformers'
mask code does, to skip the mask when it is all ones.  A static kernel
program cannot re-take that branch at replay.  So the capture keeps the
branch it saw and records a **guard** for each host read: kernels that
compare the read tensor with the value the host got at capture
(``eq`` -> ``all`` -> ``_assert_async``).  At replay the guard runs like any
other kernel; inputs for which the read would give another value fail the
step with a :class:`RuntimeError` that names the read's source line and
the captured value - never a silently wrong program.  On CUDA
``_assert_async`` is a device-side assert (no host sync on the hot path).

Guards are exact: float reads compare bitwise-equal values (a NaN read
always fails its guard).  ``graph.meta["guards"]`` lists every guard
(``site``, ``value``).  ``.numpy()`` on a captured tensor is refused.
"""
from __future__ import annotations

import os
import threading
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

_SKIP = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)
_GUARD_MSG = ("tessera guard failed: the host read at {site} returned {value!r} when this bucket was captured, "
              "and these inputs give another value (the model takes another Python branch for them); "
              "capture a bucket with such inputs")


def user_site() -> str:
    """``file:line (function)`` of the innermost frame outside torch and this
    capture package: the line of model code that made the current call."""
    for fr in reversed(traceback.extract_stack()):
        path = os.path.abspath(fr.filename)
        if path.startswith(_SKIP) or fr.filename.startswith("<"):
            continue
        return f"{fr.filename}:{fr.lineno} ({fr.name})"
    return "<unknown>"


def _plain(v: Any) -> Any:
    """A msgpack-able form of a host-read value (for graph.meta)."""
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, complex):
        return [v.real, v.imag]
    return v


def record_guard(dispatch: Callable, t: torch.Tensor, value: Any, site: str, guards: list) -> None:
    """Record the kernels that check ``t`` still holds ``value`` (a Python
    scalar or nested list, as ``.item()``/``.tolist()`` returned it).
    ``dispatch(op, args)`` records and runs one op (the recorder's)."""
    aten = torch.ops.aten
    msg = _GUARD_MSG.format(site=site, value=value)
    if t.numel() == 1 and not isinstance(value, list):
        flag = dispatch(aten.eq.Scalar, (t, value))
    else:
        want = torch.tensor(value, dtype=t.dtype, device=t.device)  # read as a constant of the program
        flag = dispatch(aten.eq.Tensor, (t, want))
    if flag.dim() > 0:
        flag = dispatch(aten.all.default, (flag,))
    dispatch(aten._assert_async.msg, (flag, msg))
    guards.append({"site": site, "value": _plain(value), "shape": list(t.shape)})


@contextmanager
def python_level_reads(on_tolist: Callable[[torch.Tensor, Any], None]) -> Iterator[None]:
    """During capture: ``Tensor.tolist`` (which reads memory without an aten
    op) reports to ``on_tolist(tensor, result)``; ``Tensor.numpy`` is refused.
    Only calls from the capturing thread count (like the dispatch mode, which
    is thread-local): other threads' calls behave as always."""
    from tessera_actors.capture.errors import CaptureError
    orig_tolist, orig_numpy = torch.Tensor.tolist, torch.Tensor.numpy
    me = threading.get_ident()

    def tolist(self: torch.Tensor):
        out = orig_tolist(self)
        if threading.get_ident() == me:
            on_tolist(self, out)
        return out

    def numpy(self: torch.Tensor, *a, **k):
        if threading.get_ident() != me:
            return orig_numpy(self, *a, **k)
        raise CaptureError(f"host read Tensor.numpy() at {user_site()}: a captured program cannot hand "
                           "tensor memory to numpy (use tensor ops, or .tolist()/.item(), which are guarded)")
    torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy
    try:
        yield
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = orig_tolist, orig_numpy


def allowed_random(func, args, kwargs) -> bool:
    """A random op whose randomness is switched off: dropout probability 0
    (the SDPA variants, ``native_dropout``) or ``train=False``."""
    schema = func._schema.arguments
    vals = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
            for i, a in enumerate(schema)}
    for name in ("dropout_p", "p"):
        if name in vals:
            p = vals[name]
            if isinstance(p, (int, float)) and p == 0:
                return True
            return False
    return vals.get("train") is False


def host_read_sites(model: Callable[..., Any], inputs: dict[str, Any]) -> list[str]:
    """Source lines of the host reads one eager ``model(**inputs)`` makes
    (the caller restores any state the call changed)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    sites: list[str] = []

    class _Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name == "aten::_local_scalar_dense":
                sites.append(user_site())
            return func(*args, **(kwargs or {}))
    with python_level_reads(lambda t, v: sites.append(user_site())), _Probe():
        model(**inputs)
    return sites
