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
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    transformers = pytest.importorskip("transformers")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()
