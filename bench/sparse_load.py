"""Memory of sparse stage loads: RSS and parameter bytes per layer range.

Each range loads in a fresh subprocess, so no range sees another's pages or the
parent's imports. The first RSS figure is taken after `import torch` and skippy, so later
columns show what the metadata, the load and the first read of the weights add.

    python bench/sparse_load.py                       # bundled SmolLM2 GGUF, [0,15) [15,30) [0,30)
    python bench/sparse_load.py --model DIR --ranges 0:8,8:16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import resolve_model

MIB = 1 << 20

# Runs in the child: argv = [model, start, end, dtype]. Prints one JSON line.
# The metadata is read first (the loader reuses the cached GGUF reader) so the
# reader's own memory shows apart from the weights'. Weights read from safetensors
# are file-backed mmap pages that count in RSS only once read, so every parameter
# is read once before the last figure.
CHILD = """
import gc, json, resource, sys, time
from pathlib import Path
import psutil
import torch
from skippy.model.gguf_loader import open_gguf, read_model_args
from skippy.model.hf_loader import read_hf_args
from skippy.model.loader import load_stage

path, start, end, dtype = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rss = lambda: psutil.Process().memory_info().rss
rss_imports = rss()
started = time.perf_counter()
read_hf_args(path) if path.is_dir() else read_model_args(open_gguf(path))
rss_metadata = rss()
model = load_stage(path, (start, end), dtype=dtype, device="cpu", progress=False)
seconds = time.perf_counter() - started
gc.collect()
rss_loaded = rss()
tensors = [t for b in model.blocks for t in (b.attn_norm, b.ffn_norm)]
tensors += [t for linear in model.linears for t in linear.tensors]
tensors += [model.embedding] if isinstance(model.embedding, torch.Tensor) else []
for t in tensors:
    t.float().sum()  # reads every page
print(json.dumps({
    "parameter_bytes": model.parameter_bytes,
    "rss_imports": rss_imports,
    "rss_metadata": rss_metadata,
    "rss_loaded": rss_loaded,
    "rss_touched": rss(),
    "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
    "seconds": seconds,
}))
"""

# RSS columns: after imports, after reading metadata, after load_stage, after reading every parameter.
RSS_KEYS = ("rss_imports", "rss_metadata", "rss_loaded", "rss_touched", "peak_rss")
COLUMNS = ("layers", "params", "RSS imports", "RSS metadata", "RSS loaded", "RSS touched", "peak RSS", "load s")


def measure(model: str, start: int, end: int, dtype: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(start), str(end), dtype],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"Loading [{start}, {end}) failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def parse_ranges(text: str) -> list[tuple[int, int]]:
    ranges = []
    for item in text.split(","):
        start, _, end = item.partition(":")
        if not (start.isdigit() and end.isdigit()):
            raise SystemExit(f"Expected ranges like 0:15,15:30, got {item!r}")
        ranges.append((int(start), int(end)))
    return ranges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=resolve_model,
                        help="GGUF file, Hugging Face directory or synthetic[:SHAPE[:TYPE]] (default: SmolLM2)")
    parser.add_argument("--ranges", default="0:15,15:30,0:30", help="comma-separated start:end layer ranges")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    options = parser.parse_args()
    if options.model is None:
        from skippy.model.locate import bundled_model_path

        options.model = str(bundled_model_path())

    print(f"model: {options.model}  dtype: {options.dtype}  (sizes in MiB)")
    rows = []
    for start, end in parse_ranges(options.ranges):
        m = measure(options.model, start, end, options.dtype)
        rows.append((
            f"[{start}, {end})",
            f"{m['parameter_bytes'] / MIB:.0f}",
            *(f"{m[key] / MIB:.0f}" for key in RSS_KEYS),
            f"{m['seconds']:.1f}",
        ))  # fmt: skip
    widths = [max(len(str(cell)) for cell in column) for column in zip(COLUMNS, *rows)]
    for row in (COLUMNS, *rows):
        print("  ".join(str(cell).rjust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    main()
