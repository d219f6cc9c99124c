"""What the HTTP layer of ``tessera serve`` costs per streamed token.

The real server (``make_app``: parsing, validation, SSE chunks, metrics) in
front of a *null engine* that follows the AsyncEngine contract but computes
nothing (every token is ready at once), driven by the load generator's own
HTTP client in this process.  So the numbers are a ceiling of the HTTP layer
plus client on one core, not a model's speed: if the ceiling is far above
what the engine serves, HTTP is not the bottleneck.  Runs each concurrency,
prints a table, writes JSON with provenance.

    python benchmarks/bench_http_layer.py [--tokens 256] [--concurrency 1,4,16]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp

from tessera_actors.serving import RequestOutput, Usage
from tessera_actors.serving.loadgen import HttpClient
from tessera_actors.provenance import provenance
from tessera_actors.serving.loadgen_report import Record
from tessera_actors.serving.server import make_app, start_site


class NullEngine:
    """The AsyncEngine contract with no model: ``max_tokens`` one-character tokens, each ready at once."""
    model_name = "null"
    max_model_len = 1 << 20

    def encode_prompt(self, prompt) -> list[int]:
        """One token id per word (the server tokenizes once and hands the engine these ids)."""
        words = prompt.split() if isinstance(prompt, str) else [w for m in prompt for w in m["content"].split()]
        return list(range(len(words)))

    def count_tokens(self, prompt) -> int:
        return len(self.encode_prompt(prompt))

    async def generate(self, prompt, params, request_id=None):
        n = len(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) \
            else self.count_tokens(prompt)
        for i in range(params.max_tokens):
            await asyncio.sleep(0)             # let other requests in, as a step boundary would
            last = i == params.max_tokens - 1
            yield RequestOutput(request_id, "x", [i], "length" if last else None, Usage(n, i + 1))

    async def abort(self, request_id) -> bool:
        return False

    def stats(self) -> dict:
        return {"queue_depth": 0, "slots_in_use": 0, "slots_total": 0, "plan": "none", "placement": {}}

    def health(self) -> dict:
        return {"ok": True, "lost": []}


async def run(tokens: int, concurrency: list[int]) -> list[dict]:
    runner, port = await start_site(make_app(NullEngine()), "127.0.0.1", 0)
    rows = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            client = await HttpClient.connect(session, f"http://127.0.0.1:{port}", None)
            for c in concurrency:
                recs = [Record(i, -1, tokens) for i in range(c)]
                t0, cpu0 = time.perf_counter(), time.process_time()
                await asyncio.gather(*(client.run("a b c", tokens, r, t0) for r in recs))
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                n = sum(r.completion_tokens for r in recs)
                assert n == c * tokens, f"{n} tokens streamed, expected {c * tokens}"
                rows.append({"concurrency": c, "tokens": n, "wall_s": wall, "tok_s": n / wall,
                             "cpu_us_per_token": 1e6 * cpu / n})
    finally:
        await runner.cleanup()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per request")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--out", default="benchmarks/results/http_layer.json")
    a = ap.parse_args()
    rows = asyncio.run(run(a.tokens, [int(c) for c in a.concurrency.split(",")]))
    print("HTTP layer + client, null engine, one process (a ceiling, not a model's speed)")
    print(f"{'concurrency':>11}  {'tokens':>7}  {'tok/s':>9}  {'CPU us/token':>12}")
    for r in rows:
        print(f"{r['concurrency']:>11}  {r['tokens']:>7}  {r['tok_s']:>9.0f}  {r['cpu_us_per_token']:>12.1f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance(), "tokens_per_request": a.tokens, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
