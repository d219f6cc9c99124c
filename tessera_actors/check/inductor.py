"""Checks of a CUDA capture on the GPU that recorded it (used by the GPU
scripts and tests): replay in program order and in random topological
orders with :class:`~tessera_actors.execution.triton.TritonProgram`, compare with the
compiled model, and compare greedy tokens over several decode steps.
Blocking (synchronises the device after each replay)."""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Callable, Sequence

import torch

from tessera_actors.capture.aten import CaptureResult
from tessera_actors.testing import greedy_decode


def new_program(res: CaptureResult, device: torch.device | str = "cuda"):
    from tessera_actors.execution.triton import TritonProgram
    g = res.graph
    return TritonProgram(g, torch.device(device), g.buffers)


def replay(prog, res: CaptureResult, inputs: dict[str, torch.Tensor], order: Sequence[int],
           reload: bool = True) -> list[torch.Tensor]:
    """Reset weights/state (``reload``), write ``inputs``, run ``order``; outputs (clones)."""
    from tessera_actors.execution.inputs import write_inputs
    g = res.graph
    if reload:
        prog.load(res.values)
    write_inputs(prog, g, inputs)
    prog.run(order)
    if prog.device.type == "cuda":
        torch.cuda.synchronize(prog.device)
    return [prog.view(v).clone() for v in g.meta["output_views"]]


def compare(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Bitwise equality, max abs difference and cosine similarity (all outputs together)."""
    equal = len(got) == len(want) and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want))
    try:
        a = torch.cat([t.detach().float().reshape(-1) for t in got])
        b = torch.cat([t.detach().float().reshape(-1) for t in want])
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0)) if a.numel() else 1.0
    except RuntimeError as e:  # shapes differ
        return {"equal": False, "max_abs": float("inf"), "cosine": 0.0, "error": str(e)}
    return {"equal": bool(equal), "max_abs": diff, "cosine": cos}


def soundness(res: CaptureResult, inputs: dict[str, torch.Tensor], orders: int = 20, seed: int = 0,
              deadline: float | None = None, device: str = "cuda") -> dict[str, Any]:
    """Program order, then ``orders`` random topological orders; each compared
    with the compiled model's output from the capture (``res.outputs``)."""
    from tessera_actors.testing import random_topological_order
    t0 = time.perf_counter()
    prog = new_program(res, device)
    g = res.graph
    base = compare(replay(prog, res, inputs, range(len(g.kernels))), res.outputs)
    rng = random.Random(seed)
    worst = {"max_abs": 0.0, "cosine": 1.0}
    mismatches = done = 0
    for _ in range(orders):
        if deadline is not None and time.perf_counter() > deadline:
            break
        c = compare(replay(prog, res, inputs, random_topological_order(g, rng)), res.outputs)
        done += 1
        mismatches += not c["equal"]
        worst["max_abs"] = max(worst["max_abs"], c["max_abs"])
        worst["cosine"] = min(worst["cosine"], c["cosine"])
    return {"program_order": base, "orders": done, "orders_requested": orders, "mismatches": mismatches,
            "worst_max_abs": worst["max_abs"], "worst_cosine": worst["cosine"],
            "seconds": round(time.perf_counter() - t0, 2)}


def greedy_tokens(model: torch.nn.Module, compiled: Callable[..., Any], res: CaptureResult,
                  inputs: dict[str, torch.Tensor], steps: int = 4, device: str = "cuda") -> dict[str, Any]:
    """Decode ``steps`` tokens greedily with the compiled model and with the
    captured program (state kept in the program's arena across steps), from
    the same initial state; tokens must be identical."""
    if set(inputs) != {"input_ids", "positions"}:
        return {"skipped": f"inputs {sorted(inputs)} are not a decode step"}
    saved = {n: b.clone() for n, b in model.named_buffers() if n in set(getattr(model, "state_names", list)())}
    prog = new_program(res, device)
    prog.load(res.values)
    ids, pos = inputs["input_ids"].clone(), inputs["positions"].clone()
    kernels = range(len(res.graph.kernels))
    try:
        with torch.no_grad():
            want, ref = asyncio.run(greedy_decode(lambda x: compiled(**x), ids, steps, start=pos))
            got, out = asyncio.run(greedy_decode(lambda x: replay(prog, res, x, kernels, reload=False), ids, steps,
                                                 start=pos))
        cos = [compare([o], [r])["cosine"] for o, r in zip(out, ref)]
    finally:
        bufs = dict(model.named_buffers())
        with torch.no_grad():
            for n, t in saved.items():
                bufs[n].copy_(t)
    return {"steps": steps, "identical": want == got, "min_cosine": min(cos) if cos else None,
            "first_tokens": [row[0] for row in want][:8] if steps else []}
