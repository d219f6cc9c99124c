"""The inductor capture's "as written" logic, on CPU: which regions to
compile, and pytree outputs / constants in the assembled graph (the GPU
parts are the ``gpu`` tests in test_hf_models.py and test_inductor_capture.py)."""
import pytest

from tessera_actors import models
from tessera_actors.capture.inductor import choose_regions
from tessera_actors.capture.inductor_graph import assemble

from test_inductor_capture import _record


def test_auto_regions_compile_the_whole_model_when_eager_code_reads_the_host():
    hf = pytest.importorskip("tessera_actors.models.hf")
    pytest.importorskip("transformers")
    loaded = hf.load("hf:tiny-llama")
    regions, reason = choose_regions(loaded.model, loaded.example_inputs(1, 8))
    assert regions == "whole" and "masking_utils.py" in reason
    assert choose_regions(loaded.model, loaded.example_inputs(1, 8), "blocks") == ("blocks", "")
    m = models.get("llama", "tiny")
    assert choose_regions(m, m.example_inputs("decode", 2)) == ("auto", "")    # no host read: per block


def test_assembled_graph_names_pytree_outputs_and_keeps_constants():
    rec, out, inputs = _record()
    res = assemble(rec, {"logits": out, "aux": (None, out)}, inputs, {"constants": {"use_cache": False}},
                   True, True, True)
    g = res.graph
    assert g.meta["output_names"] == ["logits", "aux.1"] and len(g.meta["output_views"]) == 2
    assert g.meta["constants"] == {"use_cache": False} and g.meta["guards"] == []
