"""A mixture of experts' routed experts in parts (``MoEConfig.expert_parts``)
and the router's statistics of a warm-up batch (ATSInfer's expert load) in
the offload planner: the parts compute what the one stacked tensor does, the
warm-up counts what the router chose, and a skewed load changes which parts
the planner keeps resident on the budgeted device."""
import pytest
import torch

from tessera_actors import models
from tessera_actors.capture import capture_module
from tessera_actors.models.moe_load import router_load
from tessera_actors.planning.offload import Offload, choose_homes, estimate_rates, expert_offload, homes_of
from tessera_actors.planning.offload.load import read_fraction, step_tokens
from tessera_actors.serving.deploy import drop_state

PARTS = 4


def _split_copy(whole, parted):
    """``parted``'s weights set to ``whole``'s (each part the slice of its experts)."""
    src = dict(whole.named_parameters())
    with torch.no_grad():
        for name, p in parted.named_parameters():
            if name in src:
                p.copy_(src[name])
            else:
                base, j = name.rsplit(".", 1)
                n = p.shape[0]
                p.copy_(src[base][int(j) * n:(int(j) + 1) * n])


@pytest.mark.parametrize("dispatch", ["grouped", "gather", "dense"])
def test_experts_in_parts_compute_the_stacked_experts_logits(dispatch):
    whole = models.get("moe", "tiny", dtype=torch.float32, seed=0, dispatch=dispatch)
    parted = models.get("moe", "tiny", dtype=torch.float32, seed=0, dispatch=dispatch, expert_parts=PARTS)
    assert "layers.0.experts.gate_up.3" in dict(parted.named_parameters())
    _split_copy(whole, parted)
    ins = whole.example_inputs("prefill", batch=2, seq=8)
    torch.testing.assert_close(parted(**ins), whole(**ins), rtol=1e-6, atol=1e-6)


def test_expert_parts_must_divide_the_experts():
    with pytest.raises(ValueError, match="expert_parts"):
        models.config("moe", "tiny", expert_parts=3)


def test_the_warm_up_counts_the_routers_choices_and_leaves_the_model_as_it_was():
    m = models.get("moe", "tiny", dtype=torch.float32, seed=0, expert_parts=PARTS)
    drop_state(m)   # as a served host model: no KV cache
    with torch.no_grad():   # layer 1's router sends every token to expert 5 (part 2, its second expert)
        m.layers[1].experts.router.bias[5] = 1e4
    ids = torch.arange(64).view(2, 32)
    load = router_load(m, ids)
    assert set(load) == {f"layers.{i}.experts.{w}.{j}" for i in range(2) for w in ("gate_up", "down")
                         for j in range(PARTS)}
    for i in range(2):
        total = sum(sum(load[f"layers.{i}.experts.gate_up.{j}"]) for j in range(PARTS))
        assert total == pytest.approx(m.cfg.top_k)   # every token chose top_k experts
    assert load["layers.1.experts.gate_up.2"][1] == 1.0 and load["layers.1.experts.down.2"][1] == 1.0
    assert all(m.get_submodule(n.rpartition(".")[0]).k_cache.numel() == 0 for n in m.state_names())


def _graph():
    m = models.get("moe", "tiny", dtype=torch.float32, seed=0, expert_parts=PARTS, max_batch=1, max_seq=64)
    return capture_module(m, m.example_inputs("decode", batch=1)).graph


def _skewed(hot: int) -> dict[str, list[float]]:
    """Part ``hot`` of every layer takes almost all of the tokens (top 2 of 8 experts: shares sum to 2)."""
    per = 8 // PARTS
    return {f"layers.{i}.experts.{w}.{j}": [0.9 if j == hot else 0.2 / (per * (PARTS - 1))] * per
            for i in range(2) for w in ("gate_up", "down") for j in range(PARTS)}


def _homes(graph, load, budget):
    devs = [f"cpu?threads=1&mem={budget}", "cpu?threads=1"]
    costs = estimate_rates(graph, devs, switch_s=1e-6, cpu_bps=5e8, expert_load=load)
    o = Offload(graph, devs, costs, pcie_bps=1e8)
    p, _ = choose_homes(o)
    return homes_of(o, p), o, p


def test_a_skewed_warm_up_changes_which_experts_stay_resident():
    g = _graph()
    experts = sum(b.nbytes for b in g.buffers.values() if b.role == "weight" and ".experts.gate_up." in b.name
                  or ".experts.down." in b.name)
    _, o, _ = _homes(g, {}, 1 << 40)
    everything = o.gpu_bytes(o.placement({u: "R" for u in o.units}, 0))
    budget = everything - experts * 2 // 3   # room for about a third of the routed experts
    for hot in (0, 3):
        homes, o, p = _homes(g, _skewed(hot), budget)
        assert o.gpu_bytes(p) <= budget
        for i in range(2):
            for w in ("gate_up", "down"):
                assert homes[f"layers.{i}.experts.{w}.{hot}"] == "R", (hot, i, w, homes)
                assert [homes[f"layers.{i}.experts.{w}.{j}"] for j in range(PARTS)].count("R") < PARTS
    # expert offload is the same whatever the load: every routed part on the CPU
    homes = homes_of(o, expert_offload(o)[0])
    assert {h for n, h in homes.items() if ".experts.gate_up." in n or ".experts.down." in n} == {"C"}


def test_a_step_reads_the_share_of_a_part_its_tokens_route_to():
    g = _graph()
    assert step_tokens(g) == 1
    assert read_fraction([0.5, 0.0], 1) == pytest.approx(0.25)
    assert read_fraction([0.5, 0.0], 3) == pytest.approx((1 - 0.5 ** 3) / 2)
    devs = ["cpu?threads=1&mem=1000000000", "cpu?threads=1"]
    plain = estimate_rates(g, devs, cpu_bps=5e8)
    cold = estimate_rates(g, devs, cpu_bps=5e8, expert_load=_skewed(0))
    reader = {g.buffers[a.buffer].name: k.id for k in g.kernels for a in k.accesses
              if g.buffers[a.buffer].role == "weight"}
    hot_k, cold_k = reader["layers.0.experts.gate_up.0"], reader["layers.0.experts.gate_up.3"]
    assert cold.times[hot_k][1] == pytest.approx(plain.times[hot_k][1] * 0.9, rel=0.05)
    assert cold.times[cold_k][1] < plain.times[cold_k][1] / 10
    attn = reader["layers.0.attn.wq.weight"]
    assert cold.times[attn] == plain.times[attn]
