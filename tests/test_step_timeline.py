"""The step timeline: the summary of a step's intervals by resource
(synthetic records: what each number means), the planner's step model in
the same terms, and the probe on a served CPU deployment (a budgeted CPU
standing in for the GPU beside ``cpu``): what it records, in which order the
step path issues its copies, and nothing recorded when it is off."""
import pytest
import torch

from test_offload_serving import CFG, OPTIONS, budget
from tessera_actors import AsyncEngine, SamplingParams, models
from tessera_actors.capture import capture_module
from tessera_actors.planning.offload import OffloadPlanner, estimate_rates
from tessera_actors.planning.offload.timeline import compare, median_summary, summarize, summarize_step, union

GPU, CPU = 0, 1


def rec(dev, what, start, end, step=0, **args):
    return [dev, what, f"{what} {start}", step, start, end, args]


def test_union_and_busy_time_count_overlaps_once():
    assert union([(0, 2), (1, 3), (5, 6), (6, 7), (8, 8)]) == [(0, 3), (5, 7)]
    recs = [rec(GPU, "step", 0, 10), rec(CPU, "kernels", 1, 4), rec(CPU, "kernels", 3, 5),
            rec(GPU, "copy", 0, 6, copy=0, bytes=600, issued=0.0, freed=None)]
    s = summarize_step(recs, GPU, 0, 10)
    assert s["busy_s"]["cpu"] == 4 and s["busy_s"]["copy"] == 6
    assert s["copy_overlap_s"]["cpu"] == 4 and s["copy_overlap_s"]["gpu"] == 0
    assert s["copy_bps"] == 100


def test_copy_engine_gaps_are_named_by_what_held_the_next_copy_back():
    """A copy waits for the read that frees its bytes (ring full), then for
    the host to queue it (issued late: only from the read on, the time a
    copy queued earlier would have run); before the first copy and after
    the last the engine idles at the step's start and with no copy left."""
    recs = [rec(GPU, "step", 0, 20),
            rec(GPU, "copy", 1, 3, copy=0, bytes=1, issued=0.5, freed=None),
            rec(GPU, "copy", 5, 7, copy=1, bytes=1, issued=2.0, freed=5.0),     # freed at 5: 2 s ring full
            rec(GPU, "copy", 10, 12, copy=2, bytes=1, issued=10.0, freed=8.0),  # 1 s ring full, 2 s issued late
            rec(GPU, "copy", 13, 14, copy=3, bytes=1, issued=11.0, freed=11.0)]  # 1 s nobody explains
    gaps = summarize_step(recs, GPU, 0, 20)["copy_idle_s"]
    assert gaps == {"step_start": 1, "ring_full": 3, "issued_late": 2, "other": 1, "no_copy_left": 6}
    s = summarize_step(recs, GPU, 0, 20)
    assert s["issued_after_freed"] == 1 and s["issue_lag_s"] == 2   # copy 2: freed at 8, issued at 10


def test_the_critical_path_adds_up_to_the_step_and_names_copy_waits_and_hand_offs():
    """GPU 0-1, the hand-off to the CPU (its bytes leave 1-1.5, it waits to
    2), CPU 2-5, the GPU's worker has the bytes back at 5.5, its piece
    waited for copy 0 (ended at 7) and started at 8 after 1 s of host work,
    ran to 9, host tail to 10: every second of the step is named once."""
    recs = [rec(GPU, "step", 0, 10), rec(GPU, "kernels", 0, 1), rec(CPU, "kernels", 2, 5),
            rec(GPU, "copy", 0, 7, copy=0, bytes=1, issued=0.0, freed=None), rec(GPU, "send", 1, 1.5),
            rec(CPU, "wait", 0, 2, tag=0, src=GPU), rec(GPU, "kernels", 8, 9, waits=[0]),
            rec(GPU, "wait", 1.5, 5.5, tag=1, src=CPU)]
    path = summarize_step(recs, GPU, 0, 10)["path_s"]
    assert path == {"cpu": 3, "gpu": 2, "copy_wait": 1.5, "handoff": 1.5, "other": 2}
    assert sum(path.values()) == 10


