"""The batched sampler draws, for every entry, the token it drew alone, one
entry at a time (the reference below), bitwise on a CPU in float32; and a
decode plan's row state on the device moves its rows on as the engine
would have said."""
import dataclasses

import numpy as np
import pytest
import torch

from tessera_actors import models
from tessera_actors.execution.backends import backend_for
from tessera_actors.execution.hostbuf import Uploads
from tessera_actors.execution.program import AtenProgram, BackendError
from tessera_actors.execution.rows import PlanRows
from tessera_actors.execution.sampling import (
    SampleBatch,
    draw,
    uniform,
    uniforms,
)
from tessera_actors.graph import Access, KernelGraph
from tessera_actors.runtime.messages import SampleRow, StepRows
from tessera_actors.serving.buckets import Bucket, capture_aten
from tessera_actors.serving.gpu_capture import GreedyHead


def _one(x: torch.Tensor, temperature: float, top_p: float, top_k: int, u: float) -> torch.Tensor:
    """One row's draw, the way it was written before rows were batched."""
    probs = torch.softmax(x / temperature, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    if 0 < top_k < sorted_p.numel():
        sorted_p = sorted_p[:top_k]
        order = order[:top_k]
    if top_p < 1.0:
        before = torch.cumsum(sorted_p, 0) - sorted_p
        keep = before < top_p
        keep[0] = True
        sorted_p = sorted_p[keep]
        order = order[keep]
    cdf = torch.cumsum(sorted_p, 0)
    target = torch.tensor([u], dtype=cdf.dtype) * cdf[-1]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.numel() - 1)
    return order[pick[0]]


def test_uniforms_of_arrays_are_the_scalar_ones():
    seeds = [0, 1, 77, (1 << 63) - 1, -5, 123456789123456789]
    index = [0, 3, 10 ** 6, 7, 2, (1 << 40)]
    got = uniforms(np.array([s & ((1 << 64) - 1) for s in seeds], dtype=np.uint64), np.array(index, dtype=np.uint64))
    assert got.tolist() == [uniform(s, i) for s, i in zip(seeds, index)]


def test_each_row_of_a_batch_draws_what_it_draws_alone():
    gen = torch.Generator().manual_seed(3)
    cases = []
    for vocab in (7, 300, 5000):
        x = torch.randn(24, vocab, generator=gen) * 3
        x[3, :] = 0.0                                    # ties everywhere
        x[5, 10 % vocab:] = float("-inf")                # a masked row
        temps = [0.3, 0.7, 1.0, 1.7, 1e-3, 5.0] * 4
        top_ps = [1.0, 0.9, 0.5, 1e-30, 0.999999, 0.2] * 4
        top_ks = [0, 1, 5, vocab, 10 ** 12, 3] * 4
        us = [uniform(11, i + vocab) for i in range(24)]
        cases.append((x, temps, top_ps, top_ks, us))
    for x, temps, top_ps, top_ks, us in cases:
        want = torch.stack([_one(x[i], t, p, k, u) for i, (t, p, k, u) in enumerate(zip(temps, top_ps, top_ks, us))])
        got = draw(x, torch.tensor(temps), torch.tensor(top_ps), torch.tensor([p < 1.0 for p in top_ps]),
                   torch.tensor(top_ks), torch.tensor(us, dtype=torch.float32))
        assert got.tolist() == want.tolist()


def test_a_mixed_batch_samples_like_its_entries_alone_and_moves_its_index_on():
    torch.manual_seed(0)
    logits = torch.randn(6, 2, 400)
    rows = [SampleRow(1, 0, 0.0), SampleRow(4, 1, 0.8, 0.9, 50, seed=9, index=3),
            SampleRow(0, 1, 1.2, 1.0, 0, seed=-4, index=0), SampleRow(2, 0, 0.5, 0.3, 0, seed=1 << 62, index=17)]
    batch = SampleBatch(rows, logits.device)
    ids, lps, top = batch.sample(logits)
    alone = [int(SampleBatch([r], logits.device).sample(logits)[0][0]) for r in rows]
    assert ids.tolist() == alone and top is None
    assert lps.tolist() == [float(torch.log_softmax(logits[r.row, r.col], -1)[t]) for r, t in zip(rows, alone)]
    batch.advance()
    moved = [SampleRow(r.row, r.col, r.temperature, r.top_p, r.top_k, r.seed, r.index + 1) for r in rows]
    assert batch.sample(logits)[0].tolist() == [int(SampleBatch([r], logits.device).sample(logits)[0][0])
                                                for r in moved]


