"""The buckets of a GPU deployment, captured with inductor.

On a deployment whose every device is a GPU, each bucket is compiled by
inductor (``torch.compile``'s kernels: fused Triton kernels, cuBLAS GEMMs,
cuDNN attention) and recorded as a kernel program whose access sets come
from the kernels' PTX (:func:`~tessera_actors.capture.inductor.capture_inductor`):
the PTX-derived kernel DAG the graph actor holds, placed by the planner and
replayed as CUDA graphs by the device actors.  Repeated blocks (decoder
layers) are compiled once (``regions="auto"``/``"blocks"``); ``"whole"``
compiles the whole model as one graph, as ``torch.compile`` of the model
does.

The model is put on the GPU once for all buckets: the host model's weights
copied into a GPU-built twin (its KV cache on the GPU too, the size the
devices will allocate), every bucket captured on it with ``fresh_state``
(no snapshot of the weights or the cache), then the twin is dropped, so the
GPU holds one copy of the weights and one cache again when the devices
install.  A bucket inductor cannot compile or record is captured as aten
ops instead (``ServedModel.captures`` says so) - served, never lost.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import traceback

import torch

from tessera_actors.serving.config import EngineConfig

log = logging.getLogger("tessera_actors.serving")


def keep_compile_state_in_this_thread() -> None:
    """Import inductor's CUDA-graph trees in the calling thread.

    They keep their per-device managers in the thread-local storage of the
    thread that first imports them.  The engine captures in a worker thread;
    imported there first, ``torch.compile(mode="reduce-overhead")`` in the
    program that embeds the engine would fail afterwards with a bare
    ``AssertionError`` (``cudagraph_trees.get_obj``).  The engine calls this
    from its event loop's thread before it captures."""
    import torch._inductor.cudagraph_trees  # noqa: F401 - imported for its thread-local state


def attention_form(cfg: EngineConfig, gpu: bool) -> str:
    """The GQA form of the attention modules: ``enable_gqa`` (cuDNN's kernel
    reads each KV head once) on GPU-only deployments, ``fold`` elsewhere."""
    if cfg.gqa != "auto":
        return cfg.gqa
    return "enable_gqa" if gpu else "fold"


def set_attention_form(model: torch.nn.Module, form: str) -> None:
    from tessera_actors.models.attention import CachedAttention
    for mod in model.modules():
        if isinstance(mod, CachedAttention):
            mod.gqa = form


def gpu_twin(cfg: EngineConfig, real: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model built on ``device`` (its state there, zeros) with the host
    model's weights copied in by name (ties kept: the twin is built by the
    model's own constructor)."""
    from tessera_actors import models
    kw = dict(cfg.overrides, max_batch=cfg.max_seqs, max_seq=cfg.max_model_len)
    dtype = next(real.parameters()).dtype
    twin = models.get(cfg.model, cfg.size, dtype=dtype, seed=cfg.seed, device=device, **kw)
    state = set(twin.state_names())
    host = dict(real.named_parameters(remove_duplicate=False))
    host.update(real.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, t in list(twin.named_parameters()) + list(twin.named_buffers()):
            if name in state:
                t.zero_()
            elif name in host:
                t.copy_(host[name])
            else:
                raise ValueError(f"the GPU twin has {name!r}, the host model has no tensor of that name")
    return twin.eval()


class GreedyHead(torch.nn.Module):
    """Each position's argmax (the lowest id on ties) and log-sum-exp of the
    logits, in float32: compiled with the bucket (:func:`greedy_outputs`), one
    reduction that reads the bf16 logits once, replayed in the bucket's CUDA
    graph, where sampling them eagerly wrote a float32 copy, reduced it for
    the argmax and wrote the whole log-softmax (about 110 us of a Llama
    decode step of 64 rows on an H200)."""

    compile_alone = True   # compiled on its own when the blocks are (capture.inductor._between_blocks)

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = logits.float()
        return f.argmax(dim=-1), torch.logsumexp(f, dim=-1)


@contextlib.contextmanager
def greedy_outputs(model: torch.nn.Module):
    """While active, ``model(...)`` returns ``(logits, argmax, log-sum-exp)``
    (:class:`GreedyHead` on its logits): the bucket's graph gets the greedy
    sampler's two small outputs beside the logits (``meta["greedy_outputs"]``)."""
    model.greedy_head = GreedyHead()
    handle = model.register_forward_hook(lambda mod, args, out: (out, *mod.greedy_head(out)))
    try:
        yield
    finally:
        handle.remove()
        del model.greedy_head


def capture_on_gpu(cfg: EngineConfig, real: torch.nn.Module, meta: torch.nn.Module, buckets, progress=None):
    """(graphs, captured unnamed values, capture kind) per bucket name."""
    from tessera_actors.capture.inductor import capture_inductor
    from tessera_actors.serving.buckets import bucket_inputs, capture_aten, shaped
    import torch._dynamo as dynamo
    device = torch.device("cuda", torch.cuda.current_device())
    form = attention_form(cfg, gpu=True)
    set_attention_form(meta, form)
    twin = gpu_twin(cfg, real, device)
    set_attention_form(twin, form)
    graphs, captured, kinds = {}, {}, {}
    try:
        for i, b in enumerate(buckets):
            try:
                with shaped(twin, b), greedy_outputs(twin):
                    res = capture_inductor(twin, bucket_inputs(b, device), meta={"bucket": b.name},
                                           regions=cfg.regions, fresh_state=True)
                res.graph.meta["capture"] = "inductor"
                res.graph.meta["greedy_outputs"] = [1, 2]   # output views: argmax, log-sum-exp
                graphs[b.name], captured[b.name], kinds[b.name] = res.graph, res.values, "inductor"
            except Exception as e:   # noqa: BLE001 - inductor's own asserts too: the bucket is served as aten ops
                where = traceback.extract_tb(e.__traceback__)[-1]
                why = (f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                       f"(at {where.filename}:{where.lineno})")[:400]
                log.warning("bucket %s: inductor capture failed (%s); captured as aten ops", b.name, why,
                            exc_info=True)
                graphs[b.name] = capture_aten(meta, b)
                graphs[b.name].meta["capture_fallback"] = why
                kinds[b.name] = f"aten (inductor failed: {why})"
            if progress is not None:
                progress(i + 1, len(buckets), b.name)
    finally:
        del twin
        dynamo.reset()   # the compiled frames hold the twin's tensors; the Triton kernels stay loaded
        gc.collect()
        torch.cuda.empty_cache()
    return graphs, captured, kinds


__all__ = ["GreedyHead", "attention_form", "capture_on_gpu", "greedy_outputs", "gpu_twin", "keep_compile_state_in_this_thread", "set_attention_form"]
