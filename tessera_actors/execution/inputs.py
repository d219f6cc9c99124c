"""A step's inputs into a program's arena (a prompt chunk's built from its
rows' ints first), and its outputs back out.

Shared by the device actors' step (:mod:`tessera_actors.execution.step`),
the reference runner and the profiler.  Blocking: runs torch work on the
calling thread.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tessera_actors.execution.hostbuf import Uploads
from tessera_actors.execution.program import AtenProgram
from tessera_actors.graph import dtype_from_name
from tessera_actors.capture.pytree import bind_step_inputs
from tessera_actors.graph import KernelGraph
from tessera_actors.plan import PlanError
from tessera_actors.runtime.messages import ChunkRows


def write_inputs(prog: AtenProgram, graph: KernelGraph, inputs: dict[str, torch.Tensor],
                 only: Sequence[int] | None = None, uploads: Uploads | None = None, partial: bool = False) -> None:
    """Copy step inputs into their buffers (those in ``only`` when given).
    ``inputs`` may be nested and carry the bucket's constants, as at capture;
    ``partial``: some inputs come another way (a decode step's rows).
    ``uploads``: the plan's pinned staging (:mod:`.hostbuf`), else each
    input is pinned for its copy."""
    inputs = bind_step_inputs(graph.meta, inputs)
    views = graph.meta["input_views"]
    missing = set(graph.inputs) - set(inputs)
    if missing and not partial:
        raise PlanError(f"missing step inputs {sorted(missing)}; the graph takes {sorted(graph.inputs)}")
    for name, t in inputs.items():
        if name not in views:
            raise PlanError(f"unknown step input {name!r}; the graph takes {sorted(graph.inputs)}")
        ref = views[name]
        if only is not None and ref[0] not in only:
            continue
        if list(t.shape) != list(ref[2]) or str(t.dtype).removeprefix("torch.") != ref[4]:
            raise PlanError(f"input {name!r}: got {str(t.dtype)}{list(t.shape)}, the graph was captured "
                            f"for {ref[4]}{ref[2]}")
        dst = prog.view(ref)
        if uploads is not None:
            uploads.copy_into(dst, t)
        elif dst.is_cuda and not t.is_cuda:
            # a blocking copy from pageable memory synchronizes the stream - the host would wait for the
            # previous step's kernels before queueing this one's; from pinned memory it is queued
            # (torch's pinned-memory cache keeps the block until the copy is done)
            dst.copy_(t.pin_memory(), non_blocking=True)
        else:
            dst.copy_(t)


def chunk_inputs(chunk: ChunkRows) -> dict[str, torch.Tensor]:
    """The step inputs of a prompt-chunk step's rows (host tensors)."""
    ids = torch.zeros(chunk.rows, chunk.size, dtype=torch.int64)
    pos = torch.full((chunk.rows, chunk.size), chunk.pad, dtype=torch.int64)
    slot = torch.full((chunk.rows,), chunk.slots[0], dtype=torch.int64)
    last = torch.zeros(chunk.rows, dtype=torch.int64)
    for i, (row, start, tokens) in enumerate(zip(chunk.slots, chunk.starts, chunk.tokens)):
        ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        pos[i] = torch.clamp(torch.arange(start, start + chunk.size, dtype=torch.int64), max=chunk.pad)
        slot[i], last[i] = row, len(tokens) - 1
    return {"input_ids": ids, "positions": pos, "rows": slot, "last": last}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (host) on ``device``; to a GPU through pinned memory, queued on
    the current stream (a pageable copy would make the host wait for the
    kernels queued before it)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def assemble_outputs(graph: KernelGraph, pieces: dict[tuple[int, int, int], torch.Tensor]) -> list[torch.Tensor]:
    """Rebuild the step's output tensors (CPU) from final byte ranges."""
    bufs: dict[int, torch.Tensor] = {}
    for (b, s, e), data in pieces.items():
        buf = bufs.setdefault(b, torch.zeros(graph.buffers[b].nbytes, dtype=torch.uint8))
        buf[s:e].copy_(data.reshape(-1).view(torch.uint8).cpu())
    out = []
    for b, off, shape, stride, dt in graph.meta["output_views"]:
        dtype = dtype_from_name(dt)
        item = torch.empty((), dtype=dtype).element_size()
        base = bufs.get(b, torch.zeros(graph.buffers[b].nbytes, dtype=torch.uint8))
        out.append(torch.empty(0, dtype=dtype).set_(base.untyped_storage(), off // item, tuple(shape),
                                                   tuple(stride)).clone())
    return out
