"""Read a Hugging Face checkpoint directory of a supported architecture (config.json, one or
several .safetensors files) with the same sparse rule as the GGUF loader."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from .architecture import HF_MODEL_TYPES, LLAMA, Architecture, unsupported
from .args import LayerRange, ModelArgs
from .errors import ModelLoadError
from .quant import FloatWeight
from .weights import BLOCK_TENSORS, needed_tensor_names

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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# With norms after attention and the MLP (Gemma), Hugging Face's post_attention_layernorm
# is the attention output's norm, and the MLP's input norm has a name of its own.
HF_POST_NORM_NAMES = {
    **HF_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
assert set(BLOCK_TENSORS) <= set(HF_BLOCK_NAMES)


def hf_name(gguf_name: str, arch: Architecture = LLAMA) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, layer, kind, suffix = gguf_name.split(".")
    names = HF_POST_NORM_NAMES if arch.post_norms else HF_BLOCK_NAMES
    return f"model.layers.{layer}.{names[kind]}.{suffix}"


def read_hf_args(directory: Path) -> ModelArgs:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory} has no config.json. Fix: pass a GGUF file or a Hugging Face model directory.")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ModelLoadError(unsupported("model_type", model_type, HF_MODEL_TYPES))
    arch = HF_MODEL_TYPES[model_type]
    _check_supported(config, arch)
    heads, num_layers = config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    global_rope, sliding_rope = _rope_parameters(config, arch)
    theta = float(global_rope.get("rope_theta", 10000.0))
    if sliding_rope and rope_frequency_factors(sliding_rope, theta, head_dim) is not None:
        raise ModelLoadError(f"Scaled RoPE on sliding-window layers is not supported: {sliding_rope!r}.")
    layer_types = _layer_types(config, num_layers)
    window = config.get("sliding_window") if "sliding_attention" in layer_types else None
    return ModelArgs(
        num_layers=num_layers,
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=head_dim,
        vocab_size=config["vocab_size"],
        context_length=config.get("max_position_embeddings", 2048),
        rms_norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_freq_factors=rope_frequency_factors(global_rope, theta, head_dim),
        tie_word_embeddings=config.get("tie_word_embeddings", arch.ties_embeddings_by_default),
        architecture=arch.name,
        sliding_window=window,
        sliding_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention") if window else (),
        sliding_rope_theta=float(sliding_rope["rope_theta"]) if window and sliding_rope else None,
        query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
        final_logit_softcapping=config.get("final_logit_softcapping"),
    )


def _check_supported(config: dict, arch: Architecture) -> None:
    """Reject the options of these model types that our forward does not compute."""
    activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    expected = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}[arch.activation]
    problems = []
    if activation not in expected:
        problems.append(f"activation {activation!r} (expected {expected[0]})")
    if config.get("attention_bias") and not arch.qkv_bias:  # llama's would bias o_proj too
        problems.append("attention_bias")
    if config.get("mlp_bias"):
        problems.append("mlp_bias")
    if config.get("attn_logit_softcapping"):
        problems.append("attn_logit_softcapping")
    if config.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention")
    if problems:
        raise ModelLoadError(f"{arch.name} checkpoint with {', '.join(problems)}: not supported.")


def _rope_parameters(config: dict, arch: Architecture) -> tuple[dict, dict | None]:
    """(global layers' RoPE, sliding layers' own RoPE or None) as transformers >= 5 writes
    them (`rope_parameters`, nested per layer type for Gemma 3), or from the older
    top-level rope_theta / rope_scaling / rope_local_base_freq."""
    params = config.get("rope_parameters")
    if params is None:
        params = dict(config.get("rope_scaling") or {}, rope_theta=config.get("rope_theta", 10000.0))
        if "rope_local_base_freq" in config:
            local = {"rope_type": "default", "rope_theta": config["rope_local_base_freq"]}
            params = {"full_attention": params, "sliding_attention": local}
    if "full_attention" in params:  # one RoPE per layer type
        return params["full_attention"], params.get("sliding_attention")
    return params, None


def rope_frequency_factors(rope: dict, theta: float, head_dim: int) -> tuple[float, ...] | None:
    """What each RoPE frequency is divided by (None: 1), for transformers' rope types
    default, linear and llama3 (`_compute_llama3_parameters`: low frequencies slowed by
    `factor`, high ones kept, the band between blended)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return (float(rope["factor"]),) * (head_dim // 2)
    if kind != "llama3":
        raise ModelLoadError(f"Unsupported RoPE type {kind!r} in {rope!r} (supported: default, linear, llama3).")
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def _layer_types(config: dict, num_layers: int) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention", as transformers derives them."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return ["full_attention"] * num_layers
    if "sliding_window_pattern" in config or config.get("model_type") == "gemma3_text":
        pattern = config.get("sliding_window_pattern", 6)  # Gemma 3: 5 local layers, then a global one
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if "max_window_layers" in config:  # Qwen: layers from max_window_layers on slide
        return ["sliding_attention" if i >= config["max_window_layers"] else "full_attention"
                for i in range(num_layers)]
    return ["sliding_attention"] * num_layers  # Mistral: every layer


MATMUL_SUFFIXES = tuple(f".{t}.weight" for t in BLOCK_TENSORS if not t.endswith("norm"))
NORM_SUFFIX = "norm.weight"


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
    arch = args.arch
    for name in needed_tensor_names(layers, args.tie_word_embeddings, arch):
        source = hf_name(name, arch)
        if source not in where:
            raise ModelLoadError(f"Checkpoint is missing tensor {source!r} needed for layers {layers}.")
        with safe_open(where[source], framework="pt") as f:
            tensor = f.get_tensor(source)
        is_vector = tensor.dim() == 1  # norms and biases: float32 always
        tensor = tensor.to(device=device, dtype=torch.float32 if is_vector else dtype or tensor.dtype)
        if arch.hf_norm_offset and name.endswith(NORM_SUFFIX):
            tensor = tensor + arch.hf_norm_offset  # the multiplier itself, as the GGUF stores it
        weights[name] = tensor
        on_tensor()
    if quantize_bits is not None:
        for name in [n for n in weights if n.endswith(MATMUL_SUFFIXES) or n == "output.weight"]:
            weights[name] = FloatWeight(weights[name], quantize_bits)
        if layers.is_last and "output.weight" not in weights:  # tied: the head quantized, lookups stay float
            weights["output.weight"] = FloatWeight(weights["token_embd.weight"], quantize_bits)
    return weights
