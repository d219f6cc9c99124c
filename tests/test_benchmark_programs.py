"""Benchmark programs run as a user starts them: the HTTP layer's ceiling
streams every token through the real server, and the GPU-only programs
say so on a machine without CUDA instead of failing deep inside torch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_the_http_layer_benchmark_streams_every_token_through_the_server(tmp_path):
    out = tmp_path / "http_layer.json"
    done = _run(["benchmarks/bench_http_layer.py", "--tokens", "5", "--concurrency", "1,3", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [(r["concurrency"], r["tokens"]) for r in doc["rows"]] == [(1, 5), (3, 15)]
    assert doc["provenance"]["git_commit"] and "bench_http_layer.py" in doc["provenance"]["command"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize("args", [
    ["benchmarks/bench_engine_step.py"],
    ["-m", "tessera_actors.cli", "bench", "offload", "--size", "real"],
    ["-m", "tessera_actors.cli", "bench", "roofline"],
], ids=["engine_step", "offload_real", "roofline"])
def test_a_gpu_only_benchmark_says_no_cuda_device_is_visible(args, tmp_path):
    done = _run([*args, *(["--out", str(tmp_path)] if "bench" in args else [])])
    assert done.returncode != 0
    assert "no CUDA device is visible" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
