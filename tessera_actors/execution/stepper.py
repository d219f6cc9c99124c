"""The serving engine: turns requests into steps of a deployed plan.

``Engine.step`` sends one ``RunStep`` to every plan device at once (each
device runs its program and exchanges cut-edge bytes with its peers directly,
not through the engine) and assembles the outputs from the devices that hold
their final bytes.  A device that does not answer within ``step_timeout``
fails the step with a clear error; nothing waits forever.

``greedy_decode`` is the token loop for language-model graphs captured from
a decode step (inputs ``input_ids`` [1, 1] and ``positions`` [1]).
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence

import torch

from tessera_actors.runtime.actor import ActorRef
from tessera_actors.graph import KernelGraph
from tessera_actors.runtime.messages import RunStep, StepDone
from tessera_actors.plan import Plan
from tessera_actors.execution.inputs import assemble_outputs


class StepFailed(RuntimeError):
    """A step could not be completed; the message names the device and why."""


class Engine:
    def __init__(self, graph: KernelGraph, plan: Plan, plan_id: str, devices: Sequence[ActorRef],
                 step_timeout: float = 60.0) -> None:
        if len(devices) != len(plan.devices):
            raise ValueError(f"{len(devices)} device refs for a plan of {len(plan.devices)} devices")
        self.graph, self.plan, self.plan_id = graph, plan, plan_id
        self.devices = list(devices)
        self.step_timeout = step_timeout
        self.steps = 0
        self.last: list[StepDone] = []

    async def step(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        step = self.steps
        self.steps += 1
        asks = []
        for d, ref in enumerate(self.devices):
            feed = inputs if self.plan.inputs[d] else {}
            asks.append(ref.ask(RunStep(self.plan_id, step, feed), timeout=self.step_timeout))
        results = await asyncio.gather(*asks, return_exceptions=True)
        for d, r in enumerate(results):
            if isinstance(r, BaseException):
                raise StepFailed(f"step {step}: device {d} ({self.plan.devices[d]}) failed: "
                                 f"{type(r).__name__}: {r}") from r
        self.last = list(results)
        pieces = {}
        for done in results:
            for (b, s, e), data in zip(done.ranges, done.data):
                pieces[(b, s, e)] = data
        return assemble_outputs(self.graph, pieces)


async def greedy_decode(step: Callable[[dict[str, torch.Tensor]], Awaitable[list[torch.Tensor]]],
                        prompt: Sequence[int], max_new: int, eos: int | None = None,
                        on_token: Callable[[int], None] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Feed ``prompt`` token by token, then generate greedily. Returns the new
    tokens and the logits of every generated position."""
    if not prompt:
        raise ValueError("empty prompt")
    logits = None
    for pos, tok in enumerate(prompt):
        out = await step({"input_ids": torch.tensor([[tok]]), "positions": torch.tensor([pos])})
        logits = out[0]
    new: list[int] = []
    seen: list[torch.Tensor] = []
    pos = len(prompt)
    for _ in range(max_new):
        last = logits.reshape(-1, logits.shape[-1])[-1]
        seen.append(last.clone())
        tok = int(torch.argmax(last))
        new.append(tok)
        if on_token:
            on_token(tok)
        if eos is not None and tok == eos:
            break
        out = await step({"input_ids": torch.tensor([[tok]]), "positions": torch.tensor([pos])})
        logits = out[0]
        pos += 1
    return new, seen
