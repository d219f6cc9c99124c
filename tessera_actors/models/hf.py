"""Third-party models: transformers' own implementations, as a user builds them.

``load(spec, dtype, device, seed, layers, **config_overrides) -> HFModel``
with ``spec`` (the ``hf:`` prefix optional):

- ``hf:<dir>``: a model folder.  With ``config.json`` and weights
  (``*.safetensors`` / ``pytorch_model.bin``) -> ``from_pretrained``; with
  ``config.json`` only -> random init from the config; with a ``*.gguf`` file
  and no config -> the GGUF (below).
- ``hf:<file>.json``: a config file -> random init (deterministic in ``seed``).
- ``hf:<file>.gguf``: config and weights read by transformers from the GGUF
  (``gguf`` package; quantized tensors dequantized to ``dtype``).
- ``hf:smollm2``: SmolLM2-135M-Instruct's real weights from the GGUF that
  :func:`tessera_actors.models.smollm2.gguf_path` finds, in transformers'
  ``LlamaForCausalLM``.
- ``hf:tiny-<arch>``: a tiny random config of ``llama``, ``qwen2``,
  ``mixtral``, ``gpt2``, ``mamba2`` or ``vit`` (CI sizes, defaults otherwise).

Nothing is fetched from the hub.  Contract of the result (:class:`HFModel`):
``.model`` is the transformers ``nn.Module`` on ``device`` in ``dtype``, eval
mode, every parameter frozen, default attention implementation;
``.kind`` is ``"causal-lm"`` (``model(**inputs).logits`` is [B, T, vocab])
or ``"encoder"`` (vision/other: outputs as the model returns them);
``.inputs`` describes the keyword inputs and
``.example_inputs(batch, seq)`` builds them: for a causal LM ``input_ids``
[B, T] int64, ``attention_mask`` [B, T] int64 (all ones: any other mask
fails the capture's host-read guard of transformers' mask code) and
``use_cache=False`` (a stateless full-sequence forward: logits only); for
ViT-like models ``pixel_values`` [B, C, H, W].  ``layers`` keeps the first
N decoder layers (``num_hidden_layers``).
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any

import torch

# tiny CI configurations: default configs of each architecture, small sizes
_LM = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
TINY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LM),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _LM),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_LM, num_local_experts=4, num_experts_per_tok=2)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                                    bos_token_id=0, eos_token_id=0)),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                         num_heads=8, head_dim=16, state_size=16, n_groups=1,
                                                         chunk_size=8)),
    "vit": ("ViTConfig", "ViTModel", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, image_size=32, patch_size=8)),
}


@dataclass
class HFModel:
    """A loaded third-party model and the inputs it takes (see module docstring)."""

    model: torch.nn.Module
    kind: str
    source: str
    inputs: dict[str, str] = field(default_factory=dict)

    @property
    def config(self):
        return self.model.config

    def example_inputs(self, batch: int = 1, seq: int = 8, seed: int = 0) -> dict[str, Any]:
        """Keyword inputs for ``model(**inputs)`` (deterministic in ``seed``)."""
        dev = next(self.model.parameters()).device
        g = torch.Generator().manual_seed(seed)
        if self.kind == "causal-lm":
            ids = torch.randint(0, self.config.vocab_size, (batch, seq), generator=g).to(dev)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
        cfg = self.config
        size = getattr(cfg, "image_size", 224)
        dtype = next(self.model.parameters()).dtype
        pix = torch.randn(batch, getattr(cfg, "num_channels", 3), size, size, generator=g)
        return {"pixel_values": pix.to(dev, dtype)}

    def describe(self) -> str:
        lines = [f"{type(self.model).__name__} ({self.kind}) from {self.source}: "
                 f"{sum(p.numel() for p in self.model.parameters()):,} parameters"]
        lines += [f"  {k}: {v}" for k, v in self.inputs.items()]
        return "\n".join(lines)


def _transformers():
    try:
        import transformers
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("hf: models need transformers (pip install transformers, "
                                  "or the package's 'test' extra)") from e
    return transformers


def _model_class(cfg):
    tf = _transformers()
    for arch in getattr(cfg, "architectures", None) or []:
        if hasattr(tf, arch):
            return getattr(tf, arch)
    try:
        return tf.AutoModelForCausalLM._model_mapping[type(cfg)]
    except KeyError:
        return tf.AutoModel._model_mapping[type(cfg)]


def _gguf_config(path: str, overrides: dict[str, Any]):
    cfg = _transformers().AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                     gguf_file=os.path.basename(path), **overrides)
    if not getattr(cfg, "architectures", None) and cfg.model_type == "llama":
        cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def _from_gguf(path: str, cfg) -> torch.nn.Module:
    """Weights read by transformers from a GGUF file (what
    ``from_pretrained(dir, gguf_file=...)`` does, without needing accelerate)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():  # every weight comes from the file: skip the random init
        model = _model_class(cfg)(cfg)
    bar = gguf_utils.tqdm
    gguf_utils.tqdm = lambda it, **kw: it  # no progress bar on stderr for a library call
    try:
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    finally:
        gguf_utils.tqdm = bar
    want = dict(model.state_dict())
    state = {k: v for k, v in tensors.items() if k in want}
    missing = set(want) - set(state)
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    if missing - tied:
        raise ValueError(f"{path}: the GGUF lacks {sorted(missing - tied)[:5]} for {type(model).__name__}")
    model.load_state_dict(state, strict=False)
    if tied & missing:
        model.tie_weights()
    return model


