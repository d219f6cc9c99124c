"""The proof that captured graphs are complete: any topological order of
their edges, and any interleaving of a split plan's device programs, gives
outputs bitwise equal to program order - for all five architectures."""
import random

import pytest
import torch

from tessera_actors.execution.program import AtenProgram
from tessera_actors import models
from tessera_actors.capture import capture_module
from tessera_actors.graph import KernelGraph
from tessera_actors.plan import build_plan
from tessera_actors.execution.reference import PlanRunner
from tessera_actors.execution.inputs import write_inputs
from tessera_actors.testing import random_assignment, random_topological_order

ARCHS = [("llama", "decode"), ("moe", "decode"), ("mamba2", "decode"), ("vlm", "prefill"), ("dit", "denoise")]
ORDERS = 200


@pytest.fixture(scope="module", params=ARCHS, ids=[a for a, _ in ARCHS])
def captured(request):
    """(capture, inputs, the outputs of a program-order replay): the kernels
    a CPU serves with, its own variants included (execution/variants.py)."""
    name, kind = request.param
    torch.manual_seed(0)
    m = models.get(name, "tiny", dtype=torch.float32, seed=0)
    inp = m.example_inputs(kind, batch=2, seq=4, pos=3)
    res = capture_module(m, inp)
    return res, inp, outputs_in_order(res.graph, res.values, inp, range(len(res.graph.kernels)))


def outputs_in_order(graph, values, inputs, order):
    prog = AtenProgram(graph, torch.device("cpu"), graph.buffers)
    prog.load(values)
    write_inputs(prog, graph, inputs)
    prog.run(order)
    return [prog.view(v).clone() for v in graph.meta["output_views"]]


def run_orders(graph, values, inputs, expected, n, seed):
    prog = AtenProgram(graph, torch.device("cpu"), graph.buffers)
    rng = random.Random(seed)
    mismatches = 0
    for _ in range(n):
        prog.load(values)
        write_inputs(prog, graph, inputs)
        try:
            prog.run(random_topological_order(graph, rng))
        except (IndexError, RuntimeError):  # garbage indices read too early
            mismatches += 1
            continue
        got = [prog.view(v) for v in graph.meta["output_views"]]
        mismatches += not all(torch.equal(g, e) for g, e in zip(got, expected))
    return mismatches


def test_program_order_replay_is_bitwise_equal_to_eager(captured, monkeypatch):
    """With torch's plain kernels bit for bit; with the CPU's variants to rounding."""
    res, inp, served = captured
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "0")
    got = outputs_in_order(res.graph, res.values, inp, range(len(res.graph.kernels)))
    assert all(torch.equal(g, e) for g, e in zip(got, res.outputs))
    assert all(torch.allclose(g, e, rtol=1e-4, atol=1e-5) for g, e in zip(served, res.outputs))


def test_random_topological_orders_are_bitwise_equal(captured):
    res, inp, served = captured
    assert run_orders(res.graph, res.values, inp, served, ORDERS, seed=1) == 0


def test_random_two_device_interleavings_are_bitwise_equal(captured):
    res, inp, served = captured
    rng = random.Random(2)
    for _ in range(10):
        plan = build_plan(res.graph, ["cpu", "cpu"], random_assignment(res.graph, 2, rng))
        runner = PlanRunner(res.graph, plan, res.values)
        for _ in range(3):
            out = runner.step(inp, rng)
            assert all(torch.equal(g, e) for g, e in zip(out, served))
            for p in runner.progs:  # state evolved: restore for the next interleaving
                p.load(res.values)
        assert runner.bytes_moved == 3 * plan.bytes_per_step()


def test_harness_detects_a_missing_edge(captured):
    """Drop the ordering edges (WAR/WAW) of reused buffers: some random order
    must now break, so the soundness tests above can fail."""
    res, inp, served = captured
    g = res.graph
    broken = KernelGraph(g.kernels, g.buffers, g.inputs, g.outputs, g.meta,
                         [e for e in g.edges if e.kind == "RAW"])
    assert run_orders(broken, res.values, inp, served, ORDERS, seed=3) > 0


def test_unmodified_transformers_llama_captures_and_splits_bitwise():
    """A third-party model, unchanged: transformers' LlamaForCausalLM built
    from a config with random weights, default (SDPA) attention, whose mask code
    reads the host: a guard (optional: skipped without transformers)."""
    transformers = pytest.importorskip("transformers")
    from tessera_actors.capture import capture
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 8))

    def forward(input_ids):
        return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits
    res = capture(forward, {"input_ids": ids}, params={**dict(model.named_parameters()), **dict(model.named_buffers())},
                  module=model)
    with torch.no_grad():
        want = forward(ids)
    assert torch.equal(res.outputs[0], want)
    served = outputs_in_order(res.graph, res.values, {"input_ids": ids}, range(len(res.graph.kernels)))
    assert torch.allclose(served[0], want, rtol=1e-4, atol=1e-5)
    assert run_orders(res.graph, res.values, {"input_ids": ids}, served, 50, seed=5) == 0
    rng = random.Random(6)
    for _ in range(3):
        plan = build_plan(res.graph, ["cpu", "cpu"], random_assignment(res.graph, 2, rng))
        assert torch.equal(PlanRunner(res.graph, plan, res.values).step({"input_ids": ids}, rng)[0], served[0])
