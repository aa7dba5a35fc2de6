"""Which thread runs parallel work, and why it matters.

libgomp (torch's OpenMP and our kernels alike) gives every thread that opens a parallel
region a team of worker threads of its own, kept until that thread exits. Once a process
holds more such threads than it has cores, libgomp stops letting idle workers spin (100
spins instead of ~300,000) and every parallel region of a decode step pays a futex
wake-up: decoding then ran at about a third of its speed (docs/decisions.md).

So a process runs its model on one long-lived thread (the stage's engine, see
stage/engine.py), and one-off parallel work, loading above all, runs on a thread that
exits when it is done and takes its team with it.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def on_passing_thread(fn: Callable[..., T], /, *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread that ends with it; its result or exception here."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as error:  # re-raised on the calling thread
            outcome.append((False, error))

    thread = threading.Thread(target=run, name=f"skippy-{getattr(fn, '__name__', 'work')}", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


# libgomp's idle workers spin ~300,000 pauses (milliseconds here) before they sleep. Stages
# that share one machine's cores take turns on a single stream, so a stage that has
# finished its forward must let the next one have the cores soon; but a spin shorter than
# the gaps between a step's own kernels (Python between them) puts the team to sleep
# mid-step. One process alone keeps the default. The figures: docs/decisions.md.
CO_LOCATED_SPIN_COUNT = "10000"
# A model whose decode steps run in one kernel call (qkernel.DecodeLayers) has no Python
# between a step's parallel regions, so its workers can give the cores up sooner.
ONE_CALL_SPIN_COUNT = "1000"


def lower_priority() -> None:
    """This thread at the lowest CPU priority (nice 19): background work (a holder's reads, a
    cached slice's check) takes the cores only when the model's threads leave them. Threads
    it starts inherit it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass  # not permitted here: at the process's priority, then


def co_located_spin_count(model: str | Path | None = None, dtype: str = "auto") -> str:
    """GOMP_SPINCOUNT for stages of `model` (loaded with --dtype `dtype`) that share cores."""
    if model is not None and decodes_in_one_call(model, dtype):
        return ONE_CALL_SPIN_COUNT
    return CO_LOCATED_SPIN_COUNT


def set_spin_count(count: int | str | None) -> None:
    """The one place that sets this process's libgomp idle spin (GOMP_SPINCOUNT), which libgomp
    reads once, when torch loads it: a stage's spec says it (StageConfig.omp_spin_count), the
    process's entry point applies it first thing. None, or a GOMP_SPINCOUNT the user set
    already: libgomp's or the user's own."""
    if count is None or "GOMP_SPINCOUNT" in os.environ:
        return
    if "torch" in sys.modules:
        log.warning("GOMP_SPINCOUNT set after torch loaded: it does not apply to this process")
    os.environ["GOMP_SPINCOUNT"] = str(count)


def spin_for_co_located_stages(model: str | Path | None = None, dtype: str = "auto") -> None:
    """This process's spin when it is stage 0 of stages that share its cores."""
    set_spin_count(co_located_spin_count(model, dtype))


def decodes_in_one_call(model: str | Path, dtype: str = "auto") -> bool:
    """Whether this model's decode steps will run in one kernel call (llama.py's
    _decode_layers), judged from the GGUF without torch: its quantized llama-family
    blocks on our kernels (a C compiler to build them), every matmul in a type and shape
    the kernel packs. tests/test_model_threads.py holds it to what loading then does."""
    path = Path(model)
    if dtype != "auto" or not path.is_file() or shutil.which(os.environ.get("CC", "cc")) is None:
        return False
    from .architecture import GGUF_ARCHITECTURES
    from .gguf_file import GGUFFile
    from .gguf_types import SUPPORTED

    try:
        gguf = GGUFFile(path)
    except (OSError, ValueError):  # not a GGUF: loading says why
        return False
    name = gguf.fields.get("general.architecture")
    arch = GGUF_ARCHITECTURES.get(name)
    if (arch is None or arch.qkv_bias or arch.qk_norm or arch.post_norms or arch.activation != "silu"
            or f"{name}.rope.freq_base_swa" in gguf.fields):
        return False
    # GGUF lists a matmul's dimensions innermost first: [in, out]
    matmuls = [t for t in gguf.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return bool(matmuls) and all(t.tensor_type in SUPPORTED and t.shape[1] % 16 == 0 and t.shape[0] % 32 == 0
                                 for t in matmuls)
