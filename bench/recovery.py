"""How long a stream pauses when a stage dies under it, and whether it still says the same.

`skippy serve --stages 3` (the bundled model); each round streams one greedy completion,
SIGKILLs a stage process (the middle one by default) after --kill-at tokens, and measures the
gap from the last token before the kill to the next one after it: the supervisor's restart
(backoff + the stage's start-up) and stage 0's replay of the prompt and committed tokens.
Every round's text is compared with an uninterrupted run's. Kills are --up-s apart, so each is
a first failure (restarts in a row back off 0.5, 1, 2, 4, 8 s).

    python bench/recovery.py [--kills 10] [--stage 1] [--kill-at 20] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from common import READY, resolve_model

MODEL = "SmolLM2-135M-Instruct.Q4_1"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "temperature": 0, "stream": True, "logit_bias": {"0": -100, "2": -100}}


def stage_pid(serve_pid: int, index: int) -> int:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != serve_pid:
                continue
            if f"stage-{index}.json" in (stat.parent / "cmdline").read_text():
                return int(stat.parent.name)
        except (OSError, ValueError):
            continue
    raise RuntimeError(f"no process for stage {index}")


def stream(url: str, max_tokens: int, model: str, on_piece=None) -> tuple[str, list[float]]:
    """(the text, the arrival time of every content piece)."""
    pieces, times = [], []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**BODY, "model": model, "max_tokens": max_tokens},
                      timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream ended with an error: {event['error']['message']}")
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                pieces.append(event["choices"][0]["delta"]["content"])
                times.append(time.perf_counter())
                if on_piece is not None:
                    on_piece(len(pieces))
    return "".join(pieces), times


def main(args: argparse.Namespace) -> None:
    command = [sys.executable, "-m", "skippy.cli", "serve", "--stages", "3", "--port", "0",
               "--max-restarts", "3", *(["--model", args.model] if args.model else [])]
    model = Path(args.model).stem if args.model else MODEL
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = next(READY.search(line).group(1) for line in process.stdout if READY.search(line))
        threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
        reference, _ = stream(url, args.max_tokens, model)
        gaps, same = [], 0
        for kill in range(args.kills):
            while httpx.get(url + "/readyz").status_code != 200:
                time.sleep(0.1)
            time.sleep(args.up_s)  # up this long, the next kill is a first failure (no growing backoff)
            killed_at: list[float] = []

            def kill_now(count: int) -> None:
                if count == args.kill_at:
                    os.kill(stage_pid(process.pid, args.stage), signal.SIGKILL)
                    killed_at.append(time.perf_counter())

            text, times = stream(url, args.max_tokens, model, kill_now)
            after = [t for t in times if t > killed_at[0]]
            gaps.append(after[0] - killed_at[0])
            same += text == reference
            print(f"kill {kill + 1}/{args.kills}: next token {gaps[-1]:.2f} s after the kill; "
                  f"text {'identical' if text == reference else 'DIFFERENT'}", flush=True)
        print(f"\nstage {args.stage} of 3 SIGKILLed {args.kills} times after {args.kill_at} streamed "
              f"pieces: kill -> next token median {statistics.median(gaps):.2f} s (min {min(gaps):.2f}, "
              f"max {max(gaps):.2f}); identical text {same}/{args.kills}")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=resolve_model, default=None,
                        help="GGUF file, or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2)")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--stage", type=int, default=1, help="which stage to kill (1 or 2)")
    parser.add_argument("--kill-at", type=int, default=20, help="streamed pieces before the kill")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--up-s", type=float, default=10.5,
                        help="seconds a stage runs between kills (past the supervisor's STABLE_S)")
    main(parser.parse_args())
