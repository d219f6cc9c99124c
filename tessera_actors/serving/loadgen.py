"""``tessera bench serve``: replay a fixed request trace and report what clients saw.

    tessera bench serve [--url http://127.0.0.1:8000 | --launch 'SERVE FLAGS' [--launch-from DIR]]
                        --trace poisson|conversation|burst --rate R --requests N [--seed S] [--compare]

- ``poisson`` (the serving-engine issue's trace): N requests, exponential
  inter-arrival times at R requests/s, prompts of 50-400 tokens, outputs of
  32-128 tokens, all drawn from ``--seed``.  Completion prompts, greedy.
- ``conversation``: N turns in conversations of ``--turns`` turns that start
  at R conversations/s; each turn resends the whole chat so far (the real
  replies) plus a new user message of 20-100 tokens, after a think time.
- ``burst``: N requests all at once (``--prompt-tokens 40-40`` gives the
  16-concurrent, 40-token-prompt trace of the start-up issue).

``--launch 'FLAGS'`` starts ``tessera serve FLAGS`` itself (from ``--launch-from
DIR``, another checkout, when given), times it from the command to its first
``/health`` 200 and to every bucket placed, reads its resident memory, runs
the trace through it once every bucket is placed, and times its exit after
SIGINT (:mod:`tessera_actors.serving.launch`).

With ``--url`` the trace goes through the OpenAI HTTP API of a running
``tessera serve``; without it, through an in-process ``AsyncEngine`` built
from the engine flags; ``--compare`` runs it both ways on one in-process
engine (its own HTTP server on a free port) and prints the two side by side -
the HTTP layer's cost is the ratio column.  The report code is the same.

Exact lengths: prompts are built from words and trimmed until the server's
(or engine's) own token count hits the target; outputs ask ``max_tokens`` =
the target with ``ignore_eos``.  The table says how many lengths came out
exact (an engine without ``ignore_eos`` may stop early).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from tessera_actors.serving.loadgen_report import Record, summarize, table, write_json, write_png

WORDS = ("the of and to in is was for on with as by at from that this it are be have an not or one all "
         "time people year way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city name team minute idea kid body back parent face others level office door health person art").split()


SEQUENTIAL = "sequential (1 slot, prompt token by token)"


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival: float              # seconds after the start (turns after the first: think time after the reply)
    prompt_tokens: int          # completion: the whole prompt; conversation: the new user message
    output_tokens: int
    conversation: int = -1      # -1: a standalone request
    turn: int = 0


def poisson_trace(n: int, rate: float, seed: int, prompt=(50, 400), output=(32, 128)) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(TraceRequest(i, t, rng.randint(*prompt), rng.randint(*output)))
        t += rng.expovariate(rate)
    return out


def conversation_trace(n: int, rate: float, seed: int, turns: int = 4, message=(20, 100), output=(32, 128),
                       think: float = 1.0) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        conv, turn = divmod(i, turns)
        if turn == 0 and i:
            t += rng.expovariate(rate)
        arrival = t if turn == 0 else rng.expovariate(1.0 / think)
        out.append(TraceRequest(i, arrival, rng.randint(*message), rng.randint(*output), conv, turn))
    return out


async def exact_text(count: Callable[[str], Awaitable[int]], target: int, rng: random.Random,
                     tries: int = 10) -> str:
    """Words whose token count (by ``count``) is ``target``, or the closest found."""
    words = [rng.choice(WORDS) for _ in range(target)]
    best = None
    for _ in range(tries):
        text = " ".join(words)
        n = await count(text)
        if best is None or abs(n - target) < abs(best[0] - target):
            best = (n, text)
        if n == target:
            break
        if n > target:
            del words[max(1, len(words) - (n - target)):]
        else:
            words += [rng.choice(WORDS) for _ in range(target - n)]
    return best[1]


class EngineClient:
    """The trace through an ``AsyncEngine`` in this process."""
    name = "engine"

    def __init__(self, engine: Any) -> None:
        import dataclasses
        from tessera_actors.serving import SamplingParams
        self.engine, self.sp = engine, SamplingParams
        self.has_ignore_eos = "ignore_eos" in {f.name for f in dataclasses.fields(SamplingParams)}

    async def count(self, prompt) -> int:
        return self.engine.count_tokens(prompt)

    async def run(self, prompt, max_tokens: int, rec: Record, t0: float) -> str:
        kw = {"ignore_eos": True} if self.has_ignore_eos else {}
        params = self.sp(max_tokens=max_tokens, temperature=0.0, **kw)
        text = []
        rec.sent = time.perf_counter() - t0
        async for out in self.engine.generate(prompt, params):
            if out.token_ids and rec.first is None:
                rec.first = time.perf_counter() - t0
            text.append(out.text)
            rec.prompt_tokens, rec.completion_tokens = out.usage.prompt_tokens, out.usage.completion_tokens
            rec.finish_reason = out.finish_reason
        rec.end = time.perf_counter() - t0
        return "".join(text)


class HttpClient:
    """The trace through the OpenAI HTTP API (streamed, so TTFT is the first event)."""
    name = "http"

    def __init__(self, session, url: str, model: str, api_key: str | None) -> None:
        self.session, self.url, self.model = session, url.rstrip("/"), model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    @classmethod
    async def connect(cls, session, url: str, api_key: str | None) -> "HttpClient":
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with session.get(url.rstrip("/") + "/v1/models", headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {url}/v1/models: HTTP {r.status}: {await r.text()}")
            return cls(session, url, (await r.json())["data"][0]["id"], api_key)

    async def count(self, prompt) -> int:
        key = "prompt" if isinstance(prompt, str) else "messages"
        async with self.session.post(self.url + "/tokenize", json={"model": self.model, key: prompt},
                                     headers=self.headers) as r:
            body = await r.json()
            if r.status != 200:
                raise RuntimeError(f"/tokenize: HTTP {r.status}: {body}")
            return body["count"]

    async def run(self, prompt, max_tokens: int, rec: Record, t0: float) -> str:
        chat = not isinstance(prompt, str)
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, ("messages" if chat else "prompt"): prompt}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        text = []
        rec.sent = time.perf_counter() - t0
        async with self.session.post(self.url + path, json=body, headers=self.headers) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return ""
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    rec.error = ev["error"]["message"]
                    return "".join(text)
                if ev.get("usage"):
                    rec.prompt_tokens = ev["usage"]["prompt_tokens"]
                    rec.completion_tokens = ev["usage"]["completion_tokens"]
                for ch in ev.get("choices", []):
                    piece = ch["delta"].get("content") if chat else ch.get("text")
                    if piece:
                        if rec.first is None:
                            rec.first = time.perf_counter() - t0
                        text.append(piece)
                    rec.finish_reason = ch.get("finish_reason") or rec.finish_reason
        rec.end = time.perf_counter() - t0
        return "".join(text)


async def build_prompts(trace: list[TraceRequest], client, seed: int) -> list[str]:
    rng = random.Random(seed + 1)
    return [await exact_text(client.count, r.prompt_tokens, rng) for r in trace]


async def replay(trace: list[TraceRequest], prompts: list[str], client) -> list[Record]:
    """Send every request at its time (conversations: turn k after reply k-1 and a think time)."""
    # a conversation's prompt is the whole chat so far: no target length for it (-1)
    records = [Record(r.index, r.prompt_tokens if r.conversation < 0 else -1, r.output_tokens) for r in trace]
    t0 = time.perf_counter()

    async def one(r: TraceRequest, prompt) -> str:
        try:
            return await client.run(prompt, r.output_tokens, records[r.index], t0)
        except Exception as e:              # noqa: BLE001 - a failed request is a row of the report
            records[r.index].error = f"{type(e).__name__}: {e}"
            return ""

    async def at(t: float) -> None:
        await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))

    async def standalone(r: TraceRequest) -> None:
        await at(r.arrival)
        await one(r, prompts[r.index])

    async def conversation(turns: list[TraceRequest]) -> None:
        history: list[dict] = []
        for r in turns:
            if r.turn == 0:
                await at(r.arrival)
            else:
                await asyncio.sleep(r.arrival)
            history.append({"role": "user", "content": prompts[r.index]})
            reply = await one(r, list(history))
            history.append({"role": "assistant", "content": reply})
    convs: dict[int, list[TraceRequest]] = {}
    for r in trace:
        if r.conversation >= 0:
            convs.setdefault(r.conversation, []).append(r)
    await asyncio.gather(*[standalone(r) for r in trace if r.conversation < 0],
                         *[conversation(c) for c in convs.values()])
    return records


async def warm_up(client, prompts: list[str], n: int) -> None:
    """``n`` short requests at once, not recorded: the first steps of each bucket
    (eager runs, graph captures) stay out of the measured run."""
    if n > 0:
        await asyncio.gather(*(client.run(prompts[i % len(prompts)], 8, Record(-1, -1, 8), time.perf_counter())
                               for i in range(n)))


def _span(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI (e.g. 50-400), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tessera_actors.serving.flags import add_engine_arguments
    p.add_argument("--url", default=None, help="a running tessera serve (default: an in-process AsyncEngine)")
    p.add_argument("--api-key", default=None, help="with --url: the server's --api-key (sent as a bearer token)")
    p.add_argument("--compare", action="store_true",
                   help="in-process: run the trace through the engine and through HTTP on it, side by side")
    p.add_argument("--baseline", default=None, choices=["sequential"],
                   help="in-process: also run the trace through the engine configured as the old sequential "
                        "service (1 KV slot, the prompt fed token by token), side by side")
    p.add_argument("--baseline-requests", type=int, default=0,
                   help="the baseline replays only the first N requests of the trace (0: all); a one-at-a-time "
                        "server's throughput does not depend on how many wait, and it serves 64 slowly")
    p.add_argument("--launch", default=None, metavar="'SERVE FLAGS'",
                   help="start `tessera serve FLAGS` here and time its start, memory and exit (e.g. "
                        "'--model smollm2')")
    p.add_argument("--launch-from", default=None, metavar="DIR",
                   help="with --launch: the checkout whose code serves (e.g. an older commit's tree)")
    p.add_argument("--trace", default="poisson", choices=["poisson", "conversation", "burst"],
                   help="Poisson arrivals, multi-turn conversations, or every request at once")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s (conversation: conversations/s)")
    p.add_argument("--requests", type=int, default=64, help="requests in the trace (conversation: turns in all)")
    p.add_argument("--turns", type=int, default=4, help="conversation trace: turns per conversation")
    p.add_argument("--prompt-tokens", type=_span, default=None,
                   help="LO-HI prompt tokens (poisson: 50-400; conversation: new message, 20-100)")
    p.add_argument("--output-tokens", type=_span, default=(32, 128), help="LO-HI output tokens (32-128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace (arrivals, lengths, prompt words)")
    p.add_argument("--warmup", type=int, default=4, help="short requests sent at once before each measured run")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput SLO: time per output token, ms")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput SLO: time to first token, ms")
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON and the PNG")
    p.add_argument("--name", default=None, help="file stem (default serve_<trace>_<mode>)")
    p.add_argument("--trace-dir", default=None, help="in-process: the engine's trace-event JSON goes here")
    add_engine_arguments(p, seed_flag="--engine-seed")


def burst_trace(n: int, seed: int, prompt=(40, 40), output=(32, 128)) -> list[TraceRequest]:
    rng = random.Random(seed)
    return [TraceRequest(i, 0.0, rng.randint(*prompt), rng.randint(*output)) for i in range(n)]


async def _launched(a: argparse.Namespace, session, trace: list[TraceRequest]) -> tuple[dict, dict]:
    """The trace through a ``tessera serve`` this benchmark starts (``--launch``)."""
    from dataclasses import asdict
    from tessera_actors.serving.launch import LaunchedServer
    server = LaunchedServer(a.launch, a.launch_from)
    try:
        url = await server.start(session)
        client = await HttpClient.connect(session, url, None)
        prompts = await build_prompts(trace, client, a.seed)
        await warm_up(client, prompts, a.warmup)
        records = {"http": await replay(trace, prompts, client)}
    finally:
        report = server.stop()
    return records, {"launch": asdict(report), "model": client.model}


async def _run(a: argparse.Namespace) -> tuple[dict, dict]:
    import aiohttp
    if a.trace == "poisson":
        trace = poisson_trace(a.requests, a.rate, a.seed, a.prompt_tokens or (50, 400), a.output_tokens)
    elif a.trace == "burst":
        trace = burst_trace(a.requests, a.seed, a.prompt_tokens or (40, 40), a.output_tokens)
    else:
        trace = conversation_trace(a.requests, a.rate, a.seed, a.turns, a.prompt_tokens or (20, 100),
                                   a.output_tokens)
    records: dict[str, list[Record]] = {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        if a.launch:
            return await _launched(a, session, trace)
        if a.url:
            client = await HttpClient.connect(session, a.url, a.api_key)
            prompts = await build_prompts(trace, client, a.seed)
            await warm_up(client, prompts, a.warmup)
            records["http"] = await replay(trace, prompts, client)
            return records, {"url": a.url, "model": client.model}
        from tessera_actors.serving import AsyncEngine
        from tessera_actors.serving.flags import engine_kwargs
        from tessera_actors.serving.server import make_app, start_site
        kw = engine_kwargs(a, a.trace_dir)
        async with AsyncEngine(**kw) as eng:
            await eng.wait_placed()   # a steady engine: every prompt-chunk bucket in place
            client = EngineClient(eng)
            prompts = await build_prompts(trace, client, a.seed)
            await warm_up(client, prompts, a.warmup)
            records["engine"] = await replay(trace, prompts, client)
            if a.compare:
                runner, port = await start_site(make_app(eng), "127.0.0.1", 0)
                try:
                    http = await HttpClient.connect(session, f"http://127.0.0.1:{port}", None)
                    await warm_up(http, prompts, a.warmup)
                    records["http"] = await replay(trace, prompts, http)
                finally:
                    await runner.cleanup()
        if a.baseline == "sequential":
            seq_kw = dict(kw, max_seqs=1, decode_buckets=(1,), prefill_buckets=(1,), mode="latency")
            seq_kw.pop("trace_dir", None)
            n = a.baseline_requests or len(trace)
            async with AsyncEngine(**seq_kw) as seq:
                await seq.wait_placed()
                await warm_up(EngineClient(seq), prompts, a.warmup)
                base = await replay(trace[:n], prompts[:n], EngineClient(seq))
            records = {SEQUENTIAL: base, **records}
            kw = {"engine": kw, "sequential": seq_kw}
            return records, {**kw, "ignore_eos": client.has_ignore_eos}
        return records, {"engine": kw, "ignore_eos": client.has_ignore_eos}


def launch_line(r: dict) -> str:
    """One line of what ``--launch`` measured."""
    mb = {k: f"{v / 2**20:.0f}" for k, v in r["rss"].items()}
    def s(v):
        return "-" if v is None else f"{v:.1f} s"
    return (f"start-up ({(r['commit'] or '?')[:7]}): first /health ok {s(r['health_ok_s'])}, every bucket placed "
            f"{s(r['all_placed_s'])}; RSS MB ready {mb.get('ready', '-')}, placed {mb.get('placed', '-')}, after "
            f"the trace {mb.get('after_trace', '-')}; SIGINT to exit {s(r['exit_s'])} (status {r['exit_code']})")


def run_command(a: argparse.Namespace) -> int:
    """``tessera bench serve``: replay, print the table, write JSON (+ PNG)."""
    if a.requests < 1 or a.rate <= 0:
        raise ValueError("--requests must be >= 1 and --rate > 0")
    if (a.compare or a.baseline) and (a.url or a.launch):
        raise ValueError("--compare and --baseline run in-process engines; leave out --url and --launch")
    if a.url and a.launch:
        raise ValueError("--url serves a running server, --launch starts one: give one of them")
    records, where = asyncio.run(_run(a))
    slo_tpot, slo_ttft = a.slo_tpot_ms / 1000, a.slo_ttft_ms / 1000
    summaries = {k: summarize(v, slo_tpot, slo_ttft) for k, v in records.items()}
    mode = "+".join(records)
    print(f"tessera bench serve: trace {a.trace}, {a.requests} requests at {a.rate:g}/s, seed {a.seed}, via {mode}")
    print(table(summaries))
    if "launch" in where:
        print(launch_line(where["launch"]))
    stem = a.name or re.sub(r"[^A-Za-z0-9_.-]+", "_", f"serve_{a.trace}_{mode}").strip("_")
    out = Path(a.out)
    config = {"trace": a.trace, "launch_flags": a.launch, "requests": a.requests, "rate": a.rate, "seed": a.seed,
              "turns": a.turns,
              "prompt_tokens": a.prompt_tokens, "output_tokens": a.output_tokens,
              "baseline": a.baseline, "baseline_requests": a.baseline_requests or None, **where}
    write_json(out / f"{stem}.json", config, summaries, records)
    why = write_png(out / f"{stem}.png", records, slo_tpot)
    print(f"wrote {out / (stem + '.json')}" + (f" and {stem}.png" if why is None else f" ({why})"))
    return 0 if all(s["finished"] for s in summaries.values()) else 1