def test_steps_are_cut_by_their_step_records_and_compared_term_by_term():
    recs = [rec(GPU, "step", 0, 4, step=1), rec(CPU, "kernels", 1, 3, step=1),
            rec(GPU, "step", 5, 8, step=2), rec(CPU, "kernels", 5, 8, step=2)]
    steps = summarize(recs, GPU)
    assert [s["step"] for s in steps] == [1, 2] and [s["step_s"] for s in steps] == [4, 3]
    med = median_summary(steps)
    assert med["busy_s"]["cpu"] == 3 and "step" not in med
    cmp = compare({"step_s": 2.0, "busy_s": {"cpu": 3.0}}, med)
    assert cmp["step_s"] == [2.0, 4, 1.0] and cmp["busy_s.cpu"] == [3.0, 3, 0.0]


def test_the_step_models_timeline_has_the_terms_of_its_prediction():
    """The planner's summary of its own step (``meta[offload].timeline``)
    cuts the predicted step into the terms it predicts: kernels of each
    device, copy waits, hand-offs; the copy engine busy for the streamed bytes."""
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0, max_seq=64)
    g = capture_module(m, m.example_inputs("decode", batch=1)).graph
    w = sum(b.nbytes for b in g.buffers.values() if b.role == "weight")
    rest = sum(b.nbytes for b in g.buffers.values() if b.role != "weight")
    devices = [f"cpu?threads=1&mem={rest + w // 3}", "cpu"]
    plan = OffloadPlanner(costs=estimate_rates(g, devices, switch_s=1e-5), pcie_bps=3e8).plan(g, devices)
    off = plan.meta["offload"]
    terms, tl = off["terms"], off["timeline"]
    assert set(off["choices"]) == {"R", "S", "C"}
    assert tl["step_s"] == pytest.approx(terms["step_s"])
    assert tl["busy_s"]["gpu"] == pytest.approx(terms["gpu_kernels_s"])
    assert tl["path_s"]["cpu"] == pytest.approx(terms["cpu_kernels_s"])
    assert tl["path_s"]["gpu"] == pytest.approx(terms["gpu_kernels_s"] - terms["kernel_overlap_s"])
    assert tl["path_s"]["copy_wait"] == pytest.approx(terms["copy_wait_s"], abs=1e-12)
    assert tl["path_s"]["handoff"] + tl["path_s"]["other"] == pytest.approx(terms["handoff_s"])
    assert tl["busy_s"]["copy"] == pytest.approx(terms["copy_engine_s"])
    assert tl["copies"] == len(off["streamed"]) and tl["copy_bytes"] == terms["pcie_bytes"]


def test_the_step_model_overlaps_the_cpu_with_a_streamed_piece_when_bytes_leave_early():
    """A plan sends the CPU its bytes right after the kernel that made them
    (``breaks``) when a streamed piece would otherwise run first; the model
    has the CPU compute meanwhile: a shorter step than the same placement
    sending after the piece, the overlap among its terms."""
    import dataclasses
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0, max_seq=64)
    g = capture_module(m, m.example_inputs("decode", batch=1)).graph
    from tessera_actors.planning.offload import Offload
    devices = [f"cpu?threads=1&mem={budget()}", "cpu"]
    o = Offload(g, devices, estimate_rates(g, devices, switch_s=1e-5, cpu_bps=1e8), pcie_bps=1e8)
    plan = OffloadPlanner(costs=o.costs, pcie_bps=1e8).plan(g, devices)
    off = plan.meta["offload"]
    assert off["breaks"] and all(plan.assignment[b] == plan.assignment[b - 1] for b in off["breaks"])
    # a segment starts at every break: the send after the kernel before it
    starts = {s.kernels[0] for s in plan.segments}
    assert set(off["breaks"]) <= starts
    choice = {u: c for u, c in zip(sorted(o.units), off["choices"])}
    early = o.placement(choice, off["slots"], off["slot_bytes"])
    assert early.breaks == off["breaks"]
    late = dataclasses.replace(early, breaks=[])
    fast, slow = o.simulate(early), o.simulate(late)
    assert fast.step_s < slow.step_s and fast.overlap_s > 0 and slow.overlap_s == pytest.approx(0, abs=1e-12)
    t = fast.terms(o.gpu)
    assert t["gpu_kernels_s"] + t["cpu_kernels_s"] - t["kernel_overlap_s"] + t["handoff_s"] + t["copy_wait_s"] \
        == pytest.approx(t["step_s"])


