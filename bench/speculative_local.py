"""Speculative decoding in one process: decode speed with speculation off vs n-gram proposers.

Each arm generates the same greedy continuation (checked: the "= off" column) of
a copy-heavy prompt and a free-form one, stopping at end-of-generation or
--max-tokens. One round runs every arm once on every prompt, in turn, so the
machine's slow spells fall on all of them alike, and each round starts the arms
one place further along (a fixed order favoured whichever ran first by ~10%);
the table shows medians over the rounds, after one warm-up round that is not counted.

    decode tok/s: tokens after the first / time after the first (the prefill is excluded);
                  --clock cpu times this process's CPU instead of the wall, which other
                  processes on a shared machine disturb less
    acceptance:   accepted drafts / proposed drafts

    python bench/speculative_local.py                      # bundled SmolLM2, 5 rounds, 1 thread
    python bench/speculative_local.py --rounds 9 --max-window 16 --threads 2 --clock cpu
    python bench/speculative_local.py --draft-model PATH.gguf   # adds the draft arm
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from skippy.model.loader import load_stage
from skippy.model.tokenizer import Tokenizer
from skippy.runtime.local_generation import GenerationLimits
from skippy.runtime.local_speculative import generate_tokens_speculative
from skippy.runtime.speculation import AdaptiveWindow, SpeculationStats, create_proposer

from common import resolve_model, speculative_prompts

PROMPTS = speculative_prompts(2)
NGRAM_ARMS = ["ngram-suffix", "ngram-simple"]
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass
class Runs:
    decode_tok_s: list[float] = field(default_factory=list)
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    tokens: list[int] = field(default_factory=list)  # the last round's output


def run_once(model, prompt, arm, options, draft_model, runs: Runs | None) -> None:
    proposer = None
    if arm == "draft":
        proposer = create_proposer("draft", model=draft_model)
    elif arm != "off":
        proposer = create_proposer(arm)
    stats = SpeculationStats()
    window = AdaptiveWindow(1, options.max_window)
    limits = GenerationLimits(options.max_tokens, options.stop_ids)
    clock = CLOCKS[options.clock]
    tokens, first_at = [], 0.0
    for token in generate_tokens_speculative(model, prompt, limits, proposer, window=window, stats=stats):
        tokens.append(token)
        if len(tokens) == 1:
            first_at = clock()
    finished = clock()
    if runs is not None and len(tokens) > 1:
        runs.decode_tok_s.append((len(tokens) - 1) / (finished - first_at))
        runs.stats += stats
        runs.tokens = tokens


def results_table(options, arms, results: dict[tuple[str, str], Runs]) -> Table:
    title = (f"medians of {options.rounds} rounds, {options.threads} threads, window 1..{options.max_window}, "
             f"{options.clock} clock")
    table = Table(title=title)
    columns = ["prompt", "arm", "tokens", "decode tok/s", "min..max", "vs off", "acceptance",
               "accepted/proposed", "windows", "mean accepted", "= off"]  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("prompt", "arm") else "right")
    for prompt_name in PROMPTS:
        off = results[prompt_name, "off"]
        for arm in arms:
            runs = results[prompt_name, arm]
            if not runs.decode_tok_s:
                table.add_row(prompt_name, arm, "0", *["-"] * 8)
                continue
            median = statistics.median(runs.decode_tok_s)
            s = runs.stats
            table.add_row(
                prompt_name,
                arm,
                str(len(runs.tokens)),
                f"{median:.1f}",
                f"{min(runs.decode_tok_s):.1f}..{max(runs.decode_tok_s):.1f}",
                f"{median / statistics.median(off.decode_tok_s):.2f}x",
                f"{s.acceptance_rate:.0%}" if arm != "off" else "-",
                f"{s.num_accepted_tokens}/{s.num_proposed_tokens}" if arm != "off" else "-",
                str(s.num_windows),
                f"{s.mean_accepted_per_window:.2f}" if arm != "off" else "-",
                "yes" if runs.tokens == off.tokens else "NO",
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=resolve_model,
                        help="GGUF file or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2-135M Q4_1)")
    parser.add_argument("--draft-model", help="GGUF file for the draft arm (off by default)")
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (after one warm-up)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-window", type=int, default=8, help="the adaptive window's most drafts")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    options = parser.parse_args()
    if options.model is None:
        from skippy.model.locate import bundled_model_path

        options.model = str(bundled_model_path())
    path = Path(options.model)
    torch.set_num_threads(options.threads)
    console = Console()
    if not console.is_terminal:  # piped to a file: wide enough for the table
        console = Console(width=160)
    console.print(f"model: {path}  threads: {options.threads}  torch {torch.__version__}")

    with console.status("Loading"):
        model = load_stage(path, progress=False)
        draft_model = load_stage(options.draft_model, progress=False) if options.draft_model else None
    tokenizer = Tokenizer.from_gguf(path)
    options.stop_ids = tokenizer.eog_ids
    prompts = {name: tokenizer.encode_chat([{"role": "user", "content": text}])
               for name, text in PROMPTS.items()}  # fmt: skip
    arms = ["off", *NGRAM_ARMS, *(["draft"] if draft_model else [])]
    results = {(p, arm): Runs() for p in prompts for arm in arms}

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("warm-up", total=(options.rounds + 1) * len(results))
        for round_index in range(options.rounds + 1):
            label = "warm-up" if round_index == 0 else f"round {round_index}/{options.rounds}"
            turn = round_index % len(arms)
            for prompt_name, prompt in prompts.items():
                for arm in arms[turn:] + arms[:turn]:
                    progress.update(task, description=f"{label}: {prompt_name} {arm}")
                    runs = results[prompt_name, arm] if round_index else None
                    run_once(model, prompt, arm, options, draft_model, runs)
                    progress.advance(task)

    console.print(f"greedy, up to {options.max_tokens} tokens, stopping at end-of-generation; "
                  "acceptance over all counted rounds")  # fmt: skip
    console.print(results_table(options, arms, results))


if __name__ == "__main__":
    main()
