"""What several benches share: the speculative prompts, the CPU clock and resident memory
of processes, and `skippy serve`'s ready line.

Benches run as scripts (`python bench/x.py`), so this directory is on sys.path and
they import it as `common`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

SYNTHETIC = "synthetic"  # --model synthetic[:SHAPE[:TYPE]]: bench/synthetic.py's cached model


def resolve_model(name: str | None) -> str | None:
    """A bench's --model: a path as given, None (the bench's default model), or
    `synthetic[:SHAPE[:TYPE]]` (default llama-3.2-3b, Q4_K_M): bench/synthetic.py's
    file, made first when it is not cached."""
    if name is None or not (name == SYNTHETIC or name.startswith(SYNTHETIC + ":")):
        return name
    from synthetic import synthetic_model

    parts = name.split(":")[1:]
    return str(synthetic_model(*parts, log=lambda line: print(line, file=sys.stderr)))


READY = re.compile(r"skippy: ready: (http://\S+)/v1 ")  # the line `skippy serve` prints when it answers


def start_serve(arguments: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, str]:
    """`skippy serve --port 0 ARGUMENTS` as a subprocess (environment `env`, default this
    process's), once it answers: (the process, its base URL, its ready line). The caller
    terminates the process."""
    process = subprocess.Popen([sys.executable, "-m", "skippy.cli", "serve", "--port", "0", *arguments],
                               stdout=subprocess.PIPE, text=True, env=env)
    for line in process.stdout:
        if match := READY.search(line):
            return process, match.group(1), line.strip()
    raise RuntimeError(f"skippy serve exited with {process.wait()} before it was ready")

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)"""
PRINTING_PRESS = [
    "The history of the printing press begins in the fifteenth century, when movable type made books "
    "cheap enough for merchants, students and craftsmen to own.",
    "Within fifty years presses were running in more than two hundred cities, and the number of books "
    "in Europe grew from thousands to millions.",
    "Printers competed for readers with cheaper paper, smaller formats and new typefaces, and the "
    "pamphlet became the first mass medium: news, sermons and satire travelled faster than any courier "
    "could ride.",
]


def speculative_prompts(num_sentences: int) -> dict[str, str]:
    """Copy-heavy (code, then `num_sentences` of prose) and free-form chat prompts.

    SmolLM2-135M does not copy the code (it rewrites the function in ~30 tokens), but
    it copies the text nearly word for word: that is the copy-heavy prompt."""
    text = " ".join(PRINTING_PRESS[:num_sentences])
    return {
        "copy-code": "Repeat the following code exactly, changing only the function name to order_total:\n\n"
                     f"```python\n{CODE}\n```",
        "copy-text": f"Repeat the following text exactly:\n\n{text}",
        "free-form": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    }


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) of this process and the given ones, from /proc."""
    total = time.process_time()
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def resident(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in bytes: its resident memory now and at its peak, loading included."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024
