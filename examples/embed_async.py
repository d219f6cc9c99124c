"""Embedding tessera-actors in your own asyncio program: no HTTP, no node
processes - two CPU devices as actors inside this process, a split plan, and
token streaming from a coroutine.

    python examples/embed_async.py "Write a haiku about GPUs"
"""
from __future__ import annotations

import asyncio
import sys

from tessera_actors.service import GenerationService, ServiceConfig


async def main(prompt: str) -> None:
    cfg = ServiceConfig(model="smollm2", nodes=(), devices="cpu,cpu")
    async with GenerationService(cfg, log=print) as svc:
        ids = []
        async for tok in svc.generate(svc.encode_chat(prompt), max_new=48):
            ids.append(tok)
            print(svc.decode([tok]), end="", flush=True)
        print()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "What is the capital of France?"))
