"""A ``cuda:0,cpu`` deployment with kernels on both devices gives the GPU-only
run's greedy tokens, teacher-forced (issue #26's acceptance, at the tiny
size; the real-size run is ``tessera bench offload``): the GPU-only engine
serves its inductor captures, the split one the offload planner's plan with
weights resident, streamed and computed on the CPU (run on the device
machine: pytest -m gpu)."""
import pytest
import torch

from tessera_actors import AsyncEngine, models
from tessera_actors.bench.offload_engine import compare, forced, scored
from tessera_actors.capture import capture_module
from tessera_actors.runtime.messages import GetStats

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CFG = dict(model="llama", size="tiny", max_seqs=4, max_model_len=64, decode_buckets=(1, 4), prefill_buckets=(8, 16),
           kv_windows=(), mode="latency", embeddings=False)
OPTIONS = dict(pcie_bps=1e8, cpu_bps=1e8, switch_s=1e-5)   # rates under which the tiny model uses all three homes
PROMPT = [3, 14, 15, 92, 65]


def _budget(dtype: torch.dtype) -> int:
    """The KV cache, activations and half the weights."""
    m = models.get("llama", "tiny", dtype=dtype, seed=0, max_batch=4, max_seq=64)
    g = capture_module(m, m.example_inputs("decode", batch=4)).graph
    w = sum(b.nbytes for b in g.buffers.values() if b.role == "weight")
    return sum(b.nbytes for b in g.buffers.values() if b.role != "weight") + w // 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_a_gpu_and_cpu_split_gives_the_gpu_only_tokens_teacher_forced(dtype):
    async with AsyncEngine(devices="cuda:0", dtype=dtype, **CFG) as gpu:
        ref, ref_tops = await scored(gpu, PROMPT, 24)
        kinds = {s["capture"] for s in gpu.stats()["bucket_stats"].values()}
    assert kinds == {"inductor"}
    devices = f"cuda:0?mem={_budget(getattr(torch, dtype))},cpu"
    async with AsyncEngine(devices=devices, dtype=dtype, planner="offload", planner_options=OPTIONS, **CFG) as split:
        await split.wait_placed()
        toks, tops = await forced(split, PROMPT, ref)
        placed = dict(split.deployment.placed)
        st = (await split.deployment.system.ref("device0").ask(GetStats())).values
    choices = set(placed["decode:1@0"].plan.meta["offload"]["choices"])
    assert {"R", "C"} <= choices, choices          # kernels on the GPU and on the CPU
    if "S" in choices:   # a GPU that streams weights reads the CPU's hand-offs with its SMs
        assert st["mapped_reads"] > 0, st
    got = compare(toks, tops, ref, ref_tops)
    assert got["argmax_flips_beyond_ties"] == 0, got
    assert got["min_top_logprobs_cosine"] >= (0.999 if dtype == "float32" else 0.99), got
    if dtype == "float32":
        assert toks == ref
