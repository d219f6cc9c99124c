"""The serving engine embedded in a plain asyncio program.

    python examples/embed_async.py "What is the capital of France?"

Streams the reply of SmolLM2-135M-Instruct (real weights, split over two
CPU devices) as whole characters, then prints the placement and usage.
"""
import asyncio
import sys

from tessera_actors import AsyncEngine, SamplingParams


async def main(question: str) -> None:
    async with AsyncEngine(model="smollm2", devices="cpu,cpu", max_seqs=4, max_model_len=1024) as eng:
        chat = [{"role": "user", "content": question}]
        last = None
        async for out in eng.generate(chat, SamplingParams(max_tokens=96, temperature=0.0)):
            print(out.text, end="", flush=True)
            last = out
        print(f"\n[{last.finish_reason}; {last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} "
              f"generated tokens; placement {eng.stats()['placement']}]")


if __name__ == "__main__":
    asyncio.run(main(" ".join(sys.argv[1:]) or "Say something in French, please."))
