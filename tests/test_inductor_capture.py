"""CUDA capture (inductor): the pure parts on CPU, capture + replay on the GPU.

CPU: matching Python launch arguments to PTX parameters, merging the PTX
analysis with inductor's metadata (never losing a write), a recorded launch
sequence (fake inductor tuner around real Triton PTX) assembled into a graph
that survives save/load, buckets, and ``tessera capture`` on the aten path.
GPU (``gpu`` marker): a tiny Llama captured through inductor replays bitwise
in program order and in random topological orders via ``TritonProgram``.
"""
import argparse
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tessera_actors.capture import inductor_hooks as hooks
from tessera_actors.capture.inductor import _InductorRecorder
from tessera_actors.capture.inductor_graph import assemble
from tessera_actors.capture.inductor_buckets import bucket_name, parse_bucket
from tessera_actors.capture.inductor_match import (analyze_ptx, launch_access, merge_access, ptx_text,
                                                   triton_source)
from tessera_actors.graph import KernelGraph

DATA = Path(__file__).parent / "data" / "ptx"
ADD_PTX = (DATA / "handwritten" / "triton_style_add.ptx").read_text()
ADD = "triton_poi_fused_add_mul_0"
ARGS = [("in_ptr0", "tensor"), ("in_ptr1", "tensor"), ("out_ptr0", "tensor"), ("xnumel", "scalar")]


# -- matching and merging -------------------------------------------------
def test_tensor_args_match_ptx_pointers_by_position_and_hidden_params_are_reported():
    acc = launch_access(ARGS, analyze_ptx(ADD_PTX, ADD), set(), {0: True, 1: True, 2: True})
    assert acc.modes == {0: "r", 1: "r", 2: "w"}
    assert not acc.indirect and not acc.pinned_reason and not acc.disagreements
    assert len(acc.hidden_params) == 2  # Triton's global/profile scratch pointers


def test_a_write_not_known_to_cover_its_range_is_read_write():
    acc = launch_access(ARGS, analyze_ptx(ADD_PTX, ADD), set(), {2: False})
    assert acc.modes[2] == "rw"


def test_inductor_metadata_adds_writes_the_ptx_does_not_show():
    names = [("in_ptr0", "tensor"), ("in_out_ptr0", "tensor"), ("out_ptr0", "tensor"), ("xnumel", "scalar")]
    acc = launch_access(names, analyze_ptx(ADD_PTX, ADD), set(), {0: True, 1: True, 2: True})
    assert acc.modes[1] == "rw"
    assert acc.disagreements and "in_out_ptr0" in acc.disagreements[0]
    mode, note = merge_access("read", "in_ptr3", {"in_ptr3"}, True)  # mutated_arg_names
    assert mode == "rw" and note


def test_ptx_writes_win_over_inductor_read_only_names():
    mode, note = merge_access("write", "in_ptr0", set(), True)
    assert mode == "rw" and note  # union of writes; never a pure overwrite without inductor's out_ptr
    assert merge_access("none", None, set(), True) == (None, "")
    assert merge_access("write", "out_ptr1", set(), False)[0] == "rw"
    assert merge_access("write", "out_ptr1", {"out_ptr1"}, True)[0] == "rw"


def test_unanalysable_or_unmatched_kernels_are_pinned_read_write():
    bad = launch_access(ARGS, analyze_ptx("this is not ptx", ADD), set(), {})
    assert bad.indirect and bad.pinned_reason and set(bad.modes.values()) == {"rw"}
    missing = launch_access(ARGS, analyze_ptx(None, ADD), set(), {})
    assert missing.indirect and "no PTX" in missing.pinned_reason
    many = [(f"in_ptr{i}", "tensor") for i in range(6)]
    unmatched = launch_access(many, analyze_ptx(ADD_PTX, ADD), set(), {})
    assert unmatched.indirect and "cannot match" in unmatched.pinned_reason


