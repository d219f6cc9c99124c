"""``scripts/slurm/tessera.sbatch``: valid bash, and its body run here with
``srun`` replaced by a local launcher (two tasks on this host, with the
variables srun sets) serves SmolLM2 over the OpenAI API from two node
daemons that found their scheduler and rendezvous in the SLURM_* variables."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "scripts" / "slurm" / "tessera.sbatch"

FAKE_SRUN = """#!/usr/bin/env bash
# srun stand-in: the command once per task, on this host, with the variables srun sets for each
n=1
while [ $# -gt 0 ]; do
  case "$1" in --ntasks=*) n=${1#--ntasks=}; shift ;; --*) shift ;; *) break ;; esac
done
pids=()
for ((i = 0; i < n; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 SLURMD_NODENAME=localhost "$@" &
  pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' TERM INT
wait
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_sbatch_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


async def test_the_sbatch_body_with_a_local_srun_serves_from_two_node_daemons(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    http = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "TESSERA_"))}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "SLURM_JOB_NODELIST": "localhost",
                "SLURM_NTASKS": "2", "SLURM_JOB_ID": "77", "MASTER_PORT": str(free_port()),
                "TESSERA_SCHEDULER_PORT": str(free_port()), "TESSERA_HTTP_PORT": str(http),
                "TESSERA_KEYS": str(tmp_path / "keys"), "TESSERA_PYTHON": sys.executable,
                "TESSERA_SERVE_ARGS": "--size tiny --max-seqs 2 --max-model-len 256",
                "TESSERA_NODE_ARGS": "--data-plane dist", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))})
    log = open(tmp_path / "job.err", "wb")
    job = await asyncio.create_subprocess_exec("bash", str(SBATCH), env=env, stdout=asyncio.subprocess.PIPE,
                                               stderr=log, start_new_session=True)
    try:
        async def ready() -> str:
            while True:
                line = (await job.stdout.readline()).decode()
                assert line, "the job ended before tessera serve was ready: " + \
                    (tmp_path / "job.err").read_text()[-3000:]
                if "tessera serve: ready" in line:
                    return line
        await asyncio.wait_for(ready(), 300)
        base = f"http://127.0.0.1:{http}"
        reply = await asyncio.to_thread(_post, f"{base}/v1/completions", {
            "model": "smollm2", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True})
        stats = await asyncio.to_thread(_get, f"{base}/v1/tessera/stats")
        assert reply["usage"]["completion_tokens"] == 6 and reply["choices"][0]["text"]
        assert stats["engine"]["placement"]["devices"] == ["cpu", "cpu"]
        assert (tmp_path / "keys" / "server.key_secret").exists()   # the job made its cluster keys
        job.send_signal(signal.SIGTERM)   # scancel: the trap stops the server and the node daemons
        await asyncio.wait_for(job.wait(), 60)
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)   # whatever the trap left behind
        except ProcessLookupError:
            pass
        if job.returncode is None:
            await job.wait()
        log.close()
