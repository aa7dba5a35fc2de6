"""Read a GGUF of a supported architecture (architecture.py): hyperparameters, tokenizer fields and only the
tensors one stage needs: kept in their quantized blocks (dtype None, the default)
or dequantized with the `gguf` package to a dtype asked for."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from .architecture import GGUF_ARCHITECTURES, unsupported
from .args import LayerRange, ModelArgs
from .errors import ModelLoadError
from .gguf_file import GGUFFile
from .quant import SUPPORTED, QuantizedTensor, drop_resident_pages
from .weights import needed_tensor_names


def open_gguf(path: str | Path) -> GGUFFile:
    """Open (once per process and file version) a GGUF: the tokenizer and the
    weights' load share one parse."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ModelLoadError(f"Model file not found: {path}. Fix: pass --model with an existing .gguf file.")
    stat = path.stat()
    return _open_gguf(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as exc:  # GGUFFormatError, a bad UTF-8 key, an unreadable file
        raise ModelLoadError(f"Could not read {path} as GGUF: {exc}") from exc


def release(reader: GGUFFile) -> None:
    """After a load: forget the parsed metadata (the vocabulary's Python strings) and
    drop the file's pages from this process's resident set. The
    mapping stays, so a quantized embedding still reads its rows; they fault back
    in one page at a time."""
    _open_gguf.cache_clear()
    drop_resident_pages(reader.data)


def read_model_args(reader: GGUFFile) -> ModelArgs:
    """Hyperparameters from llama.cpp's metadata keys (`<arch>.block_count`, ...)."""
    name = reader.fields.get("general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ModelLoadError(unsupported("general.architecture", name, GGUF_ARCHITECTURES))
    arch = GGUF_ARCHITECTURES[name]

    def get(key: str, default=None):
        value = reader.fields.get(f"{name}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing {name}.{key}")
        return value

    num_heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    num_layers = int(get("block_count"))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // num_heads)))
    tensors = {t.name: t for t in reader.tensors}
    vocab = reader.fields.get(f"{name}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"])
    if reader.fields.get(f"{name}.attn_logit_softcapping"):
        raise ModelLoadError(f"{name} with attention logit softcapping (Gemma 2's) is not supported.")
    window = reader.fields.get(f"{name}.attention.sliding_window")
    pattern = arch.gguf_swa_pattern
    sliding = tuple(i for i in range(num_layers) if pattern == 0 or i % pattern < pattern - 1) if window else ()
    # no key holds Gemma 3's query_pre_attn_scalar; llama.cpp takes hidden / heads for the 27B (62 layers)
    # and head_dim (our default) for the others
    query_scalar = hidden / num_heads if arch.name == "gemma3" and num_layers == 62 else None
    return ModelArgs(
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        context_length=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_freq_factors=_rope_freq_factors(reader, name, tensors.get("rope_freqs.weight"), head_dim),
        tie_word_embeddings="output.weight" not in tensors,
        architecture=arch.name,
        sliding_window=int(window) if window else None,
        sliding_layers=sliding,
        sliding_rope_theta=(float(reader.fields.get(f"{name}.rope.freq_base_swa", arch.gguf_swa_rope_base))
                            if window and arch.gguf_swa_rope_base is not None else None),
        query_pre_attn_scalar=query_scalar,
        final_logit_softcapping=reader.fields.get(f"{name}.final_logit_softcapping") or None,
    )


def _rope_freq_factors(reader: GGUFFile, arch: str, rope_freqs, head_dim: int) -> tuple[float, ...] | None:
    """Linear scaling's factor for every frequency, or the file's rope_freqs tensor: llama.cpp's
    converter writes Llama 3's per-frequency factors there (and no scaling type)."""
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        factor = reader.fields.get(f"{arch}.rope.scaling.factor")
        if factor is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.rope.scaling.factor")
        return (float(factor),) * (head_dim // 2)
    if scaling not in (None, "none"):
        raise ModelLoadError(f"Unsupported RoPE scaling type {scaling!r} (supported: linear, llama3).")
    if rope_freqs is None:
        return None
    factors = dequantize(rope_freqs.data, GGMLQuantizationType(rope_freqs.tensor_type)).reshape(-1)
    return tuple(float(f) for f in factors)


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of attn_q/attn_k.

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3)...; the converter permutes
    each head's rows so that works. We rotate halves (x0..x31 with x32..x63), as
    Hugging Face does, so we put the rows back.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def load_gguf_tensors(
    reader: GGUFFile,
    args: ModelArgs,
    layers: LayerRange,
    dtype: torch.dtype | None,
    device: torch.device,
    on_tensor: Callable[[], None] = lambda: None,
) -> dict[str, torch.Tensor | QuantizedTensor]:
    """Only the tensors `layers` needs; norms are float32.

    dtype None keeps what the file stores: a type quant.py packs stays a
    QuantizedTensor (a view of the memory-mapped blocks, converted when the model
    is built, block by block), float types stay as stored, and any other
    quantized type is dequantized to bfloat16. A dtype dequantizes everything to it.
    """
    by_name = {t.name: t for t in reader.tensors}
    weights = {}
    for name in needed_tensor_names(layers, args.tie_word_embeddings, args.arch):
        tensor = by_name.get(name)
        if tensor is None:
            raise ModelLoadError(f"GGUF is missing tensor {name!r} needed for layers {layers}.")
        weights[name] = _read(tensor, args, dtype, device)
        on_tensor()
    return weights


def _read(tensor, args: ModelArgs, dtype: torch.dtype | None, device: torch.device):
    """One tensor as the model will hold it (see load_gguf_tensors)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    is_vector = len(tensor.shape) == 1  # norms and biases: float32 always
    if dtype is None and qtype in SUPPORTED and not is_vector:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        return QuantizedTensor(tensor.data, qtype, shape, _row_order(tensor.name, shape[0], args), tensor.name)
    if dtype is None:
        stored = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
                  GGMLQuantizationType.BF16: torch.bfloat16}
        dtype = stored.get(qtype, torch.bfloat16)
    return _to_torch(_dequantize(tensor, args), tensor.name, dtype, device)


def _row_order(name: str, rows: int, args: ModelArgs) -> np.ndarray | None:
    """Where each row of attn_q/attn_k comes from once unpermuted (see unpermute_rope_rows)."""
    if not args.arch.gguf_permutes_qk:
        return None
    heads = {"attn_q.weight": args.num_heads, "attn_k.weight": args.num_kv_heads}
    for suffix, num_heads in heads.items():
        if name.endswith(suffix):
            return unpermute_rope_rows(np.arange(rows)[:, None], num_heads)[:, 0]
    return None


def _dequantize(tensor, args: ModelArgs) -> np.ndarray:
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        array = dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"Tensor {tensor.name} has type {qtype.name}, which the gguf package cannot dequantize. "
            f"Fix: requantize the model (e.g. Q8_0, Q4_K_M) or upgrade gguf."
        ) from None
    array = array.reshape([int(d) for d in reversed(tensor.shape)])  # GGUF lists dims innermost first
    if not args.arch.gguf_permutes_qk:
        return array
    if tensor.name.endswith("attn_q.weight"):
        array = unpermute_rope_rows(array, args.num_heads)
    elif tensor.name.endswith("attn_k.weight"):
        array = unpermute_rope_rows(array, args.num_kv_heads)
    return array


def _to_torch(array: np.ndarray, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
    return tensor.to(device=device, dtype=torch.float32 if tensor.dim() == 1 else dtype)