def test_indirect_ptx_pins_the_kernel():
    a = analyze_ptx((DATA / "cuda" / "indirect.ptx").read_text(), "scatter_ptrs")
    assert a.indirect and not a.error
    acc = launch_access([("in_ptr0", "tensor"), ("in_ptr1", "tensor"), ("out_ptr0", "tensor")], a, set(),
                        {0: True, 1: True, 2: True})
    assert acc.indirect and acc.pinned_reason.startswith("indirect")
    assert set(acc.modes.values()) == {"rw"}


# -- a recorded launch sequence, assembled ----------------------------------
def _fake_tuner(file="/nonexistent/cfake.py"):
    launcher = SimpleNamespace(config=SimpleNamespace(kwargs={"XBLOCK": 128}, num_warps=4, num_stages=1),
                               bin=SimpleNamespace(asm={"ptx": ADD_PTX}), cache_hash=None, shared=0)
    return SimpleNamespace(fn=SimpleNamespace(__name__=ADD, arg_names=["in_ptr0", "in_ptr1", "out_ptr0", "xnumel"]),
                           triton_meta={"signature": {"in_ptr0": "*fp32", "in_ptr1": "*fp32", "out_ptr0": "*fp32",
                                                      "xnumel": "i32", "XBLOCK": "constexpr"}},
                           inductor_meta={}, mutated_arg_names=[], launchers=[launcher], filename=file,
                           compile_results=[])


def _record():
    torch.manual_seed(0)
    w, x = torch.randn(8, 8), torch.randn(4, 8)
    roles = {w.untyped_storage()._cdata: ("weight", "layers.0.w"), x.untyped_storage()._cdata: ("input", "x")}
    rec = _InductorRecorder(roles, [""], True)
    rec._storage(w, False)
    rec._storage(x, False)
    tuner = _fake_tuner()
    with torch.no_grad(), rec:
        buf = torch.empty_strided((4, 8), (8, 1))
        torch.mm(x, w, out=buf)                       # extern kernel: library, out= written
        out = torch.empty(32)

        def call():
            out.copy_((buf.reshape(-1) + x.reshape(-1)) * 2)
        rec.on_launch(tuner, (buf, x, out, 32), {"stream": 0}, call)
    return rec, out, {"x": x}


def test_recorded_launches_become_a_graph_that_survives_save_and_load(tmp_path):
    rec, out, inputs = _record()
    res = assemble(rec, out, inputs, {"model": "fake"}, True, True, True)
    g = res.graph
    assert [k.kind for k in g.kernels] == ["library", "ptx"]
    mm, tri = g.kernels
    assert tri.name == ADD and not tri.indirect
    assert sorted(a.mode for a in tri.accesses) == ["r", "r", "w"]
    assert any(e.src == mm.id and e.dst == tri.id and e.kind == "RAW" for e in g.edges)
    assert g.buffers[g.outputs[0]].role == "output"
    assert mm.layer == 0 and tri.layer == -1  # from the weight it reads; after the last layer: none
    assert ptx_text(g, tri.payload["key"]) == ADD_PTX
    assert tri.payload["config"]["kwargs"] == {"XBLOCK": 128} and tri.payload["args"][3] == 32
    path = tmp_path / "fake.tgraph"
    g.save(path)
    h = KernelGraph.load(path)
    assert h.kernels == g.kernels and h.buffers == g.buffers
    assert ptx_text(h, tri.payload["key"]) == ADD_PTX and triton_source(h, tri.payload["key"]) == ""
    assert [(e.src, e.dst, e.kind) for e in h.edges] == [(e.src, e.dst, e.kind) for e in g.edges]


def test_reanalysis_from_the_stored_ptx_reproduces_the_capture(tmp_path):
    from tessera_actors.capture.inductor_match import reanalyze
    rec, out, inputs = _record()
    g = assemble(rec, out, inputs, {}, True, True, True).graph
    g.save(tmp_path / "g.tgraph")
    again = reanalyze(KernelGraph.load(tmp_path / "g.tgraph"))
    assert again.kernels == g.kernels and again.meta["reanalysis_skipped"] == []


