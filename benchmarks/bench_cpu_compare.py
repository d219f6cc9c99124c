"""``tessera serve`` beside vLLM's CPU build and llama.cpp's server, one server at a time (issue #33).

For each of ``--rounds`` rounds (the order of the servers alternates from round to round; the box is
shared, so ratios within a round are what count) each server of ``--servers`` is started as a user
starts it (``benchmarks/cpu_compare_servers.py`` says how: tessera fp32 and quantized, vLLM-CPU fp32,
llama.cpp Q4_1), waited for (tessera: every bucket placed; vLLM: ``/health`` 200, after its compilation;
llama.cpp: ``/v1/models``), measured, and stopped:

* server memory: RSS summed over its process tree (its session: vLLM's API server, engine core and
  worker), and PSS (shared pages counted once), idle and after the load;
* idle TTFT of a fresh ~290-token chat prompt (median of ``--ttft-reps`` prompts never sent before),
  then of the last one repeated (prefix cache);
* batch-1 decode tok/s: one stream of ``--decode-tokens`` tokens (``ignore_eos``; llama.cpp:
  ``min_tokens``), (tokens - 1) / (last token - first token);
* guidellm (a third-party load generator, ``/work/venv-cmp``) at fixed concurrency: ``--requests``
  requests of ``--prompt-tokens`` synthetic prompt tokens and ``--output-tokens`` output tokens on
  ``/v1/completions``: output tok/s (finished requests' output tokens / guidellm's measured duration),
  TTFT p50/p99, ITL p50 (vLLM's TPOT: time between tokens after the first), guidellm's TPOT p50
  (whole latency / output tokens);
* greedy outputs of ``PROMPTS`` (temperature 0, ``--greedy-tokens`` tokens, top-2 log-probabilities
  of each), tessera fp32 against vLLM fp32 by token: where they part, each side's top-1 - top-2 margin
  and whether it is a near-tie (``--near-tie`` nats);
* load average before and after each server's block.

It prints each server's medians, the per-round ratios of tessera fp32 / vLLM fp32, tessera quantized /
llama.cpp and tessera quantized / vLLM with their medians, and #33's acceptance rows (per round, the
median, met or not); JSON after every round, PNG at the end.  ``--tessera-root`` serves tessera from
another checkout (a detached worktree of a commit under test); its commit is recorded.

    PYTHONPATH=. /work/venv/bin/python benchmarks/bench_cpu_compare.py --rounds 3 \\
        --out benchmarks/results/serve_cpu/compare_vllm_cpu.json --plot benchmarks/results/serve_cpu/compare_vllm_cpu.png
    # smoke run (one short round; numbers are not a measurement on a busy box):
    PYTHONPATH=. /work/venv/bin/python benchmarks/bench_cpu_compare.py --rounds 1 --requests 16 \\
        --ttft-reps 2 --decode-tokens 32 --out /tmp/compare_smoke.json --plot /tmp/compare_smoke.png

The guidellm command run against each server (kept in the JSON; for llama.cpp the backend is the same
fields as JSON plus ``"api_routes": {"/health": "v1/models"}, "extras": {"body": {"min_tokens": 64}}``):

    guidellm run --backend kind=openai_http,target=URL,model=smollm2,request_format=/v1/completions \\
        --profile kind=concurrent,streams=16 --data kind=synthetic_text,prompt_tokens=200,output_tokens=64 \\
        --tokenizer kind=huggingface_auto,model=/work/models/smollm2-hf \\
        --constraint kind=max_requests,count=32 --output kind=json,path=OUT.json --disable-progress
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import cpu_compare_report as report
from cpu_compare_servers import MODEL_NAME, SPECS, Server, ServerSpec, stop_live

from tessera_actors.models.smollm2 import SYSTEM_PROMPT
from tessera_actors.provenance import provenance
from tessera_actors.serving.loadgen import WORDS

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = ("What is the capital of France?",
           "Explain in two sentences why the sky is blue.",
           "Write a short poem about a cat sitting by the window.")


def render_chat(user: str) -> str:
    """The SmolLM2 template's text for one user message (the same template both servers apply)."""
    return (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def chat_prompt(tokenizer, target: int, seed: int) -> str:
    """A user message of random common words whose rendered chat is ``target`` tokens (or one short)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(target)]
    while len(words) > 1 and len(tokenizer.encode(render_chat(" ".join(words))).ids) > target:
        words.pop()
    return " ".join(words)


async def chat_stream(session, url: str, user: str, max_tokens: int, extra: dict | None = None) -> dict:
    """One streamed greedy chat request: TTFT, first-to-last token time, token counts (the usage's, else
    the streamed pieces': llama.cpp's server sends no usage when streaming)."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": user}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    first = last = None
    pieces = 0
    usage: dict = {}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                last = time.perf_counter()
                first = first or last
                pieces += 1
    return {"ttft_s": None if first is None else first - t0, "decode_s": None if first is None else last - first,
            "completion_tokens": usage.get("completion_tokens") or pieces, "prompt_tokens": usage.get("prompt_tokens"),
            "pieces": pieces}


