"""Run a plan inside one process, device programs interleaved by a policy.

The reference executor: single-device runs, CI soundness checks (random
interleavings of the per-device programs must not change a single bit) and
the logic the device actors follow, without any actor machinery.  Blocking:
runs torch work on the calling thread.
"""
from __future__ import annotations

import random
from typing import Callable, Sequence

import torch

from actors.backends.aten import AtenProgram
from tessera_actors.capture.aten import dtype_from_name
from tessera_actors.capture.pytree import bind_step_inputs
from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan, PlanError


def write_inputs(prog: AtenProgram, graph: KernelGraph, inputs: dict[str, torch.Tensor],
                 only: Sequence[int] | None = None) -> None:
    """Copy step inputs into their buffers (those in ``only`` when given).
    ``inputs`` may be nested and carry the bucket's constants, as at capture."""
    inputs = bind_step_inputs(graph.meta, inputs)
    views = graph.meta["input_views"]
    missing = set(graph.inputs) - set(inputs)
    if missing:
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
        if dst.is_cuda and not t.is_cuda:
            # a blocking copy from pageable memory synchronizes the stream - the host would wait for the
            # previous step's kernels before queueing this one's; from pinned memory it is queued
            # (torch's pinned-memory cache keeps the block until the copy is done)
            dst.copy_(t.pin_memory(), non_blocking=True)
        else:
            dst.copy_(t)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (host) on ``device``; to a GPU through pinned memory, queued on
    the current stream (a pageable copy would make the host wait for the
    kernels queued before it)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def write_fed_inputs(prog: AtenProgram, graph: KernelGraph, inputs: dict[str, torch.Tensor],
                     only: Sequence[int] | None, token_rows: Sequence[Sequence[int]], sampled: torch.Tensor) -> None:
    """:func:`write_inputs`, then ``input_ids[row] = sampled[entry]`` for each
    ``[row, entry]`` of ``token_rows``, on the device (queued behind the step
    that sampled them, no host read)."""
    if only:
        write_inputs(prog, graph, inputs, only)
    view = graph.meta["input_views"].get("input_ids")
    if view is None:
        raise PlanError("token_rows given, but the graph has no input_ids input")
    dst = prog.view(view)
    if sampled.device != dst.device:
        raise PlanError(f"tokens sampled on {sampled.device} cannot feed inputs on {dst.device}")
    pairs = to_device(torch.tensor(token_rows, dtype=torch.int64).view(-1, 2), dst.device)
    dst[(pairs[:, 0],) + (0,) * (dst.dim() - 1)] = sampled[pairs[:, 1]].to(dst.dtype)


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


class PlanRunner:
    """One :class:`AtenProgram` per plan device, all in this process.

    ``policy`` picks which runnable device advances next: ``"order"`` (the
    lowest-numbered runnable device) or a ``random.Random`` for random
    interleavings."""

    def __init__(self, graph: KernelGraph, plan: Plan, values: dict[int, torch.Tensor],
                 device_of: Callable[[int], torch.device] = lambda d: torch.device("cpu")) -> None:
        self.graph, self.plan = graph, plan
        self.progs = []
        for d in range(len(plan.devices)):
            p = AtenProgram(graph, device_of(d), plan.resident[d])
            p.load(values)
            self.progs.append(p)
        self.bytes_moved = 0

    def step(self, inputs: dict[str, torch.Tensor], policy: "str | random.Random" = "order") -> list[torch.Tensor]:
        plan = self.plan
        for d, prog in enumerate(self.progs):
            write_inputs(prog, self.graph, inputs, only=plan.inputs[d])
        sent: dict[int, torch.Tensor] = {}
        pcs = [0] * len(self.progs)
        tr = {t.tag: t for t in plan.transfers}
        while True:
            ready = []
            for d, prog in enumerate(plan.programs):
                if pcs[d] < len(prog):
                    st = prog[pcs[d]]
                    if st.op != "recv" or st.ref in sent:
                        ready.append(d)
            if not ready:
                if any(pcs[d] < len(p) for d, p in enumerate(plan.programs)):
                    raise PlanError(f"plan {plan.name!r} deadlocked at program counters {pcs}")
                break
            d = ready[0] if policy == "order" else policy.choice(ready)
            st = plan.programs[d][pcs[d]]
            pcs[d] += 1
            if st.op == "run":
                self.progs[d].run(plan.segments[st.ref].kernels)
            elif st.op == "send":
                t = tr[st.ref]
                sent[t.tag] = self.progs[d].read(t.buffer, t.ranges)
                self.bytes_moved += t.nbytes
            else:
                t = tr[st.ref]
                self.progs[d].write(t.buffer, t.ranges, sent[t.tag])
        pieces = {(b, s, e): self.progs[d].read(b, [(s, e)]) for b, s, e, d in plan.outputs}
        return assemble_outputs(self.graph, pieces)
