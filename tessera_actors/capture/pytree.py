"""Inputs and outputs of a captured call as named flat tensors.

A user calls ``model(**inputs)`` with tensors, nested lists/tuples/dicts of
tensors and plain keywords (``use_cache=False``); the model returns a
tensor, a tuple, a dict, a transformers ``ModelOutput`` or an object holding
tensors (a KV ``Cache``).  A kernel program has named tensor inputs and an
ordered list of output tensors, so:

- **inputs**: every tensor leaf becomes a graph input named by its path
  (``pixel_values``, ``images.0``); every other leaf (``None``, bool, int,
  float, str, dtype, device) is a **constant of the bucket**, recorded in
  ``graph.meta["constants"]``.  At replay (:func:`bind_step_inputs`) a
  constant may be left out or passed again with the same value; another
  value is refused - it would need another capture.
- **outputs**: every tensor leaf, in traversal order, named by its path
  (``logits``, ``cache.layers.0.keys``), listed in
  ``graph.meta["output_names"]``.  Objects that are neither containers nor
  registered pytree nodes are walked through their public attributes.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

_CONSTANT = (type(None), bool, int, float, str, torch.dtype, torch.device)
_MAX_DEPTH = 12


class InputError(ValueError):
    """Step inputs that do not fit the captured bucket."""


def _key(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_name(path: tuple) -> str:
    return ".".join(_key(e) for e in path)


def encode_constant(v: Any) -> Any:
    """A msgpack-able record of a constant (dtype/device as strings)."""
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    return v


def flatten_inputs(inputs: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any],
                                                   Callable[[dict[str, torch.Tensor]], dict[str, Any]]]:
    """(tensor inputs by name, constants by name, rebuild): ``rebuild(tensors)``
    gives the keyword dict to call the model with, constants in place."""
    leaves, spec = pytree.tree_flatten_with_path(dict(inputs))
    tensors: dict[str, torch.Tensor] = {}
    constants: dict[str, Any] = {}
    order: list[tuple[str, bool]] = []
    for path, leaf in leaves:
        name = path_name(path)
        if isinstance(leaf, torch.Tensor):
            tensors[name] = leaf
            order.append((name, True))
        elif isinstance(leaf, _CONSTANT):
            constants[name] = leaf
            order.append((name, False))
        else:
            from tessera_actors.capture.errors import CaptureError
            raise CaptureError(f"input {name!r} is a {type(leaf).__name__}: pass tensors, lists/tuples/dicts "
                               "of tensors, or plain constants (None, bool, int, float, str, dtype, device)")

    def rebuild(values: dict[str, torch.Tensor]) -> dict[str, Any]:
        return pytree.tree_unflatten([values[n] if is_t else constants[n] for n, is_t in order], spec)
    return tensors, constants, rebuild


def _walk(obj: Any, path: str, out: list[tuple[str, torch.Tensor]], depth: int, seen: set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((path or "output", obj))
        return
    if obj is None or isinstance(obj, _CONSTANT) or depth > _MAX_DEPTH or id(obj) in seen:
        return
    seen.add(id(obj))
    sub = (lambda k: f"{path}.{k}" if path else str(k))
    if isinstance(obj, dict):  # ModelOutput is an OrderedDict
        for k, v in obj.items():
            _walk(v, sub(k), out, depth + 1, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, sub(i), out, depth + 1, seen)
    elif type(obj) in pytree.SUPPORTED_NODES:
        for p, v in pytree.tree_flatten_with_path(obj)[0]:
            _walk(v, sub(path_name(p)), out, depth + 1, seen)
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            if not k.startswith("_"):
                _walk(v, sub(k), out, depth + 1, seen)


def flatten_outputs(result: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor leaf of ``result`` with its path name, in traversal order."""
    out: list[tuple[str, torch.Tensor]] = []
    _walk(result, "", out, 0, set())
    return out


def bind_step_inputs(meta: dict[str, Any], inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensor inputs of one replay step from what a user passes to the
    model (same structure as at capture, constants optional)."""
    constants = meta.get("constants") or {}
    if not constants and all(isinstance(v, torch.Tensor) for v in inputs.values()):
        return inputs  # the common, flat case: no work on the hot path
    tensors: dict[str, torch.Tensor] = {}
    for path, leaf in pytree.tree_flatten_with_path(dict(inputs))[0]:
        name = path_name(path)
        if isinstance(leaf, torch.Tensor):
            tensors[name] = leaf
        elif name in constants:
            if encode_constant(leaf) != constants[name]:
                raise InputError(f"input {name}={leaf!r}, but this bucket was captured with "
                                 f"{name}={constants[name]!r} (a constant of the bucket: capture another one)")
        elif leaf is not None:
            raise InputError(f"unknown step input {name!r}")
    return tensors