async def greedy(session, url: str, tokens: int) -> list[dict]:
    """Each of ``PROMPTS`` at temperature 0, with each token's top-2 log-probabilities."""
    out = []
    for prompt in PROMPTS:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                "temperature": 0, "logprobs": True, "top_logprobs": 2}
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            reply = await r.json(content_type=None)
        choice = reply["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        out.append({"prompt": prompt, "text": choice["message"]["content"],
                    "tokens": [[t["token"], t["logprob"], [[x["token"], x["logprob"]] for x in t["top_logprobs"]]]
                               for t in content]})
    return out


def guidellm_argv(a, spec: ServerSpec, url: str, out_json: Path) -> list[str]:
    """guidellm's command; for llama.cpp (no ``ignore_eos``, no ``/health``) the backend as JSON with
    ``min_tokens`` in each body and ``/v1/models`` as its health check."""
    backend = f"kind=openai_http,target={url},model={MODEL_NAME},request_format=/v1/completions"
    if spec.min_tokens:
        backend = json.dumps({"kind": "openai_http", "target": url, "model": MODEL_NAME,
                              "request_format": "/v1/completions", "api_routes": {"/health": spec.health.lstrip("/")},
                              "extras": {"body": spec.no_eos(a.output_tokens)}})
    return [a.guidellm, "run", "--backend", backend,
            "--profile", f"kind=concurrent,streams={a.concurrency}",
            "--data", f"kind=synthetic_text,prompt_tokens={a.prompt_tokens},output_tokens={a.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={a.hf_model}",
            "--constraint", f"kind=max_requests,count={a.requests}",
            "--output", f"kind=json,path={out_json}", "--disable-progress"]


def _summary(dist: dict, key: str = "successful") -> dict:
    d = dist.get(key) or {}
    return {"mean": d.get("mean"), "p50": (d.get("percentiles") or {}).get("p50", d.get("median")),
            "p99": (d.get("percentiles") or {}).get("p99"), "count": d.get("count")}


