"""docs/protocol.md states the version the code speaks, and its §10 example is a frame the code
writes and reads byte for byte, so the document cannot drift from the wire format."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from skippy.protocol import ActivationDtype, MessageKind, StageMessage, decode_message, encode_message
from skippy.protocol.constants import PROTOCOL_VERSION

DOC = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()


def section(number: int) -> str:
    start = DOC.index(f"\n## {number}. ")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:] if end < 0 else DOC[start:end]


def test_the_title_and_conventions_state_the_codes_version():
    title = DOC.splitlines()[0]
    assert re.fullmatch(r"# skippy stage wire protocol, version (\d+)", title), title
    assert int(title.rsplit(" ", 1)[1]) == PROTOCOL_VERSION
    assert re.findall(r"`PROTOCOL_VERSION = (\d+)`", section(1)) == [str(PROTOCOL_VERSION)]


def test_the_example_frame_is_what_the_code_writes_and_reads():
    block = re.search(r"```\n(.*?)```", section(10), re.S).group(1)
    # each line: hex words, then (two spaces or more) what they are
    wire = bytes.fromhex("".join(re.split(r"\s{2,}", line.strip())[0] for line in block.splitlines()))
    comments = block.lower()
    assert f"version {PROTOCOL_VERSION}," in comments
    # the frame the prose describes: request 7, session 11, pos_start 5, prompt 5, decode_step 1,
    # current_token 42, token sideband [42], one f16 row [1.0, -2.0]
    described = StageMessage(
        MessageKind.DecodeEmbd, request_id=7, session_id=11, pos_start=5, token_count=1,
        prompt_token_count=5, decode_step=1, current_token=42, source_stage_index=0, tokens=[42],
        activation_dtype=ActivationDtype.f16, activation_rows=1, activation_width=2,
        activation=np.array([1.0, -2.0], "<f2").tobytes(),
    )  # fmt: skip
    assert encode_message(described) == wire
    assert decode_message(wire) == described
