"""Read a Hugging Face llama-family checkpoint directory (config.json, one or
several .safetensors files) with the same sparse rule as the GGUF loader."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from .args import LayerRange, ModelArgs
from .errors import ModelLoadError
from .quant import FloatWeight
from .weights import BLOCK_TENSORS, needed_tensor_names

SUPPORTED_MODEL_TYPES = ("llama", "mistral")

HF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
assert set(HF_BLOCK_NAMES) == set(BLOCK_TENSORS)


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_BLOCK_NAMES[kind]}.weight"


def read_hf_args(directory: Path) -> ModelArgs:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory} has no config.json. Fix: pass a GGUF file or a Hugging Face model directory.")
    config = json.loads(config_path.read_text())
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"Expected a llama-family checkpoint, got model_type={config.get('model_type')!r} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})."
        )
    heads = config["num_attention_heads"]
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in ("linear", "default"):
        raise ModelLoadError(f"Unsupported rope_scaling {scaling!r} (supported: linear).")
    return ModelArgs(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        context_length=config.get("max_position_embeddings", 2048),
        rms_norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rope_scaling={"rope_type": "linear", "factor": scaling["factor"]} if scaling and scaling.get("factor") else None,
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )


MATMUL_SUFFIXES = tuple(f".{t}.weight" for t in BLOCK_TENSORS if not t.endswith("norm"))


def load_hf_tensors(
    directory: Path,
    args: ModelArgs,
    layers: LayerRange,
    dtype: torch.dtype | None,
    device: torch.device,
    on_tensor: Callable[[], None] = lambda: None,
    quantize_bits: int | None = None,
) -> dict[str, torch.Tensor | FloatWeight]:
    """The stage's tensors as stored (or in `dtype`); with `quantize_bits`, every matmul
    weight (the output head too, tied or not) becomes a FloatWeight for the kernel."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} holds no .safetensors files.")
    where = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            where.update({name: file for name in f.keys()})
    weights = {}
    for name in needed_tensor_names(layers, args.tie_word_embeddings):
        source = hf_name(name)
        if source not in where:
            raise ModelLoadError(f"Checkpoint is missing tensor {source!r} needed for layers {layers}.")
        with safe_open(where[source], framework="pt") as f:
            tensor = f.get_tensor(source)
        is_norm = name.endswith("norm.weight")
        weights[name] = tensor.to(device=device, dtype=torch.float32 if is_norm else dtype or tensor.dtype)
        on_tensor()
    if quantize_bits is not None:
        for name in [n for n in weights if n.endswith(MATMUL_SUFFIXES) or n == "output.weight"]:
            weights[name] = FloatWeight(weights[name], quantize_bits)
        if layers.is_last and "output.weight" not in weights:  # tied: the head quantized, lookups stay float
            weights["output.weight"] = FloatWeight(weights["token_embd.weight"], quantize_bits)
    return weights
