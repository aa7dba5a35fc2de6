"""Build a StageModel from a GGUF file or a Hugging Face directory."""

from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path

import torch

from ..console import progress_bar, say
from . import qkernel
from .args import LayerRange, ModelArgs
from .errors import ModelLoadError
from .gguf_loader import load_gguf_tensors, open_gguf, read_model_args, release
from .hf_loader import load_hf_tensors, read_hf_args
from .llama import StageModel
from .packed_cache import PackedCache
from .quant import QuantizedTensor
from .resident import release_library_pages
from .threads import on_passing_thread
from .weight_arena import WeightArena
from .weights import needed_tensor_names

log = logging.getLogger(__name__)

# "auto": as the file stores it, GGUF quantized types kept quantized (quant.py)
DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# a Hugging Face checkpoint's float matmul weights as 4- or 8-bit codes (--quantize)
QUANTIZE = {"int4": 4, "int8": 8}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """The torch dtype weights load in; None: as stored (and for --quantize's int4/int8)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name in QUANTIZE:
        return None
    if name not in DTYPES:
        raise ValueError(f"Expected a dtype in {sorted(DTYPES) + sorted(QUANTIZE)}, got {name!r}")
    return DTYPES[name]


def open_model(path: Path):
    """(hyperparameters, GGUF reader or None for a Hugging Face directory) of the model at `path`."""
    if path.is_dir():
        return read_hf_args(path), None
    if path.exists():
        reader = open_gguf(path)
        return read_model_args(reader), reader
    raise ModelLoadError(f"Model not found: {path}. Fix: pass --model with a .gguf file or a Hugging Face directory.")


def model_args(path: str | Path) -> ModelArgs:
    """The model's hyperparameters, without loading any weight."""
    return open_model(Path(path))[0]


def load_stage(
    path: str | Path,
    layers: tuple[int, int] | None = None,
    dtype: str | torch.dtype | None = "auto",
    device: str = "auto",
    progress: bool = True,
    repack: bool = False,
    prefill_precision: str = "exact",
) -> StageModel:
    """Load layers [start, end) of the model at `path` (all layers when None).

    `dtype` "auto" keeps the weights as stored (GGUF 4- to 8-bit types packed for
    the kernels/qmatmul.c codes); a float dtype dequantizes to it (float32 is the parity
    reference); "int4"/"int8" (--quantize) turn a Hugging Face checkpoint's matmul
    weights into 4-/8-bit codes per group of 32 for the same kernel.

    `repack`: also keep the matmul weights prepacked for multi-row batches (CPU float32;
    see Linear), unless that copy would take over half the memory still available.

    `prefill_precision`: "exact" or "bf16", how prompts' matmuls run (StageModel).

    Runs on a thread of its own, so the caller's thread gains no OpenMP team (threads.py).
    """
    return on_passing_thread(_load_stage, Path(path), layers, dtype, device, progress, repack, prefill_precision)


def _load_stage(path: Path, layers: tuple[int, int] | None, dtype: str | torch.dtype | None, device: str,
                progress: bool, repack: bool, prefill_precision: str) -> StageModel:
    torch_device, weight_dtype = resolve_device(device), resolve_dtype(dtype)
    release_library_pages()  # torch's start-up code (~65 MiB of RSS), before the weights add theirs
    args, reader = open_model(path)
    is_gguf = reader is not None
    quantize_bits = QUANTIZE.get(dtype) if isinstance(dtype, str) else None
    if quantize_bits and reader is not None:
        raise ValueError(f"--quantize {dtype} is for Hugging Face checkpoints; {path.name} is a GGUF, whose "
                         "quantized blocks are kept as they are. Fix: drop --quantize (the default keeps them)")
    layer_range = LayerRange(*(layers or (0, args.num_layers)), args.num_layers)
    # one step per tensor read, then one per block (and head) built: packing quantized blocks is the slow part
    total = len(needed_tensor_names(layer_range, args.tie_word_embeddings, args.arch)) + layer_range.num_local_layers
    total += layer_range.is_last
    with progress_bar(f"Loading layers {layer_range} of {path.name}", total, progress) as advance:
        if reader is None:
            weights = load_hf_tensors(path, args, layer_range, weight_dtype, torch_device, advance, quantize_bits)
        else:
            weights = load_gguf_tensors(reader, args, layer_range, weight_dtype, torch_device, advance)
            # The weights are views of the file's mapping now: the parsed metadata can go before packing.
            release(reader)
            del reader
            _return_freed_heap()
        packed = (PackedCache.for_model(path) if is_gguf and weight_dtype is None
                  and torch_device.type == "cpu" and qkernel.available() else None)
        arena = WeightArena(packed=packed) if torch_device.type == "cpu" else None
        report = BuildReport(path, layer_range, _stage_bytes(weights), packed, advance)
        model = StageModel(args, layer_range, weights, torch_device, kv_dtype_for(weights), on_built=report.built,
                           arena=arena, prefill_precision=prefill_precision)
        report.done()
    if packed is not None:
        packed.start_writing()  # on a thread of its own: the stage serves meanwhile
    del weights
    _return_freed_heap()
    release_library_pages()  # and the code that loading ran
    if repack:
        repack_if_it_fits(model)
    return model


