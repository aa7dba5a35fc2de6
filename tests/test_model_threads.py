"""Loading leaves the caller's thread without an OpenMP team (skippy/model/threads.py).

libgomp keeps a team of workers for every thread that ever opened a parallel
region; with more of them than cores it stops letting idle workers spin, and a
decode step on the runtime's thread measured 53 instead of 138 tok/s here when
the model had been loaded on another thread. So the team that loading opens must
leave with the thread that loading ran on.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from skippy.model.loader import load_stage
from skippy.model.threads import on_passing_thread


def thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def new_threads(before: set[str], timeout_s: float = 5.0) -> set[str]:
    """Threads that were not there `before`, once exiting ones are gone (or at the timeout).
    Other tests' threads ending meanwhile do not count: only new ones are compared."""
    deadline = time.monotonic() + timeout_s
    while (new := thread_ids() - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return new


@pytest.fixture(autouse=True)
def every_core():
    """A team needs 2+ threads; an earlier test (a LocalChain with threads=1) may have set 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, os.cpu_count() or 2))
    yield
    torch.set_num_threads(before)


def opens_team() -> None:
    torch.ones(1 << 22).sum()  # big enough for torch's parallel_for to open a region


def test_a_parallel_region_leaves_a_team_on_its_thread():
    """The premise: without a passing thread, the caller keeps a team (so the test below can fail)."""
    seen = {}

    def body() -> None:
        before = thread_ids()
        opens_team()
        seen["new"] = new_threads(before, timeout_s=0.5)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["new"]  # the team's workers


def test_load_and_passing_work_leave_no_team_behind(gguf_path):
    seen = {}

    def body() -> None:
        before = thread_ids()
        model = load_stage(gguf_path, (0, 2), progress=False)
        on_passing_thread(opens_team)
        seen["new"] = new_threads(before)
        seen["blocks"] = len(model.blocks)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["blocks"] == 2
    assert not seen["new"]  # without the passing thread: its team stays


def test_passing_thread_returns_the_result_and_raises_the_error():
    assert on_passing_thread(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(KeyError, match="gone"):
        on_passing_thread(lambda: {}["gone"])


def test_co_located_spin_is_set_before_torch_loads_and_left_to_the_user():
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: the CLI sets it first
    (skippy/cli.py), and a value the user exported wins."""
    import subprocess
    import sys

    code = ("import sys; import skippy.cli; assert 'torch' not in sys.modules; "
            "from skippy.model.threads import spin_for_co_located_stages; spin_for_co_located_stages(); "
            "import os, torch; print(os.environ['GOMP_SPINCOUNT'])")
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "10000" and "after torch loaded" not in done.stderr
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**env, "GOMP_SPINCOUNT": "777"})
    assert done.stdout.strip() == "777"


@pytest.mark.parametrize("case_name", ["llama3", "mistral", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
def test_one_call_decode_is_foreseen_before_torch_loads(case_name, qtype, tmp_path):
    """The spin for co-located stages is chosen before torch loads, from the GGUF alone
    (decodes_in_one_call): it must say exactly when loading then builds the one-call decode
    step, since the short spin suits only steps with no Python between their kernels."""
    import gguf
    from architecture_support import CASES, build_reference, write_gguf

    from skippy.model.threads import decodes_in_one_call

    case = CASES[case_name]
    path = write_gguf(case, build_reference(case), tmp_path / "model.gguf", gguf.GGMLQuantizationType[qtype])
    foreseen = decodes_in_one_call(path, "auto")
    assert foreseen == (load_stage(path, dtype="auto", progress=False).decode_layers is not None)
    assert foreseen == (qtype != "F32" and case_name in ("llama3", "mistral"))  # the llama family, quantized
    assert not decodes_in_one_call(path, "float32")


def test_bundled_model_takes_the_short_spin_unless_it_cannot_build_kernels(monkeypatch):
    from skippy.model.locate import bundled_model_path
    from skippy.model.threads import CO_LOCATED_SPIN_COUNT, ONE_CALL_SPIN_COUNT, co_located_spin_count

    path = bundled_model_path()
    assert load_stage(path, dtype="auto", progress=False).decode_layers is not None
    assert co_located_spin_count(path) == ONE_CALL_SPIN_COUNT
    assert co_located_spin_count(path, "float16") == co_located_spin_count() == CO_LOCATED_SPIN_COUNT
    monkeypatch.setenv("CC", "/nonexistent/cc")  # no compiler: the layers run through torch
    assert co_located_spin_count(path) == CO_LOCATED_SPIN_COUNT
