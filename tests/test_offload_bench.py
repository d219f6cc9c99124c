"""``tessera bench offload`` on CPU only (tiny model): every policy runs on
device actors, the JSON holds the numbers the issue names, batch-1 greedy
tokens equal the single-device reference."""
import json
import subprocess
import sys


def test_offload_bench_cpu_smoke(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "tessera_actors.cli", "bench", "offload", "--model", "llama", "--size", "tiny",
           "--gpu-budget", "0.5", "--batch", "1,2", "--prefill", "8", "--steps", "3", "--prefill-steps", "1",
           "--dtype", "float32", "--out", str(out)]
    env = {"TESSERA_GIT_COMMIT": "abc123"}
    import os
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tessera" in done.stdout and "decode_b1" in done.stdout
    doc = json.loads((out / "offload.json").read_text())
    assert doc["git_commit"] == "abc123" and "bench offload" in doc["command"]
    for name in ("decode_b1", "decode_b2", "prefill"):
        row = doc[name]
        for key in ("tessera_tok_s", "layer_offload_tok_s", "streaming_tok_s", "ideal_tok_s"):
            assert row[key] > 0, (name, key)
        assert 0 < row["gpu_peak_bytes"] <= row["gpu_budget_bytes"]
        for pol in row["policies"].values():
            assert pol["gpu_arena_bytes"] <= row["gpu_budget_bytes"]
    for pol in doc["decode_b1"]["policies"].values():
        assert pol["tokens_equal_reference"] and pol["min_logits_cosine"] > 0.999999
    assert (out / "offload.png").stat().st_size > 0