def test_kernels_without_layer_weights_take_the_layer_around_them():
    from tessera_actors.capture.inductor_graph import _layers
    names = {0: "layers.0.w", 1: "layers.1.w", 2: "norm.weight", 3: ""}
    storages = [{"role": "weight"}] * 3 + [{"role": "temp"}]
    reads = [[0], [3], [0], [3], [1], [3], [2]]
    records = [{"accesses": [(b, 0, 1, "r") for b in r]} for r in reads]
    assert [layer for layer, _ in _layers(records, names, storages)] == [0, 0, 0, -1, 1, -1, -1]


def test_run_hook_patches_and_restores_the_launcher():
    cls = hooks.autotuner_class()
    orig = cls.__dict__["run"]
    seen = []
    with hooks.run_hook(lambda tuner, args, kwargs, call: seen.append(args)):
        assert cls.__dict__["run"] is not orig
        cls.run(object.__new__(cls), 1, 2, stream=0)
    assert cls.__dict__["run"] is orig and seen == [(1, 2)]


# -- buckets and the command --------------------------------------------------
def test_bucket_specs():
    assert parse_bucket("decode:64") == ("decode", 64, 1)
    assert parse_bucket("prefill:1:1024") == ("prefill", 1, 1024)
    assert parse_bucket("denoise:2") == ("denoise", 2, 1)
    for bad in ("decode", "prefill:4", "decode:0", "train:2", "decode:x"):
        with pytest.raises(ValueError):
            parse_bucket(bad)
    assert bucket_name("prefill", 1, 128) == "prefill-b1-t128"


def test_served_buckets_share_state_buffer_names():
    from tessera_actors import models
    from tessera_actors.serving.buckets import Bucket, capture_aten
    m = models.get("llama", "tiny", dtype=torch.float32, device="meta", max_batch=4, max_seq=64)
    graphs = [capture_aten(m, b) for b in (Bucket("decode", 1), Bucket("decode", 2, 2), Bucket("prefill", 8))]
    names = [sorted(b.name for b in g.buffers.values() if b.role == "state") for g in graphs]
    assert names[0] == names[1] == names[2] == sorted(m.state_names())


def test_capture_command_on_cpu_writes_a_graph_and_prints_the_summary(tmp_path, capsys):
    from tessera_actors.capture.cli import main
    out = tmp_path / "g.tgraph"
    args = argparse.Namespace(model="llama", size="tiny", bucket="decode:2", dtype="float32", device="cpu",
                              out=str(out))
    assert main(args) == 0
    text = capsys.readouterr().out
    for word in ("kernels", "buffers", "edges", "indirect", "bytes", "weight", "state"):
        assert word in text
    g = KernelGraph.load(out)
    assert g.meta["bucket"] == "decode-b2" and len(g.kernels) > 0


def test_capture_command_reports_bad_models_clearly(tmp_path, capsys):
    from tessera_actors.capture.cli import main
    args = argparse.Namespace(model="nosuch", size="tiny", bucket="decode:2", dtype="float32", device="cpu",
                              out=str(tmp_path / "x.tgraph"))
    assert main(args) == 2
    assert "unknown model" in capsys.readouterr().err


# -- regions: repeated blocks compiled once ----------------------------------
def test_repeated_blocks_are_the_outermost_module_lists_of_one_type():
    from tessera_actors import models
    from tessera_actors.capture.inductor import repeated_blocks
    llama = models.get("llama", "tiny")
    assert [n for n, _ in repeated_blocks(llama)] == [f"decoder.layers.{i}" for i in range(llama.cfg.n_layers)]
    moe = models.get("moe", "tiny")
    names = [n for n, _ in repeated_blocks(moe)]
    assert names and all(n.count(".") == 1 for n in names)   # layers, not the experts inside them
    vlm = models.get("vlm", "tiny")
    assert {n.split(".")[0] for n, _ in repeated_blocks(vlm)} == {"vision", "decoder"}
    assert repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []


def test_inductor_capture_refuses_cpu_inputs_instead_of_missing_cpp_kernels():
    from tessera_actors import models
    from tessera_actors.capture import CaptureError
    from tessera_actors.capture.inductor import capture_inductor, compile_model
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0)
    with pytest.raises(CaptureError, match="aten capture"):
        capture_inductor(m, m.example_inputs("decode", batch=2, pos=3))
    with pytest.raises(ValueError, match="regions"):
        compile_model(m, regions="layers")