def run_guidellm(a, spec: ServerSpec, url: str, work: Path) -> dict:
    """guidellm against ``url``; its report's numbers (seconds; tok/s)."""
    out_json = work / f"guidellm-{url.rsplit(':', 1)[1]}.json"
    argv = guidellm_argv(a, spec, url, out_json)
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=a.guidellm_timeout)
    if done.returncode != 0 or not out_json.exists():
        raise RuntimeError(f"guidellm failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    bench = json.loads(out_json.read_text())["benchmarks"][0]
    m = bench["metrics"]
    ttft, itl, tpot = (_summary(m[k]) for k in ("time_to_first_token_ms", "inter_token_latency_ms",
                                                 "time_per_output_token_ms"))
    out_tokens = (m["output_token_count"].get("successful") or {}).get("total_sum") or 0
    done_requests = (m.get("request_totals") or {}).get("successful") or 0
    return {"command": " ".join(argv), "output_tok_s": out_tokens / bench["duration"],
            "output_tokens_per_request": out_tokens / done_requests if done_requests else None,
            "guidellm_output_tok_s_mean": _summary(m["output_tokens_per_second"])["mean"],
            "output_tokens": out_tokens, "duration_s": bench["duration"],
            "ttft_p50_s": ttft["p50"] / 1e3, "ttft_p99_s": ttft["p99"] / 1e3,
            "itl_p50_s": itl["p50"] / 1e3, "tpot_p50_s": tpot["p50"] / 1e3,
            "request_totals": m.get("request_totals")}


async def measure(server: Server, a, tokenizer, rnd: int) -> dict:
    """Everything but guidellm, on a ready server."""
    res: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await chat_stream(s, server.url, chat_prompt(tokenizer, a.chat_tokens, 10_000 + rnd), 4)   # warm-up
        fresh = []
        for i in range(a.ttft_reps):
            user = chat_prompt(tokenizer, a.chat_tokens, 1000 * rnd + i)
            fresh.append(await chat_stream(s, server.url, user, 4))
        repeated = [await chat_stream(s, server.url, user, 4) for _ in range(a.ttft_reps)]
        res["chat_prompt_tokens"] = fresh[-1]["prompt_tokens"]
        res["ttft_fresh_s"] = statistics.median(r["ttft_s"] for r in fresh)
        res["ttft_repeated_s"] = statistics.median(r["ttft_s"] for r in repeated)
        d = await chat_stream(s, server.url, "Tell me a long story about a lighthouse keeper.", a.decode_tokens,
                              server.spec.no_eos(a.decode_tokens))
        res["batch1_tokens"], res["batch1_pieces"] = d["completion_tokens"], d["pieces"]
        res["batch1_tok_s"] = (d["completion_tokens"] - 1) / d["decode_s"] if d["decode_s"] else None
        res["greedy"] = await greedy(s, server.url, a.greedy_tokens)
    return res


async def server_block(spec: ServerSpec, a, tokenizer, rnd: int, work: Path) -> dict:
    """Start one server, measure it, stop it; the load average around the whole block."""
    block = {"load_before": os.getloadavg(), "command": " ".join(spec.argv), "env": spec.env,
             "started_utc": time.strftime("%H:%M:%S", time.gmtime())}
    server = Server(spec, work)
    t0 = time.perf_counter()
    try:
        async with aiohttp.ClientSession() as s:
            block["ready_s"] = await server.start(s, a.start_timeout)
        block["memory_idle"] = server.memory()
        block.update(await measure(server, a, tokenizer, rnd))
        block["guidellm"] = await asyncio.to_thread(run_guidellm, a, spec, server.url, work)
        block["memory_after_load"] = server.memory()
    except (RuntimeError, aiohttp.ClientError, TimeoutError, KeyError, subprocess.TimeoutExpired) as e:
        block["error"] = f"{type(e).__name__}: {e}"[-3000:]     # the round goes on with the other servers
        print(f"  {spec.name} failed: {block['error'][-600:]}", flush=True)
    finally:
        block["exit_code"] = server.stop()
        block["log"] = str(server.log)
    block["load_after"] = os.getloadavg()
    block["block_s"] = time.perf_counter() - t0
    return block


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--servers", default="tessera,tessera-q,vllm,llamacpp",
                   help="comma-separated: tessera (fp32), tessera-q (quantized default), vllm, llamacpp")
    p.add_argument("--requests", type=int, default=32, help="guidellm requests")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--chat-tokens", type=int, default=290, help="tokens of the TTFT chat prompt, template included")
    p.add_argument("--ttft-reps", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--near-tie", type=float, default=0.5, help="nats between a side's two first choices")
    p.add_argument("--threads", type=int, default=2, help="vLLM's and llama.cpp's threads (tessera: every core)")
    p.add_argument("--kv-gib", type=int, default=1, help="KV cache GiB of tessera fp32 and vLLM")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--hf-model", default="/work/models/smollm2-hf")
    p.add_argument("--tessera-root", default=str(ROOT), help="the checkout tessera serve runs from")
    p.add_argument("--vllm-venv", default="/work/venv-vllm")
    p.add_argument("--llama-venv", default="/work/venv-llama", help="venv with llama-cpp-python[server]")
    p.add_argument("--no-iomp", action="store_true", help="do not LD_PRELOAD the vLLM venv's libiomp5.so")
    p.add_argument("--guidellm", default="/work/venv-cmp/bin/guidellm")
    p.add_argument("--guidellm-timeout", type=float, default=900)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--out", default="benchmarks/results/serve_cpu/compare_vllm_cpu.json")
    p.add_argument("--plot", default=None, help="PNG of the per-round ratios")
    p.add_argument("--stop-at", default=None, help="HH:MM UTC: start no server block after it (what finished is kept)")
    return p.parse_args(argv)


def versions(a, specs: list[ServerSpec]) -> dict:
    g = subprocess.run([a.guidellm, "--version"], check=False, capture_output=True, text=True, timeout=120).stdout.strip()
    return {**{s.name: s.version for s in specs}, "guidellm": g.rsplit(" ", 1)[-1] or None}


def past(hh_mm: str | None) -> bool:
    """Is it past ``hh_mm`` UTC today?"""
    if not hh_mm:
        return False
    h, m = (int(x) for x in hh_mm.split(":"))
    now = time.gmtime()
    return (now.tm_hour, now.tm_min) >= (h, m)


def summarise(result: dict, names: list[str]) -> None:
    """The tables of the rounds so far, into ``result`` and onto stdout."""
    rounds = result["rounds"]
    pairs = sorted({p for r in rounds for p in r.get("ratios", {})})
    result["median_ratios"] = {p: {m: report.median([(r.get("ratios", {}).get(p) or {}).get(m) for r in rounds])
                                   for m in report.METRIC} for p in pairs}
    result["acceptance"] = report.acceptance(rounds)
    result["load"] = [{n: [b["load_before"], b["load_after"]] for n, b in r["servers"].items()} for r in rounds]
    print(report.round_table(rounds[-1], len(rounds)), flush=True)
    print(report.server_table(rounds, names), flush=True)
    print(report.acceptance_table(result["acceptance"], len(rounds)), flush=True)


async def main(argv=None) -> dict:
    a = parse_args(argv)
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(Path(a.hf_model) / "tokenizer.json"))
    names = a.servers.split(",")
    specs = [SPECS[n](a) for n in names]
    result = {**provenance(argv if argv is None else [sys.argv[0], *argv]), "config": vars(a),
              "versions": versions(a, specs), "rounds": []}
    work = Path(tempfile.mkdtemp(prefix="cpu_compare_"))
    signal.signal(signal.SIGTERM, stop_live)
    for rnd in range(a.rounds):
        order = specs if rnd % 2 == 0 else specs[::-1]
        servers: dict = {}
        r = {"order": [s.name for s in order], "servers": servers}
        result["rounds"].append(r)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        for spec in order:
            if past(a.stop_at):
                result["stopped_at"] = f"round {rnd + 1} before {spec.name}: past --stop-at {a.stop_at}"
                break
            print(f"round {rnd + 1}: {spec.name} (load {os.getloadavg()[0]:.1f}, {time.strftime('%H:%M:%S')})",
                  flush=True)
            servers[spec.name] = await server_block(spec, a, tokenizer, rnd, work)
            r["ratios"] = report.round_ratios(servers)
            Path(a.out).write_text(json.dumps(result, indent=1))       # kept after every server
        if all(servers.get(n, {}).get("greedy") for n in ("tessera", "vllm")):
            r["greedy"] = report.compare_greedy(servers["tessera"]["greedy"], servers["vllm"]["greedy"], a.near_tie)
        if not servers:
            result["rounds"].pop()
        if result["rounds"]:
            summarise(result, names)
            Path(a.out).write_text(json.dumps(result, indent=1))
        if "stopped_at" in result:
            print(result["stopped_at"], flush=True)
            break
    if not result["rounds"]:
        Path(a.out).write_text(json.dumps(result, indent=1))
        return result
    for g in result["rounds"][-1].get("greedy", []):
        print(f"greedy {g['prompt']!r}: max |logprob diff| {report.fmt(g['max_logprob_diff'])}, " + (
              "same text" if g["same_text"] else
              f"first differing token {g.get('first_diff_token')}: tessera {g.get('a_token')!r} "
              f"(margin {report.fmt(g.get('a_margin'))}) vs vLLM {g.get('b_token')!r} "
              f"(margin {report.fmt(g.get('b_margin'))}), near-tie {g.get('near_tie')}"))
    if a.plot:
        report.write_plot(result["rounds"], a.plot)
    print(f"wrote {a.out}" + (f" and {a.plot}" if a.plot else ""))
    return result


if __name__ == "__main__":
    asyncio.run(main())
