"""Tiny random models of each supported architecture, built by transformers (the oracle),
saved as transformers saves them and written as a GGUF the way llama.cpp's converter
writes one (gguf-py's tensor-name map and metadata keys, its q/k row permutation for
llama, its norm shift for Gemma, its rope_freqs tensor for Llama 3 scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers  # the oracle: missing, it fails the run (never a skip)

VOCAB = 256
SLIDING_WINDOW = 8  # below the prompts' lengths, so windowed and full attention differ
SOFTCAP = 8.0
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6)


@dataclass(frozen=True)
class Case:
    """One architecture's tiny model: its config, and what its GGUF says it is."""

    name: str
    config: transformers.PretrainedConfig
    gguf_arch: str


def llama3_rope() -> dict:
    # with head_dim 16 and the original context 64, the 8 frequencies fall in all three of
    # Llama 3's bands: kept (wavelength < 16), blended (16 to 64) and slowed by `factor` (> 64)
    return {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


CASES = {
    "llama3": Case("llama3", transformers.LlamaConfig(**COMMON, num_hidden_layers=3, rope_parameters=llama3_rope()),
                   "llama"),
    "mistral": Case("mistral", transformers.MistralConfig(**COMMON, num_hidden_layers=3, sliding_window=SLIDING_WINDOW),
                    "llama"),
    "qwen2": Case("qwen2", transformers.Qwen2Config(**COMMON, num_hidden_layers=3, tie_word_embeddings=True), "qwen2"),
    "qwen3": Case("qwen3", transformers.Qwen3Config(**COMMON, num_hidden_layers=3), "qwen3"),
    # 6 layers: 5 sliding-window layers with their own RoPE base, then a global one (linear RoPE scaling)
    "gemma3": Case("gemma3", transformers.Gemma3TextConfig(
        **COMMON, num_hidden_layers=6, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=16,
        final_logit_softcapping=SOFTCAP,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}), "gemma3"),
}  # fmt: skip


def build_reference(case: Case, seed: int = 0) -> torch.nn.Module:
    """The transformers model with random weights large enough that logits spread (a
    near-uniform softmax would make greedy tokens hinge on rounding), norms included."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(case.config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms multiply by 1 + w, the others' by w
                base = 0.0 if case.gguf_arch == "gemma3" else 1.0
                parameter.copy_(base + 0.2 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.2)
    return model


def save_hf_dir(model: torch.nn.Module, directory: Path) -> Path:
    model.save_pretrained(directory)  # config.json and model.safetensors, as transformers writes them
    return directory


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf (LlamaModel.generate_extra_tensors): Llama 3's factors."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, original = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def llama_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: q/k rows interleaved for its rotate-pairs RoPE."""
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def write_gguf(case: Case, model: torch.nn.Module, path: Path,
               qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    """The model as llama.cpp's converter would write it: F32, or the block matmuls in `qtype`
    (gguf-py's quantizer; norms, biases and the embedding stay F32)."""
    config, arch = case.config, case.gguf_arch
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {case.name}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    else:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    rope = config.rope_parameters
    if arch == "gemma3":
        global_rope, local_rope = rope["full_attention"], rope["sliding_attention"]
        writer.add_rope_freq_base(global_rope["rope_theta"])
        writer.add_rope_freq_base_swa(local_rope["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(global_rope["factor"])
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if getattr(config, "sliding_window", None):  # Mistral's, Gemma's (Qwen's configs set none)
        writer.add_sliding_window(config.sliding_window)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, config.head_dim))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.numpy().astype(np.float32)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = llama_permute(data, config.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = llama_permute(data, config.num_key_value_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's Gemma3Model writes the (1 + w) the norm multiplies by
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if qtype != gguf.GGMLQuantizationType.F32 and name.startswith("blk.") and data.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_other_gguf(path: Path, arch: str) -> Path:
    """A GGUF that says it is of architecture `arch`, with one tensor and one key."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def prompts(seed: int = 1) -> list[list[int]]:
    """Three prompts: shorter than the window, longer (verify-sized rows attend one by one),
    and past ROWS_ONE_BY_ONE (the masked kernel)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (5, 20, 40)]


def reference_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """A plain argmax loop over the whole sequence, not generate(): nothing stops it early."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(prompt):]
