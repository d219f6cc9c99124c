"""``tessera bench offload`` on CPU only (tiny model): every policy is served
by an engine, the JSON holds the numbers the issue names, the budgeted
device's allocation stays within its budget, batch-1 greedy tokens equal
the single-device reference's (free-running through the engine, and
teacher-forced logits of Tessera's plan bitwise)."""
import json
import os
import subprocess
import sys

import pytest


def test_offload_bench_cpu_smoke(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "tessera_actors.cli", "bench", "offload", "--model", "llama", "--size", "tiny",
           "--gpu-budget", "0.6", "--batch", "1,2", "--prefill", "8", "--steps", "3", "--prefill-steps", "1",
           "--dtype", "float32", "--ring", "slots,bytes", "--out", str(out)]
    env = {"TESSERA_GIT_COMMIT": "abc123"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tessera" in done.stdout and "decode_b1" in done.stdout
    doc = json.loads((out / "offload.json").read_text())
    assert doc["git_commit"] == "abc123" and "bench offload" in doc["command"]
    for name in ("decode_b1", "decode_b2", "prefill"):
        row = doc[name]
        for key in ("tessera_tok_s", "layer_offload_tok_s", "streaming_tok_s", "ideal_tok_s"):
            assert row[key] > 0, (name, key)
        for pol in row["policies"].values():
            assert 0 <= pol["gpu_allocated_bytes"] <= row["gpu_budget_bytes"]
            assert pol["plan"].startswith("offload-")
    for pol in doc["decode_b1"]["policies"].values():
        assert pol["tokens_equal_reference"] and pol["first_difference"] is None
    for name in ("tessera", "tessera_ring_bytes"):   # the packed staging ring too, side by side
        tessera = doc["decode_b1"]["policies"][name]
        assert tessera["forced_tokens_equal_reference"] and tessera["min_logits_cosine"] > 0.999999, name
    assert doc["config"]["rings"] == ["slots", "bytes"]
    streaming = doc["decode_b1"]["policies"]["streaming"]["gpu_stats"]
    # the served steps found their first copies queued by the step before; no streamed piece fell back
    assert streaming["streamed_copies"] > 0 and streaming["streamed_copies_ahead_used"] > 0
    assert streaming["capture_failures"] == 0 and streaming["last_capture_error"] == ""
    assert (out / "offload.png").stat().st_size > 0


@pytest.mark.gpu
def test_offload_bench_on_a_gpu_with_two_real_size_layers(tmp_path):
    """A subprocess: the budget caps the allocator of the whole process."""
    out = tmp_path / "gpu"
    cmd = [sys.executable, "-m", "tessera_actors.cli", "bench", "offload", "--model", "llama", "--size", "real",
           "--layers", "2", "--gpu-budget", "2GiB", "--batch", "1", "--prefill", "0", "--steps", "8",
           "--devices", "cuda:0,cpu?threads=12", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = json.loads((out / "offload.json").read_text())["decode_b1"]
    t = row["policies"]["tessera"]
    assert "error" not in t, t
    assert t["gpu_peak_bytes"] <= row["gpu_budget_bytes"] and t["gpu_allocated_bytes"] <= row["gpu_budget_bytes"]
    assert t["min_logits_cosine"] >= 0.999
    assert t["kernels_on_cpu"] > 0 or t["pcie_bytes_per_token"] > 0
    if t["pcie_bytes_per_token"] > 0:   # streamed pieces run as CUDA graphs, first copies queued a step ahead
        st = t["gpu_stats"]
        assert st["replays"] > 0 and st["capture_failures"] == 0, st
        assert st["streamed_copies_ahead_used"] > 0, st
