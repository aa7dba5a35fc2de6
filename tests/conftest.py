"""Shared fixtures: the bundled GGUF and the transformers reference built from it.

transformers takes ~30 s to convert the GGUF, so each reference is built once per
test session.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from skippy.model.locate import bundled_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    import transformers  # the oracle: missing, it fails the run (never a skip)
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    import transformers  # the oracle: missing, it fails the run (never a skip)
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def full_weights(gguf_path):
    """(args, float32 weights of every layer), dequantized once per session."""
    import torch

    from skippy.model.args import LayerRange
    from skippy.model.gguf_loader import load_gguf_tensors, open_gguf, read_model_args

    reader = open_gguf(gguf_path)
    args = read_model_args(reader)
    weights = load_gguf_tensors(reader, args, LayerRange.full(args.num_layers), torch.float32, torch.device("cpu"))
    return args, weights


@pytest.fixture(scope="session")
def make_stage(full_weights):
    """make_stage(start, end) -> StageModel sharing the session's weights."""
    import torch

    from skippy.model.args import LayerRange
    from skippy.model.llama import StageModel

    args, weights = full_weights

    def make(start: int = 0, end: int | None = None) -> StageModel:
        layers = LayerRange(start, args.num_layers if end is None else end, args.num_layers)
        return StageModel(args, layers, weights, torch.device("cpu"))

    return make


@pytest.fixture(scope="session")
def quant_weights(gguf_path):
    """(args, weights as `--dtype auto` loads them): QuantizedTensors, views of the GGUF's blocks."""
    import torch

    from skippy.model.args import LayerRange
    from skippy.model.gguf_loader import load_gguf_tensors, open_gguf, read_model_args

    reader = open_gguf(gguf_path)
    args = read_model_args(reader)
    return args, load_gguf_tensors(reader, args, LayerRange.full(args.num_layers), None, torch.device("cpu"))


@pytest.fixture(scope="session")
def make_quant_stage(quant_weights):
    """make_quant_stage(start, end) -> StageModel on the quantized path (packed anew each call)."""
    import torch

    from skippy.model.args import LayerRange
    from skippy.model.llama import StageModel
    from skippy.model.loader import kv_dtype_for

    args, weights = quant_weights

    def make(start: int = 0, end: int | None = None) -> StageModel:
        layers = LayerRange(start, args.num_layers if end is None else end, args.num_layers)
        return StageModel(args, layers, weights, torch.device("cpu"), kv_dtype=kv_dtype_for(weights))

    return make


@pytest.fixture(scope="session")
def tokenizer(gguf_path):
    from skippy.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_path)


def pytest_terminal_summary(terminalreporter):
    """Every numeric comparison's observed error and bound, tightest first, so the
    next tolerance about to fail on some machine shows before it does."""
    from numerics import MARGINS

    statistical = sorted((m for m in MARGINS if not m.worst_case), key=lambda m: m.ratio)
    worst_case = [m for m in MARGINS if m.worst_case]
    if not MARGINS:
        return
    terminalreporter.section("numeric margins (bound / observed, tightest first; tests/numerics.py)")
    for margin in statistical[:12]:
        terminalreporter.write_line(
            f"{margin.ratio:9.1f}x  observed {margin.observed:.3g}  bound {margin.limit:.3g}  {margin.what}"
        )
    if len(statistical) > 12:
        terminalreporter.write_line(f"... and {len(statistical) - 12} comparisons with more room")
    if worst_case:
        tightest = min(worst_case, key=lambda m: m.ratio)
        terminalreporter.write_line(f"{len(worst_case)} provable worst-case bounds hold, the tightest at "
                                    f"{tightest.ratio:.1f}x: {tightest.what}")
