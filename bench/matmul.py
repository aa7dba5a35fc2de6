"""One stage's matmuls at 1 to 256 rows: MKL on the plain weights vs the repacked copy.

A stage runs every matmul weight it owns (qkv, output, gate+up, down per layer,
plus the head on the last stage) on the same input rows, once through the plain
weights (`skippy --no-repack`: MKL, decode layout) and once through the copy
prepacked by oneDNN (the default for several rows on CPU float32). A stage runs one
row on the plain weights whatever the setting; the last column is what it runs. The two arms alternate within every round, so a noisy
neighbour hurts both alike; the table shows medians over rounds, after a warm-up.

    python bench/matmul.py                              # layers [0, 15) of SmolLM2, 1 thread
    python bench/matmul.py --layers 19,30 --rows 1,4,8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import resolve_model
from skippy.console import progress_bar
from skippy.model.layers import linear
from skippy.model.loader import load_stage
from skippy.model.locate import bundled_model_path


def timed_ms(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=resolve_model, default=None,
                        help="GGUF or HF directory or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2)")
    parser.add_argument("--layers", default="0,15", help="the stage's layer range start,end")
    parser.add_argument("--rows", default="1,2,4,8,16,64,256", help="row counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start, end = (int(v) for v in args.layers.split(","))
    model = load_stage(args.model or bundled_model_path(), (start, end), dtype="float32", device="cpu",
                       progress=False, repack=True)
    linears = model.linears
    if not all(layer.batched is not None for layer in linears):
        raise SystemExit("bench/matmul.py: the weights were not repacked (oneDNN missing, or too little memory)")
    weight_mib = sum(layer.weight.nbytes for layer in linears) / 2**20

    results: dict[int, dict[str, list[float]]] = {}
    row_counts = [int(r) for r in args.rows.split(",")]
    with progress_bar("Timing matmuls", len(row_counts) * (args.rounds + 1)) as advance:
        for rows in row_counts:
            inputs = [torch.randn(rows, layer.weight.shape[1]) for layer in linears]
            arms = {
                "mkl": lambda: [linear(x, layer.weight) for x, layer in zip(inputs, linears)],
                "repacked": lambda: [layer.through_repacked(x) for x, layer in zip(inputs, linears)],
            }
            times = results[rows] = {name: [] for name in arms}
            with torch.inference_mode():
                for round_index in range(args.rounds + 1):  # round 0 warms up
                    for name, fn in arms.items():
                        elapsed = timed_ms(fn)
                        if round_index:
                            times[name].append(elapsed)
                    advance()

    print(f"\nlayers [{start}, {end}){' + head' if model.layers.is_last else ''}: {len(linears)} weights, "
          f"{weight_mib:.0f} MiB float32, {args.threads} thread(s), medians of {args.rounds} rounds")
    print(f"{'rows':>5} {'MKL ms':>9} {'repacked ms':>12} {'MKL/repacked':>13} {'stage runs / 1 row':>19}")
    one_row = statistics.median(results[1]["mkl"]) if 1 in results else None
    for rows, times in results.items():
        mkl, repacked = statistics.median(times["mkl"]), statistics.median(times["repacked"])
        used = mkl if rows == 1 else repacked  # what a stage runs: one row stays on MKL
        versus = f"{used / one_row:.2f}x" if one_row else "-"
        print(f"{rows:>5} {mkl:>9.1f} {repacked:>12.1f} {mkl / repacked:>12.2f}x {versus:>19}")


if __name__ == "__main__":
    main()
