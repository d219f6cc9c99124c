"""The reference models' committed graphs and the fitted cost terms that
``tessera advise`` plans with.

Graphs: each model's decode buckets at several batches (its best batch
within memory is searched: DESIGN.md, "batch is a policy's first knob")
and its prefill bucket (DiT: its denoise bucket), captured once, at full
depth, on the *meta* device (shapes only, no weights:
``scripts/capture_advise_graphs.py``), committed gzip-compressed under
``tessera_actors/advise_data/``.  Mamba2 has no prefill graph: its prefill
is costed as prompt / batch decode steps, as a chunked scan runs.
``qwen3moe`` is a Qwen3-235B-A22B-shaped MoE (decode and prefill), the
paper's 16-GPU case.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tessera_actors.graph import KernelGraph

DATA = Path(__file__).parents[1] / "advise_data"
PARAMS_FILE = Path(__file__).with_name("whatif_params.json")
MODELS = ("llama", "moe", "mamba2", "vlm", "dit", "qwen3moe")
_DECODE = {"vlm": (32, 64, 128, 256), "qwen3moe": (64,)}


@dataclass(frozen=True)
class Workload:
    """The served arena's conversation: a request is a ``prompt``-token
    prefill and ``out_tokens`` decode steps with a ``cache``-token KV cache;
    DiT: an image of ``denoise_steps`` steps, ``image_tokens`` latent tokens."""

    prompt: int = 1024
    out_tokens: int = 128
    cache: int = 2048
    denoise_steps: int = 50
    image_tokens: int = 256


WORKLOADS = {"conversation": Workload()}


def graph_path(model: str, bucket: str, data: str | Path | None = None) -> Path:
    return Path(data or DATA) / f"{model}-{bucket}.tgraph.gz"


def decode_buckets(model: str) -> list[str]:
    """The decode buckets of ``model``, smallest batch first (DiT: its denoise bucket)."""
    if model == "dit":
        return ["denoise-b16"]
    return [f"decode-b{b}" for b in _DECODE.get(model, (64, 128, 256, 512))]


def buckets_of(model: str) -> dict[str, str]:
    """Phase -> the first bucket of each phase ``model`` has."""
    out = {"decode" if model != "dit" else "denoise": decode_buckets(model)[0]}
    if model not in ("dit", "mamba2"):
        out["prefill"] = "prefill-b1-t1024"
    return out


def batch_of(bucket: str) -> int:
    """``decode-b64`` -> 64."""
    return int(bucket.split("-b")[1].split("-")[0])


@lru_cache(maxsize=32)
def load_graph(model: str, bucket: str, data: str | None = None) -> KernelGraph:
    """A committed graph (``data``: another directory of ``MODEL-BUCKET.tgraph.gz``)."""
    import msgpack
    path = graph_path(model, bucket, data)
    if not path.exists():
        raise FileNotFoundError(f"no committed graph {path} (run scripts/capture_advise_graphs.py)")
    return KernelGraph.from_dict(msgpack.unpackb(gzip.decompress(path.read_bytes()), raw=False,
                                                 strict_map_key=False))


def load_params(path: Path | None = None):
    """The fitted cost-model terms (``planning/whatif_params.json``)."""
    from tessera_actors.planning.whatif import Params
    p = Path(path or PARAMS_FILE)
    if not p.exists():
        raise FileNotFoundError(f"no fitted what-if parameters at {p} (run benchmarks/bench_whatif.py --write-params)")
    return Params.from_dict(json.loads(p.read_text())["params"])
