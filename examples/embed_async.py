"""Embedding tessera-actors in your own asyncio program: no HTTP server, an
``AsyncEngine`` in this process (two CPU devices as actors, a split plan),
replies streamed from a coroutine.

    python examples/embed_async.py "Write a haiku about GPUs"
    python examples/embed_async.py --nodes 'cpu;cpu?threads=1' "Ça va ?"   # two node processes

The start reports its progress on stderr (the model loaded, then buckets
placed; the engine serves once its largest ones are, the rest follow in the
background).  Each ``out.text`` holds whole characters only (the engine
detokenizes incrementally), so printing the pieces as they come never shows
half of a multi-byte character.  Two requests then run at once to show
continuous batching: their pieces interleave as the shared decode steps
produce them, each printed on its own line tagged with its request id.
"""
from __future__ import annotations

import argparse
import asyncio
import sys

from tessera_actors import AsyncEngine, SamplingParams


def show_progress(phase: str, done: int, total: int) -> None:
    """The engine's start, on one stderr line."""
    what = "loading the model" if phase == "loading" else f"placing buckets {done}/{total}"
    print(f"\r[engine] {what}   ", end="" if done < total or phase == "loading" else "\n",
          file=sys.stderr, flush=True)


async def ask(eng: AsyncEngine, rid: str, question: str, max_tokens: int) -> str:
    """Stream one reply, printing every piece as it arrives, tagged ``[rid]``."""
    chat = [{"role": "user", "content": question}]
    reply = []
    async for out in eng.generate(chat, SamplingParams(max_tokens=max_tokens), request_id=rid):
        reply.append(out.text)
        if out.text:
            print(f"[{rid}] {out.text!r}", flush=True)
        if out.finish_reason:
            print(f"[{rid}] done: {out.finish_reason}, {out.usage.prompt_tokens} prompt + "
                  f"{out.usage.completion_tokens} generated tokens", flush=True)
    return "".join(reply)


async def main(a: argparse.Namespace) -> None:
    where = {"nodes": [n for n in a.nodes.split(";") if n]} if a.nodes else {"devices": a.devices}
    eng = AsyncEngine(model="smollm2", **where)
    await eng.start(show_progress)
    try:
        # one request streamed character by character as it is generated
        async for out in eng.generate([{"role": "user", "content": a.question}],
                                      SamplingParams(max_tokens=a.max_tokens), request_id="r1"):
            print(out.text, end="", flush=True)
        print()
        # two at once: the engine batches them into the same decode steps, so their pieces interleave
        first, second = await asyncio.gather(ask(eng, "r2", "What is the capital of France?", a.max_tokens),
                                             ask(eng, "r3", "Comment ça va ?", a.max_tokens))
        print(f"r2: {first}\nr3: {second}")
    finally:
        await eng.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("question", nargs="?", default="What is the capital of France?")
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--nodes", default=None, help="node processes instead, ';' between nodes")
    ap.add_argument("--max-tokens", type=int, default=48)
    asyncio.run(main(ap.parse_args()))