def _config(how: str, path: str, overrides: dict[str, Any]):
    tf = _transformers()
    if how == "tiny":
        cfg_name, arch, fields = TINY[path]
        cfg = getattr(tf, cfg_name)(**dict(fields, **overrides))
        cfg.architectures = [arch]
        return cfg
    if how == "gguf":
        return _gguf_config(path, overrides)
    return tf.AutoConfig.from_pretrained(path, **overrides)


def _resolve(spec: str) -> tuple[str, str]:
    """(how, path): how in tiny | gguf | config | pretrained."""
    spec = spec.removeprefix("hf:")
    if spec.startswith("tiny-"):
        if spec[5:] not in TINY:
            raise ValueError(f"unknown tiny model {spec!r}; known: {', '.join('tiny-' + k for k in TINY)}")
        return "tiny", spec[5:]
    if spec == "smollm2":
        from tessera_actors.models.smollm2 import gguf_path
        return "gguf", gguf_path()
    if os.path.isfile(spec):
        if spec.endswith(".gguf"):
            return "gguf", spec
        if spec.endswith(".json"):
            return "config", spec
        raise ValueError(f"hf:{spec}: expected a folder, a config .json or a .gguf file")
    if os.path.isdir(spec):
        has_config = os.path.exists(os.path.join(spec, "config.json"))
        weights = glob.glob(os.path.join(spec, "*.safetensors")) + glob.glob(os.path.join(spec, "pytorch_model*.bin"))
        ggufs = sorted(glob.glob(os.path.join(spec, "*.gguf")))
        if has_config:
            return ("pretrained" if weights else "config"), spec
        if ggufs:
            return "gguf", ggufs[0]
        raise ValueError(f"hf:{spec}: the folder has neither config.json nor a .gguf file")
    raise FileNotFoundError(f"hf:{spec}: no such file or folder (the hub is not used)")


def load(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
         layers: int | None = None, **config_overrides: Any) -> HFModel:
    """Build a transformers model from ``spec`` (see the module docstring).
    On ``device="meta"`` only the config is read: shapes, no values."""
    how, path = _resolve(spec)
    if layers is not None:
        config_overrides["num_hidden_layers"] = layers
    cfg = _config(how, path, config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if str(device) == "meta":
            with torch.device("meta"):
                model = _model_class(cfg)(cfg)
        elif how == "gguf":
            model = _from_gguf(path, cfg)
        elif how == "pretrained":
            model = _model_class(cfg).from_pretrained(path, config=cfg, dtype=dtype)
        else:
            model = _model_class(cfg)(cfg)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    lm = hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None
    inputs = ({"input_ids": "int64 [B, T] token ids", "attention_mask": "int64 [B, T], all ones",
               "use_cache": "constant False (stateless full-sequence forward)"} if lm else
              {"pixel_values": "float [B, C, H, W] images"})
    return HFModel(model, "causal-lm" if lm else "encoder", f"hf:{spec.removeprefix('hf:')}", inputs)


def load_serving(spec: str, max_batch: int, max_seq: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", seed: int = 0, layers: int | None = None,
                 **config_overrides: Any):
    """The causal LM of ``spec`` with the serving engine's contract
    (:class:`~tessera_actors.models.hf_serving.ServingLM`: ``forward(input_ids,
    positions, rows, last)``, a static KV cache of ``max_batch`` rows x
    ``max_seq`` positions as state, ``row_base``); on ``device="meta"`` for
    capture without values (buffer names match the real model's)."""
    from tessera_actors.models.hf_serving import ServingLM
    loaded = load(spec, dtype=dtype, device=device, seed=seed, layers=layers, **config_overrides)
    if loaded.kind != "causal-lm":
        raise ValueError(f"{loaded.source} is not a causal LM: nothing to serve")
    limit = getattr(loaded.config, "max_position_embeddings", None)
    if limit and max_seq > limit:
        raise ValueError(f"max_seq {max_seq} exceeds {loaded.source}'s context of {limit}")
    with torch.device(device):
        return ServingLM(loaded.model, max_batch, max_seq)
