"""Embedding tessera-actors in an async Python server.

``GenerationService`` owns one deployment: the captured decode graph, the
scheduler, graph and (optionally) in-process device actors or node
processes, and an :class:`Engine`.  Start it inside your event loop
(``async with GenerationService(...) as svc``) and call ``generate`` from
request handlers; it streams tokens as they are produced.

Contract: requests are served one at a time in arrival order (the captured
graph has batch 1 and one KV cache); a waiting request is never dropped -
it is served when the one ahead finishes, or fails with the error that made
the engine unusable.  A lost device (a node that stops answering) is
reported to the scheduler, the graph is re-placed on the survivors and the
request continues there with the tokens already produced, so the client
sees one uninterrupted reply.  ``max_queue`` bounds the waiting line: beyond it
``generate`` raises ``ServiceBusy`` at once instead of queueing forever.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

import msgpack
import torch

from actors.device import DeviceActor
from actors.graph import GraphActor
from actors.scheduler import SchedulerActor
from actors.transfer import TransferActor
from .capture import capture_module
from .cluster import LocalCluster
from .devices import parse_devices
from .engine import Engine, StepFailed
from .errors import ActorError
from .messages import GetStats, Ping, Place, Register, ReportLost
from .plan import plan_from_dict
from .planners import get_planner
from .system import ActorSystem


class ServiceBusy(RuntimeError):
    """The waiting line is full."""


@dataclass
class ServiceConfig:
    model: str = "smollm2"
    size: str = "real"
    nodes: tuple[str, ...] = ("cpu",)       # devices per node process; empty = in-process devices
    devices: str = "cpu,cpu"                # in-process devices when nodes is empty
    planner: str = "contiguous"
    max_queue: int = 64
    step_timeout: float = 60.0
    ping_timeout: float = 2.0


class GenerationService:
    def __init__(self, cfg: ServiceConfig, log: Callable[[str], None] = lambda s: None) -> None:
        self.cfg, self.log = cfg, log
        self._lock = asyncio.Lock()
        self._waiting = 0
        self.tokenizer = None

    async def __aenter__(self) -> "GenerationService":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        from . import models
        cfg = self.cfg
        model = models.get(cfg.model, cfg.size, dtype=torch.float32)
        if cfg.model == "smollm2":
            from .models.smollm2 import load_tokenizer
            self.tokenizer = load_tokenizer()
        self.vocab = model.cfg.vocab_size
        cap = await asyncio.to_thread(capture_module, model, model.example_inputs("decode", batch=1))
        self.graph, self.max_seq = cap.graph, model.cfg.max_seq
        self.system = ActorSystem("service")
        address = await self.system.listen("tcp://127.0.0.1:0")
        await self.system.spawn(GraphActor(cap.graph), "graph")
        sched = await self.system.spawn(SchedulerActor(get_planner(cfg.planner), cap.values), "scheduler")
        self.cluster = None
        if cfg.nodes:
            self.cluster = LocalCluster(cfg.nodes, scheduler=address)
            await self.cluster.start()
            want = len(cfg.nodes)
            deadline = time.monotonic() + 30
            while len((await sched.ask(GetStats())).values["nodes"]) < want:
                if time.monotonic() > deadline:
                    raise TimeoutError("node processes did not register within 30 s")
                await asyncio.sleep(0.05)
        else:
            specs = parse_devices(cfg.devices)
            await self.system.spawn(TransferActor(), "transfer")
            for i, spec in enumerate(specs):
                await self.system.spawn(DeviceActor(spec), f"device{i}")
            await sched.ask(Register("local", address, [s.name for s in specs]))
        self.generation = 0
        await self._place("service")

    async def _place(self, plan_id: str) -> None:
        sched = self.system.ref("scheduler")
        dep = await sched.ask(Place(plan_id, "latency"), timeout=300)
        self.plan = plan_from_dict(msgpack.unpackb(dep.plan, strict_map_key=False))
        self.routes = dep.routes
        address = self.system.address
        refs = [await self.system.remote_ref(ep, name) if ep != address else self.system.ref(name)
                for _, ep, name in dep.routes]
        self.engine = Engine(self.graph, self.plan, plan_id, refs, self.cfg.step_timeout)
        self.log(self.plan.describe(self.graph))

    async def stop(self) -> None:
        if getattr(self, "cluster", None) is not None:
            await self.cluster.stop()
        if getattr(self, "system", None) is not None:
            await self.system.shutdown()

    def encode_chat(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return [b % self.vocab for b in text.encode()] or [0]
        from .models.smollm2 import chat_prompt
        return self.tokenizer.encode(chat_prompt(text))

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(list(ids), skip_special=True)

    def eos(self) -> int | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.ids.get("<|im_end|>")

    async def generate(self, prompt_ids: Sequence[int], max_new: int = 64) -> AsyncIterator[int]:
        """Greedy tokens, one at a time, as the engine produces them."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) + max_new > self.max_seq:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + {max_new} new exceeds the context of {self.max_seq}")
        if self._waiting >= self.cfg.max_queue:
            raise ServiceBusy(f"{self._waiting} requests already waiting")
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        try:
            produced: list[int] = []
            attempts = 0
            while True:
                try:
                    async for tok in self._decode(list(prompt_ids) + produced, max_new - len(produced)):
                        produced.append(tok)
                        yield tok
                    return
                except StepFailed as e:
                    attempts += 1
                    if attempts > len(self.plan.devices):
                        raise
                    await self._recover(e)   # then continue the same request on the survivors
        finally:
            self._lock.release()

    async def _decode(self, context: list[int], max_new: int) -> AsyncIterator[int]:
        eos = self.eos()
        logits = None
        for pos, tok in enumerate(context):
            logits = (await self.engine.step({"input_ids": torch.tensor([[tok]]),
                                              "positions": torch.tensor([pos])}))[0]
        pos = len(context)
        for _ in range(max_new):
            tok = int(torch.argmax(logits.reshape(-1, logits.shape[-1])[-1]))
            if tok == eos:
                return
            yield tok
            if pos >= self.max_seq:
                return
            logits = (await self.engine.step({"input_ids": torch.tensor([[tok]]),
                                              "positions": torch.tensor([pos])}))[0]
            pos += 1

    async def _recover(self, failure: Exception) -> None:
        """Find the nodes that stopped answering, report them, re-place the
        graph on the survivors; re-raise ``failure`` when every node answers
        (the fault is not a lost device)."""
        lost = []
        for ep in sorted({ep for _, ep, _ in self.routes}):
            try:
                ref = self.system.ref("device0") if ep == self.system.address else await self.system.remote_ref(ep, "node")
                await ref.ask(Ping(), timeout=self.cfg.ping_timeout)
            except ActorError:
                lost.append(ep)
        if not lost:
            raise failure
        sched = self.system.ref("scheduler")
        for ep in lost:
            await sched.ask(ReportLost(ep, str(failure)))
        self.generation += 1
        self.log(f"lost {lost}; re-placing on the survivors")
        await self._place(f"service-{self.generation}")
