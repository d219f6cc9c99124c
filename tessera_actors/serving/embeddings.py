"""Embeddings (``/v1/embeddings``): the mean over a text's tokens of the
model's final hidden state (after the last norm, before the LM head).

The text runs through the engine's ``embed:C`` bucket (``deploy``), a
chunk of ``C`` tokens at a time, like a prompt's prefill: each chunk gives
the sum of its real tokens' hidden states, and the sum over the chunks
divided by the token count is the embedding.  It writes the KV cache of
the row it runs in, so it holds a KV slot (waiting for a free one, as a
generation request does) while its steps run; its steps go to the devices
beside the engine loop's (another plan of the same deployment).
"""
from __future__ import annotations

import torch

from tessera_actors.runtime.messages import ChunkRows
from tessera_actors.serving.params import EngineDead, InvalidRequest


def embed_bucket(served) -> str | None:
    return next((name for name, b in served.buckets.items() if b.kind == "embed"), None)


async def embed(engine, prompt) -> tuple[list[float], int]:
    """(the embedding of ``prompt`` - a string, chat messages or token ids -,
    its token count).  ``InvalidRequest`` for an empty or too long input or a
    model that cannot pool; ``EngineDead`` when the engine is not running."""
    if engine._dead or engine._loop_task is None or engine._loop_task.done():
        raise EngineDead(engine._dead or "the engine is not running")
    name = embed_bucket(engine.served)
    if name is None:
        raise InvalidRequest(f"model {engine.model_name!r} cannot give embeddings", "model")
    ids = [int(t) for t in prompt] if _ids(prompt) else engine.encode_prompt(prompt)
    vocab = engine.served.vocab_size
    if vocab and any(not 0 <= t < vocab for t in ids):
        raise InvalidRequest(f"token ids must be in [0, {vocab})", "input")
    if len(ids) > engine.max_model_len:
        raise InvalidRequest(f"the input has {len(ids)} tokens; this model's context is {engine.max_model_len}",
                             "input")
    slot = await _take_slot(engine)
    try:
        chunk = engine.served.buckets[name].size
        total = None
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            rows = ChunkRows(chunk, 1, [slot], [start], [part], engine.max_model_len - 1)
            res = await engine.deployment.step(name, {}, [], outputs=True, chunk=rows)
            vec = _pooled(res, engine.served.graph(name))
            total = vec if total is None else total + vec
    finally:
        engine.slots.release(slot)
        engine._slot_freed.set()
        engine._wake.set()
    return (total / len(ids)).tolist(), len(ids)


async def _take_slot(engine) -> int:
    """A free KV row, waiting while every row is held."""
    while True:
        if engine.slots.free():
            slot = engine.slots.take()
            if slot is not None:
                return slot
        engine._slot_freed.clear()
        await engine._slot_freed.wait()


def _pooled(res, graph) -> torch.Tensor:
    """The chunk's summed hidden state [D] (float64) from the step's output
    bytes (the graph's first output, [1, 1, D], contiguous)."""
    buf, offset, shape, _, dtype = graph.meta["output_views"][0]
    dt = getattr(torch, dtype)
    item = torch.empty((), dtype=dt).element_size()
    n = 1
    for d in shape:
        n *= int(d)
    for b, start, _end, data in res.outputs:
        if b == buf:
            raw = torch.as_tensor(data).reshape(-1)
            first = int(offset) * item - int(start)
            return raw[first:first + n * item].view(dt).to(torch.float64)
    raise EngineDead("the embedding step returned no output")


def _ids(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)