def test_a_model_compiled_in_place_for_one_bucket_is_probed_eagerly_for_the_next():
    """A GPU deployment captures its buckets one after another on one model:
    the next bucket's probe for host reads runs the model eagerly, not the
    blocks compiled for the last bucket (dynamo refuses them under the
    probe's dispatch mode), and leaves them uncompiled for the next compile."""
    from tessera_actors import models
    from tessera_actors.capture.inductor import choose_regions, repeated_blocks
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0)
    first, second = m.example_inputs("decode", batch=2, pos=3), m.example_inputs("prefill", batch=1, seq=4)
    with torch.no_grad():
        eager = m(**second)
    for _, block in repeated_blocks(m):
        block.compile(backend="eager", fullgraph=True)
    with torch.no_grad():
        m(**first)
    assert choose_regions(m, second) == ("auto", "")
    assert all(getattr(b, "_compiled_call_impl", None) is None for _, b in repeated_blocks(m))
    with torch.no_grad():
        assert torch.equal(m(**second), eager)


def test_a_generated_kernel_module_is_retargeted_to_another_device():
    from tessera_actors.capture.inductor_hooks import HookError, retarget_source
    g = KernelGraph.load(sorted((Path(__file__).parent / "data" / "graphs").glob("*.tgraph"))[0])
    k = next(k for k in g.kernels if k.kind == "ptx")
    src = triton_source(g, k.payload.get("key", ""))
    assert "DeviceProperties(type='cuda', index=0" in src
    moved = retarget_source(src, 1)
    assert "DeviceProperties(type='cuda', index=0" not in moved
    assert moved.count("DeviceProperties(type='cuda', index=1") == src.count("DeviceProperties(type='cuda', index=0")
    with pytest.raises(HookError):
        retarget_source("def f(): pass", 1)


def test_the_device_of_a_tuner_is_read_from_inductors_metadata():
    from tessera_actors.capture.inductor_hooks import tuner_device
    assert tuner_device(SimpleNamespace(device_props=SimpleNamespace(index=1), triton_meta={"device": 1})) == 1
    assert tuner_device(SimpleNamespace(triton_meta={"device": 0})) == 0   # inductor stores the bare index
    assert tuner_device(SimpleNamespace()) is None


# -- GPU: capture through inductor, replay with TritonProgram -----------------
@pytest.fixture(scope="module")
def cuda_llama():
    from tessera_actors import models
    from tessera_actors.capture.inductor import capture_inductor
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0, device="cuda")
    inp = m.example_inputs("decode", batch=2, pos=3)
    return capture_inductor(m, inp), inp


def _replay(res, inp, order, device="cuda"):
    from tessera_actors.execution.triton import TritonProgram
    from tessera_actors.execution.inputs import write_inputs
    g = res.graph
    prog = TritonProgram(g, torch.device(device), g.buffers)
    prog.load(res.values)
    write_inputs(prog, g, {k: v.to(device) for k, v in inp.items()})
    with torch.cuda.device(torch.device(device)):
        prog.run(order)
    torch.cuda.synchronize()
    return [prog.view(v).clone() for v in g.meta["output_views"]]


@pytest.mark.gpu
def test_cuda_capture_records_triton_kernels_with_ptx(cuda_llama):
    res, _ = cuda_llama
    kinds = {k.kind for k in res.graph.kernels}
    assert "ptx" in kinds
    assert not res.graph.meta["pinned"], res.graph.meta["pinned"]
    assert res.graph.meta["regions"] == "blocks"


