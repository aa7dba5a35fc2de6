"""Sessions on one stage, and the batch policy's torch-free imports: no torch, milliseconds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from skippy.runtime.batch_policy import ONE_WAVE_PEER_WAIT_FORWARDS
from skippy.runtime.session import LaneLimitError, SessionError, SessionTable


def test_bookkeeping_modules_do_not_import_torch():
    code = ("import sys, skippy.runtime, skippy.runtime.session, skippy.runtime.batch_policy, "
            "skippy.runtime.step, skippy.telemetry; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_session_table_is_bounded_by_lane_count():
    table = SessionTable(2)
    table.open((1, 10), request_id=5)
    table.open((1, 11), request_id=6)
    with pytest.raises(LaneLimitError, match="at most 2"):
        table.open((2, 10), request_id=7)
    assert table.open((1, 10), request_id=5) is table.get((1, 10))  # same request: same session


def test_drop_lane_reclaims_only_that_lane():
    table = SessionTable(4)
    for key in [(1, 1), (1, 2), (2, 1)]:
        table.open(key, 0)
    dropped = table.drop_lane(1)
    assert sorted(s.key for s in dropped) == [(1, 1), (1, 2)]
    assert table.keys() == [(2, 1)]
    with pytest.raises(SessionError, match="no session"):
        table.get((1, 1))


def test_new_request_on_a_key_starts_a_fresh_session():
    table = SessionTable(1)
    first = table.open((1, 1), request_id=1)
    first.record_tokens(0, [5, 6, 7], 3)
    second = table.open((1, 1), request_id=2)
    assert second is not first and second.ledger == [] and first.cache is None


def test_ledger_follows_authoritative_positions():
    session = SessionTable(1).open((0, 0), 0)
    session.record_tokens(0, [1, 2, 3, 4], 4)
    session.record_tokens(2, [9], 1)          # a write at 2 cuts the tail first
    assert session.ledger == [1, 2, 9]
    session.record_tokens(3, [], 2)           # rows without token ids stay unknown
    assert session.ledger == [1, 2, 9, -1, -1] and session.history(5) == [1, 2, 9]
    with pytest.raises(SessionError, match="gap"):
        session.record_tokens(7, [1], 1)


def test_verify_window_discard_ranges():
    session = SessionTable(1).open((0, 0), 0)
    session.discard_windows(3, 5)
    assert [session.is_discarded(w) for w in (2, 3, 5, 6)] == [False, True, True, False]


def test_a_local_chain_shares_the_cores_in_waves(gguf_path):
    from skippy.launch.local_chain import LocalChain

    chain, on_gpu = LocalChain(gguf_path, 2), LocalChain(gguf_path, 2, device="cuda:1")
    try:
        assert chain.threads == os.cpu_count()
        assert {c.decode_waves for c in chain.configs} == {2} and chain._stage0_options["decode_waves"] == 2
        assert {c.peer_wait_forwards for c in chain.configs} == {ONE_WAVE_PEER_WAIT_FORWARDS}
        # the device reaches every stage (it was "cpu" for the child stages whatever --device said)
        assert {c.device for c in chain.configs} == {"auto"} and chain.device == "auto"
        assert {c.device for c in on_gpu.configs} == {"cuda:1"} and on_gpu.device == "cuda:1"
    finally:
        chain._dir.cleanup()
        on_gpu._dir.cleanup()