def _stage_bytes(weights: dict) -> int:
    """The GGUF bytes of a stage's quantized tensors (what packing reads)."""
    return sum(w.raw.nbytes for w in weights.values() if isinstance(w, QuantizedTensor))


class BuildReport:
    """Says on stderr how a stage's weights were made ready when that took a while: packed from
    the GGUF (the first start on a host: a line every few seconds, then the rate) or mapped
    from the packed cache (the rate the disk gave). Also advances the progress bar."""

    EVERY_S = 5.0  # between progress lines while packing
    QUIET_S = 2.0  # a build faster than this says nothing

    def __init__(self, path: Path, layers: LayerRange, stage_bytes: int, packed, advance):
        self.path, self.layers, self.stage_bytes, self.packed, self.advance = path, layers, stage_bytes, packed, advance
        self.started = self.said = time.perf_counter()
        self.blocks = 0

    def built(self) -> None:
        self.advance()
        self.blocks += 1
        now = time.perf_counter()
        if now - self.said >= self.EVERY_S:
            self.said = now
            say(f"preparing layers {self.layers} of {self.path.name}: {self.blocks} of "
                 f"{self.layers.num_local_layers + self.layers.is_last} blocks, {now - self.started:.0f} s")

    def done(self) -> None:
        seconds = time.perf_counter() - self.started
        if seconds < self.QUIET_S:
            return
        mapped = self.packed.loaded_bytes if self.packed is not None else 0
        if mapped:
            say(f"mapped {mapped / 1e6:.0f} MB of packed weights in {seconds:.1f} s ({mapped / 1e6 / seconds:.0f} "
                 f"MB/s) from {self.packed.directory}")
        else:
            kept = f"; kept for the next start in {self.packed.directory}" if self.packed is not None else ""
            say(f"packed {self.stage_bytes / 1e6:.0f} MB of {self.path.name} for this CPU in {seconds:.1f} s "
                 f"({self.stage_bytes / 1e6 / seconds:.0f} MB/s){kept}")


def kv_dtype_for(weights: dict) -> torch.dtype:
    """KV rows in float16, as llama.cpp keeps them (bfloat16's 8-bit mantissa turned the bundled
    model's "capital of France" answer into nonsense); float32 weights, the parity reference,
    keep float32."""
    all_float32 = all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 for w in weights.values())
    return torch.float32 if all_float32 else torch.float16


def _return_freed_heap() -> None:
    """Give the heap that loading freed back to the OS (glibc keeps it otherwise:
    ~80 MB of RSS for the bundled model)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def repack_if_it_fits(model: StageModel) -> int:
    """Repack `model` for batches when the copy fits in half the available memory; returns the bytes added."""
    needed, available = model.repack_bytes, available_memory_bytes()
    if needed and available is not None and needed > available // 2:
        log.warning("not repacking weights for batches: the copy needs %d MiB and %d MiB are available, "
                    "so batched steps run slower. Fix: free memory, or pass --no-repack to go without it quietly",
                    needed >> 20, available >> 20)
        return 0
    added = model.repack_for_batches()
    if added:
        log.info("repacked weights for batches: %d MiB more", added >> 20)
    return added


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where that is unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