@pytest.mark.gpu
def test_whole_model_and_block_compilation_both_replay_to_the_model_output():
    from tessera_actors import models
    from tessera_actors.capture.inductor import capture_inductor
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0, device="cuda")
    inp = m.example_inputs("decode", batch=2, pos=3)
    with torch.no_grad():
        want = m(**inp)
    for regions in ("whole", "blocks"):
        res = capture_inductor(m, inp, regions=regions)
        assert res.graph.meta["regions"] == regions
        got = _replay(res, inp, range(len(res.graph.kernels)))
        assert torch.equal(got[0], res.outputs[0])
        assert torch.allclose(got[0], want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_cuda_program_order_and_random_orders_replay_bitwise(cuda_llama):
    from tessera_actors.testing import random_topological_order
    res, inp = cuda_llama
    got = _replay(res, inp, range(len(res.graph.kernels)))
    assert all(torch.equal(a, b) for a, b in zip(got, res.outputs))
    rng = random.Random(0)
    for _ in range(5):
        got = _replay(res, inp, random_topological_order(res.graph, rng))
        assert all(torch.equal(a, b) for a, b in zip(got, res.outputs))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernels_captured_on_one_gpu_replay_bitwise_on_another(cuda_llama):
    res, inp = cuda_llama
    got = _replay(res, inp, range(len(res.graph.kernels)), device="cuda:1")
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, res.outputs))


def test_gpu_check_helpers_run_on_cpu_with_an_aten_graph(monkeypatch):
    """The helpers the GPU scripts use (replay in orders, compare, greedy tokens)
    run the same on a CPU aten capture, where TritonProgram takes the aten path
    (with eager's kernels: program order bit for bit)."""
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "0")
    from tessera_actors import models
    from tessera_actors.capture import capture_module
    from tessera_actors.check.inductor import greedy_tokens, soundness
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0)
    inp = m.example_inputs("decode", batch=2, pos=3)
    res = capture_module(m, inp)
    s = soundness(res, inp, orders=5, device="cpu")
    assert s["program_order"]["equal"] and s["orders"] == 5 and s["mismatches"] == 0
    tok = greedy_tokens(m, m, res, inp, steps=3, device="cpu")
    assert tok["identical"] and tok["min_cosine"] > 0.999


# -- committed CUDA fixtures (captured on an H200 by scripts/gen_cuda_fixtures.py) --
FIXTURES = sorted((Path(__file__).parent / "data" / "graphs").glob("*.tgraph"))


def _inductor_writes(graph, kernel):
    """(buffer, start, end) of every tensor argument inductor itself names as written."""
    from tessera_actors.capture.inductor_match import inductor_opinion, ref_span
    info = graph.meta["triton_kernels"][kernel.payload["key"]]
    names, mutated = info["arg_names"], set(info["mutated"])
    out = set()
    for i, a in enumerate(kernel.payload["args"]):
        if isinstance(a, dict) and "t" in a and i < len(names):
            op = inductor_opinion(names[i], mutated)
            if op and op[1]:
                out.add((a["t"][0], *ref_span(a["t"])))
    return out


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_cuda_fixture_is_a_complete_kernel_graph(path):
    g = KernelGraph.load(path)
    assert g.meta["device"].startswith("cuda") and g.meta["backend"] == "triton"
    ptx = [k for k in g.kernels if k.kind == "ptx"]
    assert ptx and not g.meta["pinned"]
    assert all(".entry" in ptx_text(g, k.payload["key"]) for k in ptx)
    assert all(e.src < e.dst for e in g.edges)   # the program order (kernel ids) is topological
    state = {b.name for b in g.buffers.values() if b.role == "state"}
    assert state == set(g.meta["state_names"])
    for k in ptx:  # never a write inductor knows of that the graph lacks
        written = {(a.buffer, a.start, a.end) for a in k.accesses if a.writes}
        assert _inductor_writes(g, k) <= written, k.name


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_cuda_fixture_reanalysed_with_the_current_ptx_analyzer_keeps_every_write(path):
    from tessera_actors.capture.inductor_match import reanalyze
    g = reanalyze(KernelGraph.load(path))
    assert not g.meta["reanalysis_skipped"] and not g.meta["pinned"]
    for k in g.kernels:
        if k.kind == "ptx":
            written = {(a.buffer, a.start, a.end) for a in k.accesses if a.writes}
            assert _inductor_writes(g, k) <= written, k.name
    assert len(g.edges) > 0
