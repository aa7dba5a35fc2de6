"""Protocol fuzzing at a live chain's final stage (bench/fuzz_stage.py, short): hostile v5
frames over authenticated connections (the chain's token), each case on a fresh one: bit flips,
truncations, lengths past the limits, kinds out of order, unknown sessions, windows of stopped
sessions, and well-formed frames the API never sends (non-finite rows, ±inf and
out-of-vocabulary biases and history, a session id given a new request, the largest
decode_step, grammars that fail, counts past the stage's bounds), while a user streams through
the API and another peer sends rows with infinities into the same waves.

The stage stays up and answers, every reply decodes and none is owed, the API answers as
before, the user's completions equal its run alone with no lane broken, the stage's sessions,
connections and stage 0's return streams are back to their counts, every close is one WARNING
line, and decode_step = 2^31 - 1 leaves the stage's peak RSS where it was. The full run
(10,000 frames) is `python bench/fuzz_stage.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fuzz_stage  # noqa: E402

pytestmark = pytest.mark.slow

NUM_FRAMES = 500


def test_hostile_frames_leave_the_chain_and_its_users_as_they_were(tmp_path):
    report = fuzz_stage.run(NUM_FRAMES, 8, tmp_path, progress=lambda line: None)
    assert report["failures"] == [], report
    assert report["frames"] >= NUM_FRAMES and set(report["classes"]) == set(fuzz_stage.CLASSES)
    assert report["infinity_rows"]["closed"] > 0 and report["user_completions"] >= 2
    print(f"fuzz: {report['frames']} frames over {report['connections']} connections in "
          f"{report['seconds']} s; {report['stage_closes_logged']} closes; "
          f"{report['forwards_with_2_or_more_steps']} forwards shared; {report['close_reasons']}")
