"""`torch.inference_mode` for the model's entry points, entered once however they nest.

The runtime runs each forward inside inference mode already, and a decode step calls
`forward` and then `compute_logits`: entering the mode again each time costs ~3 us hot,
several times that where a step's Python runs cold.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def inference_mode(fn: F) -> F:
    """`fn` in inference mode: entered here unless the caller is in it already."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]
