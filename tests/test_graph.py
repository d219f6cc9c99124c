"""Graph edges, plans and serialisation on hand-made kernel programs."""
import pytest

from tessera_actors.graph import Access, Buffer, GraphError, Kernel, KernelGraph
from tessera_actors.plan import ContiguousPlanner, PlanError, build_plan, program_blocks


def k(i, *acc, name=None):
    return Kernel(i, name or f"k{i}", "library", tuple(Access(*a) for a in acc))


def reuse_graph():
    """x -> k0 writes T[0:64]; k1 reads T writes Y; k2 re-uses T (WAR on k1,
    WAW on k0); k3 reads T (RAW from k2) and half of Y."""
    bufs = {0: Buffer(0, 64, "input"), 1: Buffer(1, 64, "temp"), 2: Buffer(2, 64, "output")}
    ks = [k(0, (0, 0, 64, "r"), (1, 0, 64, "w")),
          k(1, (1, 0, 64, "r"), (2, 0, 64, "w")),
          k(2, (0, 0, 64, "r"), (1, 0, 64, "w")),
          k(3, (1, 0, 64, "r"), (2, 0, 32, "rw"))]
    return KernelGraph(ks, bufs, inputs={"x": 0}, outputs=[2])


def edge_set(g):
    return {(e.src, e.dst, e.kind, e.buffer, e.ranges) for e in g.edges}


def test_buffer_reuse_gives_war_and_waw_edges():
    assert edge_set(reuse_graph()) == {
        (0, 1, "RAW", 1, ((0, 64),)),
        (1, 2, "WAR", 1, ()),
        (0, 2, "WAW", 1, ()),
        (2, 3, "RAW", 1, ((0, 64),)),
        (1, 3, "RAW", 2, ((0, 32),)),
        (1, 3, "WAW", 2, ()),
    }


def test_partial_overlap_ranges_are_exact():
    bufs = {0: Buffer(0, 100, "temp")}
    ks = [k(0, (0, 0, 60, "w")), k(1, (0, 40, 100, "w")), k(2, (0, 0, 100, "r"))]
    g = KernelGraph(ks, bufs)
    raw = {(e.src, e.dst): e.ranges for e in g.edges if e.kind == "RAW"}
    assert raw == {(0, 2): ((0, 40),), (1, 2): ((40, 100),)}


def test_access_outside_buffer_is_an_error():
    g = KernelGraph([k(0, (0, 0, 65, "w"))], {0: Buffer(0, 64)})
    with pytest.raises(GraphError, match="65"):
        g.edges


def test_save_load_round_trip(tmp_path):
    g = reuse_graph()
    g.meta["model"] = "hand"
    g.save(tmp_path / "g.tgraph")
    h = KernelGraph.load(tmp_path / "g.tgraph")
    assert h.kernels == g.kernels and h.buffers == g.buffers and edge_set(h) == edge_set(g)
    assert h.meta == {"model": "hand"} and h.inputs == {"x": 0} and h.outputs == [2]


def test_not_a_graph_file(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x00\x01garbage")
    with pytest.raises(GraphError):
        KernelGraph.load(tmp_path / "bad")


def test_split_plan_transfers_exact_bytes():
    g = reuse_graph()
    p = build_plan(g, ["cpu", "cpu?threads=1"], [0, 1, 0, 1])
    # k1 needs T from k0 (64 B); k3 needs T from k2 (64 B); output half from k3, half from k1
    assert sorted((t.src, t.dst, t.buffer, t.ranges) for t in p.transfers) == [
        (0, 1, 1, ((0, 64),)), (0, 1, 1, ((0, 64),))]
    assert p.bytes_per_step() == 128
    assert [s.op for s in p.programs[0]] == ["run", "send", "run", "send"]
    assert [s.op for s in p.programs[1]] == ["recv", "run", "recv", "run"]
    assert p.outputs == [(2, 0, 32, 1), (2, 32, 64, 1)]


def test_program_blocks_stop_at_a_receive_and_at_a_run_after_a_send():
    p = build_plan(reuse_graph(), ["cpu", "cpu?threads=1"], [0, 1, 0, 1])
    send0, send1 = (s.ref for s in p.programs[0] if s.op == "send")
    # device 0: run k0, send; run k2, send - each run with the send after it, one block each
    assert program_blocks(p, 0) == {0: (2, [0], [send0]), 1: (2, [], [send0]), 2: (4, [2], [send1]),
                                    3: (4, [], [send1])}
    # device 1: every run ends at the next receive; receives have no block
    assert program_blocks(p, 1) == {1: (2, [1], []), 3: (4, [3], [])}


def test_state_groups_stay_together():
    bufs = {0: Buffer(0, 8, "state"), 1: Buffer(1, 8, "temp")}
    g = KernelGraph([k(0, (0, 0, 8, "rw")), k(1, (1, 0, 8, "w")), k(2, (0, 0, 8, "r"))], bufs)
    with pytest.raises(PlanError, match="state"):
        build_plan(g, ["cpu", "cpu"], [0, 1, 1])
    p = ContiguousPlanner().plan(g, ["cpu", "cpu"])
    assert p.assignment in ([0, 0, 0], [1, 1, 1]) or p.assignment[0] == p.assignment[2]


def test_capture_marks_a_gappy_out_view_read_write():
    """Writing through a strided view leaves the bytes between its elements
    alone: the access must not claim the whole span as freshly written."""
    import torch
    from tessera_actors.capture import capture
    x = torch.arange(8.0)

    def f(x):
        buf = torch.zeros(4, 4)
        torch.mul(x[:4], 2, out=buf[:, 0])   # a column: 4 elements spread over 13
        return buf
    g = capture(f, {"x": x}).graph
    mul = next(k for k in g.kernels if k.name.startswith("mul"))
    writes = [a for a in mul.accesses if a.writes]
    assert writes and all(a.mode == "rw" for a in writes)


def test_capture_with_profile_writes_a_cost_table_that_plan_reads(tmp_path, capsys):
    """``tessera capture --profile``: kernels and links timed on the devices,
    the cost table saved next to the graph, and ``tessera plan`` uses it."""
    import json
    from tessera_actors.cli import main
    out = tmp_path / "g.tgraph"
    assert main(["capture", "--model", "llama", "--bucket", "decode:2", "--out", str(out),
                 "--profile", "cpu,cpu?threads=1"]) == 0
    costs = json.loads((tmp_path / "g.costs.json").read_text())
    g = KernelGraph.load(out)
    assert costs["devices"] == ["cpu", "cpu?threads=1"] and costs["source"] == "profile"
    assert len(costs["times"]) == len(g.kernels) and all(t[0] > 0 and t[1] > 0 for t in costs["times"])
    assert costs["bandwidth"][0][1] > 1e6 and costs["latency"][1][0] >= 0
    capsys.readouterr()
    assert main(["plan", str(out), "--devices", "cpu,cpu?threads=1"]) == 0
    assert "costs: profile" in capsys.readouterr().out