def test_a_greedy_batch_takes_the_graphs_argmax_and_log_sum_exp_with_the_tokens_it_samples_itself():
    torch.manual_seed(3)
    logits = torch.randn(6, 1, 500).to(torch.bfloat16)
    logits[2, 0, 7] = logits[2, 0, 40] = 12.0                    # a tie: the lowest id
    head = GreedyHead()(logits)
    rows = [SampleRow(r, 0, 0.0) for r in (0, 2, 5)]            # not rows 0..n-1: gathered
    ref_ids, ref_lps, _ = SampleBatch(rows, logits.device).sample(logits)
    ids, lps, top = SampleBatch(rows, logits.device).sample(logits, (), head)
    assert ids.tolist() == ref_ids.tolist() and int(ids[1]) == 7 and top is None
    assert torch.allclose(lps, ref_lps, atol=1e-5, rtol=0)
    first = [SampleRow(r, 0, 0.0) for r in range(4)]            # rows 0..n-1: a view
    assert SampleBatch(first, logits.device).sample(logits, (), head)[0].tolist() == head[0][:4, 0].tolist()
    # a record that asks for top log probabilities, or a drawn entry, samples from the logits as before
    topped = SampleBatch(rows, logits.device).sample(logits, [[0, {"top": 2}]], head)
    assert torch.equal(topped[1], ref_lps) and topped[2] is not None
    mixed = rows + [SampleRow(1, 0, 0.7, 1.0, 0, seed=5)]
    assert torch.equal(SampleBatch(mixed, logits.device).sample(logits, (), head)[1],
                       SampleBatch(mixed, logits.device).sample(logits)[1])


@pytest.mark.parametrize("written", [False, True])
def test_a_decode_plans_rows_move_on_on_the_device_and_rows_that_leave_write_the_padding_slot(written):
    """``written``: the graph's kernels write its inputs too (a conservative
    access set): the rows are kept beside them and copied in, same inputs."""
    meta = models.get("llama", "tiny", dtype=torch.float32, device="meta", max_batch=4, max_seq=64)
    graph = capture_aten(meta, Bucket("decode", 4, 0))
    views = graph.meta["input_views"]
    feed = [views["input_ids"][0], views["positions"][0]]
    if written:
        k = graph.kernels[0]
        scribble = tuple(Access(b, 0, graph.buffers[b].nbytes, "rw") for b in feed)
        graph = KernelGraph([dataclasses.replace(k, accesses=k.accesses + scribble), *graph.kernels[1:]],
                            graph.buffers, graph.inputs, graph.outputs, graph.meta)
    prog = AtenProgram(graph, torch.device("cpu"), feed)
    be = backend_for("cpu")
    rows = PlanRows(graph, prog, feed, True, Uploads(torch.device("cpu"), be, be.stream()))
    ids, pos = prog.view(views["input_ids"]), prog.view(views["positions"])
    rows.apply(0, StepRows(-1, [2, 0], [SampleRow(2, position=7, token=11, index=4),
                                       SampleRow(0, position=3, token=12)], 63), None)
    assert pos.tolist() == [3, 63, 7, 63] and ids[:, 0].tolist() == [12, 0, 11, 0]
    rows.apply(1, StepRows(0, pad=63), (0, torch.tensor([21, 22])))      # both go on: fed what step 0 sampled
    assert pos.tolist() == [4, 63, 8, 63] and ids[:, 0].tolist() == [22, 0, 21, 0]
    assert rows.batch.index.tolist() == [5, 1]
    rows.apply(2, StepRows(1, [1, 2], [SampleRow(1, position=9, token=13)], 63), (1, torch.tensor([31, 32])))
    assert pos.tolist() == [63, 9, 9, 63] and ids[:, 0].tolist()[1:3] == [13, 31]   # row 0 left: padding
    assert rows.batch.index.tolist() == [0, 6]
    with pytest.raises(BackendError, match="did not sample"):
        rows.apply(3, StepRows(2, pad=63), (1, torch.tensor([1, 2])))
    assert pos.tolist() == [63, 9, 9, 63]   # a step refused changes nothing
    with pytest.raises(BackendError, match="continue step 5"):
        rows.apply(4, StepRows(5, pad=63), None)
