"""A CPU runs a linear layer's node as oneDNN's kernel (execution/variants.py):
the same outputs as torch's plain kernel (to rounding), new weights seen at
once, a budgeted device running the same kernels as an unbudgeted one, the
plain op where the switch is off."""
import pytest
import torch

from tessera_actors.capture.aten import capture_module
from tessera_actors.execution import variants
from tessera_actors.execution.program import AtenProgram
from tessera_actors.execution.reference import PlanRunner
from tessera_actors.plan import single_device_plan

pytestmark = pytest.mark.skipif(not variants.enabled(), reason="torch without oneDNN")


class Mlp(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.up = torch.nn.Linear(48, 96, bias=False, dtype=dtype)
        self.down = torch.nn.Linear(96, 40, bias=True, dtype=dtype)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


def _run(model, x):
    res = capture_module(model, {"x": x})
    runner = PlanRunner(res.graph, single_device_plan(res.graph, "cpu"), res.values)
    return res, runner, runner.step({"x": x})[0]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_linear_layer_runs_the_cpu_variant_with_torchs_outputs(dtype, tol):
    torch.manual_seed(0)
    model, x = Mlp(dtype).eval(), torch.randn(5, 48, dtype=dtype)
    _, runner, got = _run(model, x)
    assert runner.progs[0].variants == 2          # both matrices, the one with a bias too
    with torch.no_grad():
        want = model(x)
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def test_new_weights_loaded_into_the_program_are_used_by_the_next_run():
    torch.manual_seed(0)
    model, x = Mlp(torch.float32).eval(), torch.randn(3, 48)
    res, runner, before = _run(model, x)
    with torch.no_grad():
        model.up.weight.mul_(-2.0)
        want = model(x)
    fresh = capture_module(model, {"x": x}).values
    weights = {b: v for b, v in fresh.items() if res.graph.buffers[b].role == "weight"}
    runner.progs[0].load(weights)
    after = runner.step({"x": x})[0]
    assert not torch.allclose(after, before)
    assert torch.allclose(after, want, rtol=1e-5, atol=1e-5)


def test_switched_off_the_plain_ops_run_bitwise_as_eager(monkeypatch):
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "0")
    torch.manual_seed(0)
    model, x = Mlp(torch.float32).eval(), torch.randn(4, 48)
    _, runner, got = _run(model, x)
    with torch.no_grad():
        want = model(x)
    assert runner.progs[0].variants == 0 and torch.equal(got, want)


def test_a_budgeted_device_runs_the_variant_too_with_no_bytes_beyond_its_buffers():
    torch.manual_seed(0)
    model, x = Mlp(torch.float32).eval(), torch.randn(6, 48)
    res, runner, want = _run(model, x)
    plan = single_device_plan(res.graph, "cpu")
    need = sum(res.graph.buffers[b].nbytes for b in plan.resident[0])
    budgeted = AtenProgram(res.graph, torch.device("cpu"), plan.resident[0], memory_limit=need)
    budgeted.load(res.values)
    other = PlanRunner(res.graph, plan, res.values)
    other.progs = [budgeted]
    assert torch.equal(other.step({"x": x})[0], want) and budgeted.variants == 2
