"""What an in-process device actor really keeps alive, found by walking the
objects it references (test harness): the tensors reachable from the actor,
each storage once, so a test can compare them with what the device says it
holds (``GetStats``: ``allocated_bytes``, ``home_bytes``).

The walk does not go into other actors, the actor system, the co-located
hand-off hub, modules, classes, threads, executors or event loops, nor into
step messages (their input tensors are the engine's, in host memory on a
GPU); graphs and plans are skipped as they hold no tensors."""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import types

import torch

from tessera_actors.execution.handoff import Handoff
from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan
from tessera_actors.runtime.actor import Actor, ActorRef
from tessera_actors.runtime.messages import RunStep
from tessera_actors.runtime.system import LocalSystem

_STOP = (types.ModuleType, type, threading.Thread, concurrent.futures.Executor, asyncio.AbstractEventLoop,
         Actor, ActorRef, LocalSystem, Handoff, KernelGraph, Plan, RunStep)


def reachable_storages(actor: Actor) -> dict[int, int]:
    """Storage address -> bytes of every tensor reachable from ``actor``."""
    seen: set[int] = set()
    found: dict[int, int] = {}
    todo: list = list(vars(actor).values())
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.device.type != "meta":
                s = o.untyped_storage()
                found[s.data_ptr()] = s.nbytes()
            continue
        if isinstance(o, _STOP) or (isinstance(o, dict) and "__builtins__" in o):
            continue
        if isinstance(o, types.FunctionType):   # its closure and defaults, not its module's globals
            for cell in o.__closure__ or ():
                try:
                    todo.append(cell.cell_contents)
                except ValueError:   # an empty cell
                    pass
            todo.extend(o.__defaults__ or ())
            continue
        todo.extend(gc.get_referents(o))
    return found


def reachable_bytes(actor: Actor) -> int:
    return sum(reachable_storages(actor).values())