async def _decode(eng, n):
    async for _ in eng.generate([1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True)):
        pass


async def test_a_probed_served_step_records_its_resources_and_copies_go_out_when_their_bytes_free():
    """Served on a cpu,cpu deployment (every device runs work as it is
    queued, so host order is the order of operations): the probe sees each
    device's kernels, each copy, each hand-off; a copy into ring bytes goes
    out right after the read that freed them (no run of kernels between),
    not after the next hand-off; a piece starts after the copies it reads.
    Unprobed steps record nothing."""
    devices = f"cpu?threads=1&mem={budget()},cpu"
    async with AsyncEngine(devices=devices, planner="offload", planner_options=OPTIONS,
                           **dict(CFG, decode_buckets=(1,))) as eng:
        await eng.wait_placed()
        await _decode(eng, 4)
        assert eng.deployment.timeline is None
        records = eng.deployment.probe_steps(3)
        await _decode(eng, 6)
        off = eng.deployment.placed["decode:1@0"].plan.meta["offload"]
        probed = len(records)
        await _decode(eng, 4)
    assert eng.deployment.probe_left == 0 and len(records) == probed   # unprobed steps answer no records
    kinds = {(r[0], r[1]) for r in records}
    assert {(GPU, "kernels"), (CPU, "kernels"), (GPU, "copy"), (GPU, "wait"), (CPU, "wait"), (GPU, "step")} <= kinds
    steps = sorted({r[3] for r in records if r[1] == "step"})
    assert len(steps) == 3
    runs = sorted((r for r in records if r[1] == "kernels" and r[0] == GPU), key=lambda r: r[4])
    copies = [r for r in records if r[1] == "copy"]
    ended = {(c[3], c[6]["copy"]): c[5] for c in copies}
    for c in copies:
        freed = c[6]["freed"]
        if freed is None or c[3] not in steps:
            continue
        assert c[6]["issued"] >= freed
        assert not [k for k in runs if freed <= k[4] < c[4]], c   # issued before any further kernel ran
    for k in runs:
        for i in k[6]["waits"]:
            assert k[4] >= ended[(k[3], i)]
    # the bytes the CPU needs leave the budgeted device before it runs a streamed piece that precedes
    # their reader in program order (the plan's breaks): the CPU computes while that piece waits for its copy
    assert off["breaks"]
    mine = sorted((r for r in records if r[0] == GPU and r[3] == steps[1] and r[1] in ("kernels", "send")),
                  key=lambda r: r[4])
    for b in off["breaks"]:
        i = next(j for j, r in enumerate(mine) if r[1] == "kernels" and r[2].startswith(f"k{b}-"))
        assert mine[i - 1][1] == "send", mine[i - 1]
    summary = summarize(records, GPU)
    first = summary[1]   # the middle step: its first copies were queued by the step before
    assert first["copies"] == len(off["streamed"]) and first["copy_bytes"] > 0
    assert sum(first["path_s"].values()) == pytest.approx(first["step_s"])
    assert first["busy_s"]["cpu"] > 0 and first["busy_s"]["gpu"] > 0 and first["handoffs"] > 0
