"""Speculative decoding on a 2-stage chain: decode speed with speculation off vs n-gram proposers.

Stage 1 is a separate process on loopback (as `skippy serve` starts it); stage 0 runs
here and drives the chain. Each arm generates the greedy continuation of two
copy-heavy prompts (code, text) and a free-form one, stopping at end-of-generation or
--max-tokens; the "= off" column checks that it is the same continuation. One round
runs every arm once on every prompt, in turn, so the machine's slow spells fall on
all of them alike (each round also rotates the order of the arms); the table shows
medians over the rounds, after one warm-up round that is not counted.

    decode tok/s: tokens after the first / time after the first (the prefill is excluded)
    CPU ms/token: CPU time (user + system) of both stage processes over the same span,
                  per token: the work a token costs, which other load on the machine
                  changes much less than it changes the wall time
    acceptance:   accepted drafts / proposed drafts
    windows:      verify windows (one chain trip each) and plain decode steps, per request

    python bench/speculative.py                          # bundled SmolLM2, 5 rounds, 1 thread per stage, window 1..16
    python bench/speculative.py --rounds 9 --max-window 8 --depth 2   # adds pipelined arms
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # an idle stage must not spin on the cores

import torch  # noqa: E402

from skippy.launch.local_chain import LocalChain  # noqa: E402
from skippy.model.locate import bundled_model_path  # noqa: E402
from skippy.model.tokenizer import Tokenizer  # noqa: E402
from skippy.runtime.speculation import SpeculativeSettings  # noqa: E402

from common import cpu_seconds, resolve_model, speculative_prompts  # noqa: E402

PROMPTS = speculative_prompts(3)
GOALS = {"copy-text": 1.8, "free-form": 0.95}  # ngram-suffix decode tok/s vs off


@dataclass
class Runs:
    decode_tok_s: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)  # CPU ms per decode token, every process
    tokens: list[int] = field(default_factory=list)  # the last round's output
    figures: list[dict] = field(default_factory=list)  # ChainDecoder.report() per counted run

    def total(self, name: str) -> float:
        return sum(f.get(name, 0) for f in self.figures)


async def run_once(client, pids, prompt, settings, options, runs: Runs | None) -> None:
    stamps: list[float] = []
    cpu: list[float] = []

    def on_token(_) -> None:
        stamps.append(time.perf_counter())
        if len(stamps) == 1:
            cpu.append(cpu_seconds(pids))

    result = await client.generate(prompt, max_tokens=options.max_tokens, stop_ids=options.stop_ids,
                                   speculative=settings, on_token=on_token)
    cpu_end = cpu_seconds(pids)
    if runs is not None and len(stamps) > 1:
        runs.decode_tok_s.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        runs.cpu_ms.append((cpu_end - cpu[0]) / (len(stamps) - 1) * 1e3)
        runs.tokens = result.tokens
        runs.figures.append(result.speculation)


def arms(options) -> dict[str, SpeculativeSettings]:
    out = {"off": SpeculativeSettings()}
    for mode in ("ngram-suffix", "ngram-simple"):
        out[mode] = SpeculativeSettings(mode, options.min_window, options.max_window)
    if options.depth > 1:
        out[f"ngram-suffix/d{options.depth}"] = SpeculativeSettings("ngram-suffix", options.min_window,
                                                                    options.max_window, options.depth)
    return out


def report(options, results: dict[tuple[str, str], Runs], arm_names: list[str]) -> None:
    print(f"\n2-stage chain (stage 1 a separate process), bundled SmolLM2-135M, torch threads "
          f"{options.threads} per stage, greedy, up to {options.max_tokens} tokens, window "
          f"{options.min_window}..{options.max_window}, load average {os.getloadavg()[0]:.1f}, "
          f"{options.rounds} interleaved rounds (medians)")
    header = (f"{'prompt':<10} {'arm':<16} {'tokens':>6} {'decode tok/s':>12} {'min..max':>13} "
              f"{'vs off':>7} {'CPU ms/tok':>10} {'CPU vs off':>10} {'acceptance':>10} {'acc/prop':>9} "
              f"{'windows':>8} {'plain':>6} "
              f"{'mean width':>10} {'= off':>5}")
    print(header)
    print("-" * len(header))
    for prompt_name in PROMPTS:
        off = statistics.median(results[prompt_name, "off"].decode_tok_s)
        off_cpu = statistics.median(results[prompt_name, "off"].cpu_ms)
        for arm in arm_names:
            runs = results[prompt_name, arm]
            median = statistics.median(runs.decode_tok_s)
            cpu_ms = statistics.median(runs.cpu_ms)
            rounds = max(1, len(runs.figures))
            windows = runs.total("speculative_num_windows") / rounds
            plain = runs.total("speculative_num_empty_proposals") / rounds
            proposed, accepted = runs.total("speculative_num_proposed_tokens"), runs.total(
                "speculative_num_accepted_tokens")
            is_spec = arm != "off"
            print(f"{prompt_name:<10} {arm:<16} {len(runs.tokens):>6} {median:>12.1f} "
                  f"{min(runs.decode_tok_s):>6.1f}..{max(runs.decode_tok_s):<6.1f} "
                  f"{median / off:>6.2f}x {cpu_ms:>10.1f} {off_cpu / cpu_ms:>9.2f}x "
                  f"{(f'{accepted / proposed:.0%}' if proposed else '-') if is_spec else '-':>10} "
                  f"{f'{accepted:.0f}/{proposed:.0f}' if is_spec else '-':>9} "
                  f"{f'{windows:.1f}' if is_spec else '-':>8} {f'{plain:.1f}' if is_spec else '-':>6} "
                  f"{f'{proposed / rounds / windows:.2f}' if is_spec and windows else '-':>10} "
                  f"{'yes' if runs.tokens == results[prompt_name, 'off'].tokens else 'NO':>5}")
    print()
    for prompt_name, goal in GOALS.items():
        off = statistics.median(results[prompt_name, "off"].decode_tok_s)
        ratio = statistics.median(results[prompt_name, "ngram-suffix"].decode_tok_s) / off
        cpu_ratio = (statistics.median(results[prompt_name, "off"].cpu_ms)
                     / statistics.median(results[prompt_name, "ngram-suffix"].cpu_ms))
        verdict = "met" if ratio >= goal else "NOT met"
        print(f"goal {prompt_name}: ngram-suffix decode tok/s >= {goal:.2f}x off: {ratio:.2f}x ({verdict}); "
              f"CPU per token {cpu_ratio:.2f}x less")


async def main(options) -> None:
    torch.set_num_threads(options.threads)
    path = options.model or bundled_model_path()
    tokenizer = Tokenizer.from_gguf(path)
    options.stop_ids = tokenizer.eog_ids
    prompts = {name: tokenizer.encode_chat([{"role": "user", "content": text}])
               for name, text in PROMPTS.items()}
    arm_settings = arms(options)
    results = {(p, arm): Runs() for p in prompts for arm in arm_settings}
    chain = LocalChain(path, 2, threads=options.threads, ctx_size=2048)
    async with chain as client:
        pids = [process.pid for process in chain.processes]
        names = list(arm_settings)
        for round_index in range(options.rounds + 1):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for prompt_name, prompt in prompts.items():
                for arm in order:
                    runs = results[prompt_name, arm] if round_index else None
                    await run_once(client, pids, prompt, arm_settings[arm], options, runs)
            if round_index:
                print(f"round {round_index}/{options.rounds}: " + "  ".join(
                    f"{p} {arm} {results[p, arm].decode_tok_s[-1]:.1f}"
                    for p in prompts for arm in arm_settings), flush=True)
            else:
                print("warm-up done", flush=True)
    report(options, results, list(arm_settings))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=resolve_model, default=None,
                        help="GGUF file, or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2)")
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (after one warm-up)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--min-window", type=int, default=1, help="the adaptive window's fewest drafts")
    # 16: on this CPU a 9-row verify costs ~4x a 1-row step, so long copies need wide
    # windows (copy-text 1.87x at 16 vs 1.62x at 8); copy-code, with ~50-75%
    # acceptance, does better at 8 (1.38x vs 1.14x).
    parser.add_argument("--max-window", type=int, default=16, help="the adaptive window's most drafts")
    parser.add_argument("--depth", type=int, default=1, help="> 1 adds a pipelined ngram-suffix arm")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every stage")
    asyncio.run(main(parser.parse_args()))
