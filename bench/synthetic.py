"""A synthetic model in a real shape, for measuring on a model well beyond the last-level cache.

The bundled SmolLM2-135M (98 MB) fits in this machine's 480 MiB L3, so every figure on it
flatters a kernel. This writes a llama-shaped GGUF with random weights (float16, the `gguf`
package's writer, one tensor at a time) and SmolLM2's vocabulary and tokenizer, then has
llama.cpp's own quantizer (`llama_model_quantize` through llama-cpp-python) turn it into the
type asked for, as a user's file would be made. The result is cached under
`~/.cache/skippy/synthetic/` (skippy's cache root) and reused; the float16 intermediate is
deleted. The weights are random: speed, memory and start-up mean something on it, its text
does not.

    python bench/synthetic.py                                   # llama-3.2-3b Q4_K_M: prints the path
    python bench/synthetic.py --shape llama-3.1-8b --type Q4_K_M

Every bench's --model also takes `synthetic` (this default) or `synthetic:SHAPE:TYPE`
(common.resolve_model).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from skippy.model.locate import bundled_model_path, cache_root


@dataclass(frozen=True, slots=True)
class Shape:
    num_layers: int
    hidden: int
    ffn: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 500000.0
    context_length: int = 8192


SHAPES = {  # Meta's published hyperparameters; the vocabulary is SmolLM2's (49152) in every one
    "llama-3.2-3b": Shape(num_layers=28, hidden=3072, ffn=8192, num_heads=24, num_kv_heads=8),
    "llama-3.1-8b": Shape(num_layers=32, hidden=4096, ffn=14336, num_heads=32, num_kv_heads=8),
    "tiny": Shape(num_layers=2, hidden=256, ffn=512, num_heads=4, num_kv_heads=2, context_length=512),
}
# llama.cpp's file types by name (llama_ftype); F16 is written directly, without the quantizer
FILE_TYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
WEIGHT_STD = 0.02  # of every random matmul weight and the embedding, as in a trained model's init


def synthetic_path(shape: str, file_type: str, seed: int = 0) -> Path:
    return cache_root() / "synthetic" / f"{shape}-{file_type}-seed{seed}.gguf"


def synthetic_model(shape: str = "llama-3.2-3b", file_type: str = "Q4_K_M", seed: int = 0,
                    threads: int | None = None, log=print) -> Path:
    """The cached synthetic GGUF, made first when missing (a few minutes for the 3B shape)."""
    if shape not in SHAPES:
        raise SystemExit(f"Expected a shape in {sorted(SHAPES)}, got {shape!r}")
    if file_type not in FILE_TYPES:
        raise SystemExit(f"Expected a type in {sorted(FILE_TYPES)}, got {file_type!r}")
    path = synthetic_path(shape, file_type, seed)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    f16 = synthetic_path(shape, "F16", seed)
    if not f16.is_file():
        started = time.perf_counter()
        log(f"writing {f16} (random float16 weights)")
        write_f16(SHAPES[shape], f16, seed)
        log(f"  {f16.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - started:.0f} s")
    if file_type == "F16":
        return f16
    started = time.perf_counter()
    log(f"quantizing to {file_type} with llama.cpp's llama_model_quantize")
    quantize(f16, path, FILE_TYPES[file_type], threads or os.cpu_count() or 1)
    log(f"  {path} {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - started:.0f} s")
    f16.unlink()
    return path


def write_f16(shape: Shape, path: Path, seed: int) -> None:
    """A llama GGUF with random float16 matmul weights, unit norms, tied embedding, and the
    bundled model's vocabulary and tokenizer; tensors are generated and written one by one."""
    source = GGUFReader(bundled_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    head_dim = shape.hidden // shape.num_heads
    tmp = path.with_suffix(".partial")
    writer = GGUFWriter(tmp, "llama")
    writer.add_name(f"synthetic {path.stem}")
    writer.add_uint32("llama.block_count", shape.num_layers)
    writer.add_uint32("llama.context_length", shape.context_length)
    writer.add_uint32("llama.embedding_length", shape.hidden)
    writer.add_uint32("llama.feed_forward_length", shape.ffn)
    writer.add_uint32("llama.attention.head_count", shape.num_heads)
    writer.add_uint32("llama.attention.head_count_kv", shape.num_kv_heads)
    writer.add_float32("llama.rope.freq_base", shape.rope_theta)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32("llama.vocab_size", vocab)
    writer.add_uint32("llama.rope.dimension_count", head_dim)
    writer.add_uint32("general.file_type", FILE_TYPES["F16"])
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(key, field.contents(), kind, field.types[-1] if kind == GGUFValueType.ARRAY else None)
    tensors = _tensor_shapes(shape, vocab)
    for name, dims in tensors.items():
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in tensors.items():
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:  # row by row chunks: a float32 copy of the largest tensor would be ~600 MB
            data = np.empty(dims, dtype=np.float16)
            for row in range(0, dims[0], 1024):
                part = rng.standard_normal((min(1024, dims[0] - row), dims[1]), dtype=np.float32)
                data[row:row + 1024] = part * WEIGHT_STD
            writer.write_tensor_data(data)
    writer.close()
    tmp.rename(path)


def _tensor_shapes(shape: Shape, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor's [rows, cols] (numpy order) in file order; the head is the tied embedding."""
    d, f, kv = shape.hidden, shape.ffn, shape.num_kv_heads * (shape.hidden // shape.num_heads)
    tensors = {"token_embd.weight": (vocab, d)}
    for i in range(shape.num_layers):
        tensors |= {f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.attn_q.weight": (d, d),
                    f"blk.{i}.attn_k.weight": (kv, d), f"blk.{i}.attn_v.weight": (kv, d),
                    f"blk.{i}.attn_output.weight": (d, d), f"blk.{i}.ffn_norm.weight": (d,),
                    f"blk.{i}.ffn_gate.weight": (f, d), f"blk.{i}.ffn_up.weight": (f, d),
                    f"blk.{i}.ffn_down.weight": (d, f)}
    tensors["output_norm.weight"] = (d,)
    return tensors


def quantize(source: Path, target: Path, ftype: int, threads: int) -> None:
    """llama.cpp's quantizer, as `llama-quantize` runs it (no importance matrix)."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("llama_cpp is not importable: the quantizer comes from llama-cpp-python. "
                         "Fix: pip install -c constraints.txt -e '.[bench-llamacpp]' (see README)") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, threads
    tmp = target.with_suffix(".partial")
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
    if status != 0:
        raise SystemExit(f"llama_model_quantize failed ({status}) on {source}")
    tmp.rename(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-3b", choices=sorted(SHAPES))
    parser.add_argument("--type", default="Q4_K_M", choices=sorted(FILE_TYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="the quantizer's (default: every core)")
    options = parser.parse_args()
    path = synthetic_model(options.shape, options.type, options.seed, options.threads,
                           log=lambda line: print(line, file=sys.stderr))
    print(path)


if __name__ == "__main__":
    main()
