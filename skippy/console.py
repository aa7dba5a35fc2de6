"""Terminal progress bars and quiet structured logging (a leaf module: imports no skippy code)."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator[callable]:
    """Yield `advance(n=1)`; draws a bar on stderr only when it is a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield lambda n=1: None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
        console=None,
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)


def say(line: str) -> None:
    """One line of what skippy did, on stderr (stdout carries the ready line)."""
    print(f"skippy: {line}", file=sys.stderr, flush=True)


def configure_logging(level: str = "WARNING") -> None:
    """key=value log lines on stderr; quiet (warnings only) unless asked."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.WARNING),
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
        stream=sys.stderr,
    )
