"""Capture takes a model as it is written: SDPA in eval mode, pytree inputs
and outputs, plain keywords as constants, host reads as guards; what it
cannot record is refused naming the op and the model's source line."""
import random

import pytest
import torch
import torch.nn.functional as F

from tessera_actors.capture import CaptureError, capture, capture_module
from tessera_actors.plan import build_plan, single_device_plan
from tessera_actors.execution.reference import PlanRunner
from tessera_actors.testing import random_assignment


class Attn(torch.nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)
        self.dropout = dropout

    def forward(self, x, mask=None, causal=False, extra=None):
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             dropout_p=self.dropout if self.training else 0.0)
        res = {"out": out, "pair": (out.sum(-1), None)}
        if extra is not None:
            res["extra"] = [extra * 2]
        return res


def _run(res, inputs, plan=None, policy="order"):
    g = res.graph
    return PlanRunner(g, plan or single_device_plan(g, "cpu"), res.values).step(inputs, policy)


def test_sdpa_in_eval_mode_is_recorded_with_its_access_sets(monkeypatch):
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "0")   # replayed with eager's kernels: bit for bit
    torch.manual_seed(0)
    m = Attn().eval().requires_grad_(False)
    x, mask = torch.randn(2, 5, 16), torch.randn(2, 1, 5, 5)
    res = capture_module(m, {"x": x, "mask": mask})
    g = res.graph
    sdpa = [k for k in g.kernels if "scaled_dot_product" in k.name]
    assert len(sdpa) == 1
    k = sdpa[0]
    reads = {a.buffer for a in k.accesses if a.mode == "r"}
    writes = [a for a in k.accesses if "w" in a.mode]
    assert g.inputs["mask"] in reads                  # the mask is read
    assert k.name == "scaled_dot_product_attention"   # recorded whole: each device runs its own kernel
    assert len(writes) == 1                           # the output written, nothing else
    assert all(g.buffers[a.buffer].role in ("temp", "output") for a in writes)
    producers = {a.buffer for kk in g.kernels[:k.id] for a in kk.accesses if "w" in a.mode}
    assert len(reads & producers) >= 1                # q, k, v come from the projection
    assert g.meta["output_names"] == ["out", "pair.0"]
    x2, mask2 = torch.randn(2, 5, 16), torch.randn(2, 1, 5, 5)
    want = m(x2, mask2)
    got = _run(res, {"x": x2, "mask": mask2})
    assert torch.equal(got[0], want["out"]) and torch.equal(got[1], want["pair"][0])
    rng = random.Random(0)
    for _ in range(5):
        plan = build_plan(g, ["cpu", "cpu"], random_assignment(g, 2, rng))
        assert all(torch.equal(a, b) for a, b in zip(_run(res, {"x": x2, "mask": mask2}, plan, rng), got))


def test_dropout_in_training_mode_is_refused_with_the_source_line():
    m = Attn(dropout=0.1).train().requires_grad_(False)
    with pytest.raises(CaptureError, match=r"aten::\w+ draws random numbers.*test_capture_written.py:\d+"):
        capture_module(m, {"x": torch.randn(1, 4, 16)})


def test_plain_keywords_are_constants_of_the_bucket():
    torch.manual_seed(0)
    m = Attn().eval().requires_grad_(False)
    x, e = torch.randn(1, 4, 16), torch.randn(3)
    res = capture_module(m, {"x": x, "mask": None, "causal": True, "extra": e})
    assert res.graph.meta["constants"] == {"mask": None, "causal": True}
    assert res.graph.meta["output_names"] == ["out", "pair.0", "extra.0"]
    want = m(x, causal=True, extra=e)
    assert torch.equal(_run(res, {"x": x, "extra": e})[0], want["out"])
    assert torch.equal(_run(res, {"x": x, "causal": True, "extra": e})[2], want["extra"][0])
    with pytest.raises(ValueError, match="causal=False.*captured with causal=True"):
        _run(res, {"x": x, "causal": False, "extra": e})


def _branchy(x, n):
    if bool(x.sum() > 0):            # bool(tensor)
        x = x * 2
    k = int(n.item())                # .item()
    scale = n.tolist()               # .tolist() reads memory without an aten op
    return x[:, :k] * scale[0]


def test_host_reads_are_guards_checked_at_replay():
    x, n = torch.ones(2, 4), torch.tensor([3])
    res = capture(_branchy, {"x": x, "n": n})
    guards = res.graph.meta["guards"]
    assert [g["value"] for g in guards] == [True, 3, [3]]
    assert all("test_capture_written.py" in g["site"] for g in guards)
    x2 = torch.full((2, 4), 0.5)
    assert torch.equal(_run(res, {"x": x2, "n": n})[0], _branchy(x2, n))      # same branches: replayed
    with pytest.raises(RuntimeError, match=r"guard failed: the host read at .*test_capture_written.py:\d+ .*True"):
        _run(res, {"x": -x2, "n": n})                                          # the other branch
    with pytest.raises(RuntimeError, match=r"guard failed.*returned 3"):
        _run(res, {"x": x2, "n": torch.tensor([2])})


def test_data_dependent_shapes_are_refused_with_the_op_and_line():
    with pytest.raises(CaptureError, match=r"aten::nonzero has a data-dependent output shape \(at .*test_capture_written.py:\d+"):
        capture(lambda x: torch.nonzero(x), {"x": torch.ones(3)})


def test_host_reads_of_other_threads_are_not_part_of_the_capture():
    import threading
    other = torch.arange(4)
    seen = []
    started, release = threading.Event(), threading.Event()

    def reader():
        started.set()
        release.wait(timeout=30)
        seen.append(other.tolist())

    t = threading.Thread(target=reader)
    t.start()
    started.wait(timeout=30)

    def fn(x):
        release.set()
        t.join(timeout=30)          # the other thread reads while this one captures
        return x * 2
    res = capture(fn, {"x": torch.ones(3)})
    assert seen == [[0, 1, 2, 3]] and res.graph.meta["guards"] == []
