"""``tessera bench offload`` on CPU only (tiny model): every row is served
by an engine with a GPU budget, the JSON holds the numbers the issue names,
the budgeted device's allocation stays within its budget, batch-1 greedy
tokens equal the single-device reference's (free-running through the
engine, and teacher-forced from the engine's top log probabilities:
no flip, the same log probabilities)."""
import json
import os
import subprocess
import sys

import pytest


def test_offload_bench_cpu_smoke(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "tessera_actors.cli", "bench", "offload", "--model", "llama", "--size", "tiny",
           "--gpu-budget", "0.6", "--batch", "1,2", "--prefill", "8", "--steps", "3", "--prefill-steps", "1",
           "--dtype", "float32", "--ring", "bytes,slots", "--probe", "2", "--out", str(out)]
    env = {"TESSERA_GIT_COMMIT": "abc123"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tessera" in done.stdout and "decode_b1" in done.stdout
    doc = json.loads((out / "offload.json").read_text())
    assert doc["git_commit"] == "abc123" and "bench offload" in doc["command"]
    for name in ("decode_b1", "decode_b2", "prefill"):
        row = doc[name]
        for key in ("tessera_tok_s", "tessera_bytes_ring_tok_s", "tessera_slots_ring_tok_s", "layer_offload_tok_s",
                    "streaming_tok_s", "ideal_tok_s"):
            assert row[key] > 0, (name, key)
        assert "expert_offload" not in row["policies"]   # a dense model has no routed experts
        assert row["headline"] == "tessera_bytes_ring"
        for pol in row["policies"].values():
            assert 0 <= pol["gpu_allocated_bytes"] <= row["gpu_budget_bytes"]
            assert pol["plan"].startswith("offload-") and "mem=" in pol["devices"].split(",")[0]
            terms = pol["predicted_terms"]   # the planner's own, for the plan the row ran
            assert abs(terms["gpu_kernels_s"] + terms["cpu_kernels_s"] - terms["kernel_overlap_s"] + terms["handoff_s"]
                       + terms["copy_wait_s"] - pol["predicted_step_s"]) < 1e-9
            assert terms["step_s"] == pytest.approx(pol["predicted_step_s"])
            assert (terms["cpu_kernels_s"] > 0) == (pol["kernels_on_cpu"] > 0)
    assert doc["decode_b1"]["policies"]["tessera_bytes_ring"]["ring"] == "bytes"
    assert doc["decode_b1"]["policies"]["tessera_slots_ring"]["ring"] == "slots"
    for name, pol in doc["decode_b1"]["policies"].items():
        assert pol["tokens_equal_reference"] and pol["first_difference"] is None, name
        # teacher-forced through the engine: the same tokens and (CPU kernels, float32) the same log probabilities
        assert pol["forced_tokens_equal_reference"] and pol["argmax_flips_beyond_ties"] == 0, name
        assert pol["max_top_logprob_error"] < 1e-4 and pol["min_top_logprobs_cosine"] > 0.999999, name
    assert doc["config"]["rings"] == ["bytes", "slots"]
    streaming = doc["decode_b1"]["policies"]["streaming"]
    # the served steps found their first copies queued by the step before; no streamed piece fell back
    st = streaming["gpu_stats"]
    assert st["streamed_copies"] > 0 and st["streamed_copies_ahead_used"] > 0
    assert st["capture_failures"] == 0 and st["last_capture_error"] == ""
    # the engine counted the bytes streamed over "PCIe": each step's streamed weights (a copy queued a step
    # ahead counts in the step before: the mean over the window is the plan's bytes)
    assert streaming["pcie_bytes_per_token"] == pytest.approx(streaming["planned_pcie_bytes_per_token"], rel=0.05)
    assert streaming["pcie_bytes_per_token"] > 0
    assert (out / "offload.png").stat().st_size > 0
    # --probe: each decode row's probed steps beside the planner's prediction in the same terms, and a trace
    for w in ("decode_b1", "decode_b2"):
        tl = streaming if w == "decode_b1" else doc[w]["policies"]["streaming"]
        tl = tl["timeline"]
        assert len(tl["steps"]) == 2 and (out / tl["trace"]).stat().st_size > 0
        m, p = tl["measured"], tl["predicted"]
        assert m["copies"] == p["copies"] > 0 and m["copy_bytes"] == p["copy_bytes"]
        assert all(sum(st["path_s"].values()) == pytest.approx(st["step_s"]) for st in tl["steps"])
        assert tl["compare"]["step_s"][:2] == [p["step_s"], m["step_s"]]
    assert "timeline" not in doc["prefill"]["policies"]["streaming"]


def test_offload_bench_fails_when_no_policy_ran(tmp_path):
    """Batch 8 and a 512-token prompt fit no plan under 0.6 of the tiny
    model's weights: every row fails, and the command says so and exits 1
    (a table of dashes is not a result)."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "tessera_actors.cli", "bench", "offload", "--model", "llama", "--size", "tiny",
           "--gpu-budget", "0.6", "--devices", "cpu?threads=1,cpu", "--dtype", "float32", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "no policy ran any workload" in done.stderr
    doc = json.loads((out / "offload.json").read_text())
    assert all("error" in pol for pol in doc["decode_b8"]["policies"].values())


async def test_a_failed_row_keeps_nothing_of_its_engine():
    """A row whose engine fails is reported by its error's text alone: no
    traceback or chained error keeps the engine's frames (and through them
    a failed step's device memory) alive into the next row."""
    from tessera_actors.bench.offload_engine import RowFailed, serve
    from tessera_actors.serving.config import EngineConfig
    conf = EngineConfig(model="llama", size="tiny", devices="cpu?threads=1,cpu", gpu_budget=1 << 20, max_seqs=1,
                        max_model_len=64, decode_buckets=(1,), prefill_buckets=(8,), kv_windows=(), embeddings=False,
                        planner_options={"policy": "fastest"})
    with pytest.raises(RowFailed, match="unknown offload policy 'fastest'") as info:
        await serve(conf, (1,), 2, 0, 0, "bad")
    err = info.value
    assert err.__cause__ is None and err.__context__ is None
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "_run" not in frames and frames[-1] == "serve", frames


@pytest.mark.gpu
def test_offload_bench_on_a_gpu_with_two_real_size_layers(tmp_path):
    """A subprocess: the budget caps the allocator of the whole process."""
    out = tmp_path / "gpu"
    cmd = [sys.executable, "-m", "tessera_actors.cli", "bench", "offload", "--model", "llama", "--size", "real",
           "--layers", "2", "--gpu-budget", "2GiB", "--batch", "1", "--prefill", "0", "--steps", "8",
           "--devices", "cuda:0,cpu?threads=12", "--probe", "3", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = json.loads((out / "offload.json").read_text())["decode_b1"]
    t = row["policies"]["tessera_bytes_ring"]
    assert "error" not in t, t
    assert t["gpu_peak_bytes"] <= row["gpu_budget_bytes"] and t["gpu_allocated_bytes"] <= row["gpu_budget_bytes"]
    # the cosine is of the top-20 log probabilities about their mean, far stricter than a cosine of whole
    # logits: bf16 rounding alone (these 2 real-size layers in bf16 against fp32, on a CPU) gives 0.9915
    # for it while the whole logits' cosine is 0.99984; the split's CPU kernels round differently from the
    # GPU's (0.9942 on an H200), so 0.99 is the bf16 floor, not a loss of accuracy
    assert t["argmax_flips_beyond_ties"] == 0 and t["min_top_logprobs_cosine"] >= 0.99, t
    assert t["kernels_on_cpu"] > 0 or t["pcie_bytes_per_token"] > 0
    if t["pcie_bytes_per_token"] > 0:   # streamed pieces run as CUDA graphs, first copies queued a step ahead
        st = t["gpu_stats"]
        assert st["replays"] > 0 and st["capture_failures"] == 0, st
        assert st["streamed_copies_ahead_used"] > 0, st
    # the probe on the GPU: copies and pieces between CUDA events, on the host's clock
    m = t["timeline"]["measured"]
    assert m["path_s"]["gpu"] > 0
    assert all(sum(st["path_s"].values()) == pytest.approx(st["step_s"]) for st in t["timeline"]["steps"])
    if t["pcie_bytes_per_token"] > 0:
        assert m["copies"] == t["timeline"]["predicted"]["copies"] and 1e9 < m["copy_bps"] < 1e11, m
        assert m["busy_s"]["copy"] <= m["step_s"] * 1.01
    assert (out / t["timeline"]["trace"]).stat().st_size > 0


@pytest.mark.gpu
def test_every_policy_holds_its_gpu_budget_with_every_bucket_captured(tmp_path):
    """Every bucket of every policy (decode b1 and b8, prompt chunks of 32 and
    512 tokens) runs its GPU pieces as CUDA graph replays within the budget:
    the graphs of one device share one memory pool, which the reserve holds
    (a pool per graph held a 2 MiB segment or more each: hundreds of streamed
    pieces ran out of the budget).  A subprocess: the budget caps the
    allocator of the whole process."""
    out = tmp_path / "gpu"
    reserve = 160 << 20
    cmd = [sys.executable, "-m", "tessera_actors.cli", "bench", "offload", "--model", "llama", "--size", "real",
           "--layers", "2", "--gpu-budget", "2GiB", "--batch", "1,8", "--prefill", "512", "--steps", "8",
           "--reserve", "160MiB", "--no-measure", "--devices", "cuda:0,cpu?threads=12", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "offload.json").read_text())
    for work in ("decode_b1", "decode_b8", "prefill"):
        row = doc[work]
        for name in ("layer_offload", "streaming", "tessera_bytes_ring"):
            pol = row["policies"][name]
            assert "error" not in pol, (work, name, pol)
            st = pol["gpu_stats"]
            assert st["capture_failures"] == 0 and st["replays"] > 0, (work, name, st)
            assert st["capture_pool_bytes"] <= reserve, (work, name, st)
            assert pol["gpu_allocated_bytes"] <= row["gpu_budget_bytes"], (work, name)
            assert pol["gpu_peak_bytes"] <= row["gpu_budget_bytes"], (work, name)
            assert pol["gpu_bytes_before"] <= 64 << 20, (work, name)   # the engine before it let go of its memory


def test_a_replan_rescales_the_cpu_by_its_plans_own_busy_time_within_a_bound():
    """The load-aware re-plan compares the CPU's busy time with the
    planner's prediction for the plan that ran, and moves the CPU's rates
    by at most REPLAN_BOUND either way: an H200 run once read 10,575x off a
    plan scored on another capture's graph and re-planned at 0.0 GB/s."""
    from test_offload_planning import W, A, offload
    from tessera_actors.bench.offload import REPLAN_BOUND, OffloadConfig, replanned
    from tessera_actors.planning.offload import OffloadPlanner
    from tessera_actors.serving.config import EngineConfig
    o = offload(6, 4 * W + 7 * A, [0.1] * 6, [1.0] * 6)
    plan = OffloadPlanner(costs=o.costs, pcie_bps=o.pcie_bps).plan(o.graph, o.devices)
    gpu_s, cpu_s = plan.meta["offload"]["busy_s"]
    assert cpu_s > 0
    conf = EngineConfig(model="llama", size="tiny", devices="cpu?threads=1,cpu", gpu_budget=1 << 20,
                        planner_options={"policy": "tessera", "cpu_bps": 4e10, "cpu_rows_bps": {1: 4e10, 8: 2e10},
                                         "cpu_flops": 1e13})
    cfg = OffloadConfig(batches=(1,))
    step = gpu_s + cpu_s

    def replan(cpu_observed):
        got = {"plans": {"decode:1@0": plan}, "decode_b1": {"busy_fraction": [gpu_s / step, cpu_observed / step],
                                                             "step_s": step}}
        return replanned(cfg, got, "decode_b1", conf)
    assert replan(1.1 * cpu_s) is None                     # within the tolerance: no re-plan
    opts = replan(2 * cpu_s).planner_options              # twice the planned time: half the rates
    assert opts["cpu_bps"] == pytest.approx(2e10) and opts["cpu_rows_bps"] == pytest.approx({1: 2e10, 8: 1e10})
    opts = replan(10575 * cpu_s).planner_options          # far off: bounded
    assert opts["cpu_bps"] == pytest.approx(4e10 / REPLAN_BOUND) and opts["cpu_flops"] == pytest.approx(
        1e13 / REPLAN_BOUND)


def test_offload_bench_of_a_mixture_of_experts_on_cpu(tmp_path):
    """The tiny MoE with its experts in parts: an expert-offload row (every
    routed part on the CPU), the warm-up's expert load in the JSON and fed
    to the planner, and every row's batch-1 tokens the single-device
    reference's (float32 on CPU: bitwise)."""
    out = tmp_path / "moe"
    cmd = [sys.executable, "-m", "tessera_actors.cli", "bench", "offload", "--model", "moe", "--size", "tiny",
           "--gpu-budget", "7MiB", "--batch", "1,2", "--prefill", "8", "--steps", "3", "--prefill-steps", "1",
           "--dtype", "float32", "--no-measure", "--expert-parts", "4", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((out / "offload.json").read_text())
    load = doc["expert_load"]
    assert len(load) == 2 * 2 * 4 and sum(sum(load[f"layers.0.experts.gate_up.{j}"]) for j in range(4)) == \
        pytest.approx(2)   # top-2: every token chose two experts
    for name in ("decode_b1", "decode_b2", "prefill"):
        pols = doc[name]["policies"]
        assert {"layer_offload", "streaming", "expert_offload", "tessera_bytes_ring"} <= set(pols), name
        assert all("error" not in p for p in pols.values()), (name, pols)
        homes = pols["expert_offload"]["homes"]   # both layers' gate_up and down parts (and their heavy biases)
        assert homes["C"] >= 2 * 2 * 4 and homes["S"] == 0 and homes["R"] > 0
    for name, pol in doc["decode_b1"]["policies"].items():
        assert pol["tokens_equal_reference"] and pol["forced_tokens_equal_reference"], name
        assert pol["argmax_flips_beyond_ties"] == 0 and pol["max_top_logprob_error"] < 1e-4, name
