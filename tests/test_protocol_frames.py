"""Stage message and reply frames: golden bytes, round trips, validation and fuzzing."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy.protocol import (
    ActivationDtype, FrameError, MessageKind, ProtocolError, ReplyKind, SamplingConfig,
    StageMessage, StageReply, StageReplyStats, StageStatusReport, VersionMismatch, cache_namespace_digest,
    decode_message, decode_reply, encode_message, encode_reply,
)
from skippy.protocol.constants import (
    MAX_GRAMMAR_BYTES, GrammarKind, I32_MAX, I32_MIN, I64_MAX, I64_MIN, KIND_INFO, MAX_ACTIVATION_BYTES, MAX_LOGIT_BIAS_COUNT,
    MAX_METADATA_BYTES, MAX_PREDICTED_COUNT, MAX_SIDEBAND_COUNT, MESSAGE_HEADER,
    MESSAGE_HEADER_FIELDS, NAMESPACE_KINDS, REPLY_HEADER, REPLY_HEADER_FIELDS, U64_MAX,
    header_offset,
)
from skippy.protocol.activation_codec import q8_encode
from skippy.protocol.frames import decode_sampling, encode_sampling, parse_message_header
from skippy.protocol.logprobs import TokenLogprob
from skippy.protocol.sampling_config import GrammarSpec
from skippy.protocol.stage_probe import StageProbe
from skippy.protocol.stage_metrics import (
    COUNTERS, GAUGES, HISTOGRAMS, METRIC_VALUE_COUNT, HistogramValues, StageMetricValues,
)

K = MessageKind


def unhex(text: str) -> bytes:
    return bytes.fromhex(text)


# One frame of each kind: (message, header hex, body hex). Any change to the layout
# shows up here as a byte diff; docs/protocol.md describes the same bytes.
GOLDEN = [
    # PrefillEmbd: driver prefill chunk: token ids only, no activation (source -1)
    (StageMessage(K.PrefillEmbd, pos_start=0, token_count=3, request_id=7, session_id=11,
                  tokens=[1, 2, 3]),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 00000000 00000000"
     "01000000 00000000 03000000 03000000"
     "00000000 00000000 01000000 00000000"
     "00000000 00000000 00000000 00000000"
     "ffffffff 00000000 00000000 00000000"
     "00000000 00000000",
     "01000000 02000000 03000000"),
    # DecodeEmbd: one decode step from stage 0: f16 activation 1x2, current token 42
    (StageMessage(K.DecodeEmbd, pos_start=5, token_count=1, request_id=7, session_id=11,
                  decode_step=1, current_token=42, source_stage_index=0, prompt_token_count=5,
                  tokens=[42], activation_dtype=ActivationDtype.f16, activation_rows=1,
                  activation_width=2, activation=np.array([[1.0, -2.0]], "<f2").tobytes()),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 04000000 00000000"
     "02000000 05000000 01000000 01000000"
     "00000000 00000000 02000000 00000000"
     "00000000 05000000 01000000 2a000000"
     "00000000 01000000 01000000 02000000"
     "00000000 00000000",
     "2a000000 003c00c0"),
    # Stop: end of session: header only
    (StageMessage(K.Stop, request_id=7, session_id=11),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 00000000 00000000"
     "03000000 00000000 00000000 00000000"
     "00000000 00000000 02000000 00000000"
     "00000000 00000000 00000000 00000000"
     "ffffffff 00000000 00000000 00000000"
     "00000000 00000000",
     ""),
    # PrefillFinalEmbd: last prefill chunk: FINAL_CHUNK flag, explicit positions, bf16 2x1
    (StageMessage(K.PrefillFinalEmbd, pos_start=3, token_count=2, request_id=7, session_id=11,
                  source_stage_index=0, tokens=[4, 5], positions=[3, 4],
                  activation_dtype=ActivationDtype.bf16, activation_rows=2, activation_width=1,
                  activation=bytes.fromhex("803f0040")),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 04000000 00000000"
     "04000000 03000000 02000000 02000000"
     "02000000 00000000 01000000 01000000"
     "00000000 00000000 00000000 00000000"
     "00000000 02000000 02000000 01000000"
     "00000000 00000000",
     "04000000 05000000 03000000 04000000"
     "803f0040"),
    # ConfigureGeneration: sampling block (seed, one logit bias, a JSON Schema grammar "{}")
    # and chat metadata
    (StageMessage(K.ConfigureGeneration, request_id=7, session_id=11, prompt_token_count=5,
                  sampling=SamplingConfig(temperature=0.5, top_k=40, logit_bias={50: -100.0},
                                          seed=1234, grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, "{}")),
                  chat_metadata=b'{"tools":[]}'),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 00000000 00000000"
     "0e000000 00000000 00000000 00000000"
     "00000000 00000000 01000000 28000000"
     "00000000 05000000 00000000 00000000"
     "ffffffff 00000000 00000000 00000000"
     "62000000 0c000000",
     "00000000 0000e03f 00000000 0000f03f"
     "00000000 00000000 00000000 0000f03f"
     "00000000 00000000 00000000 00000000"
     "d2040000 00000000 28000000 40000000"
     "01000000 01000000 02000000 02000000"   # flags HAS_SEED, 1 bias entry, JSON_SCHEMA, 2 bytes
     "ffffffff"                               # logprobs -1: none
     "32000000 00000000 000059c0 7b7d"        # token 50: -100.0, then the grammar text "{}"
     "7b22746f 6f6c7322 3a5b5d7d"),
    # TryRestorePrefill: prefix to restore as the token sideband, no activation; the
    # CACHE_NAMESPACE flag (bit 16) and its 32-byte digest of prompt_cache_key "tenant-a"
    (StageMessage(K.TryRestorePrefill, token_count=4, request_id=7, session_id=11,
                  tokens=[1, 2, 3, 4], cache_namespace=cache_namespace_digest("tenant-a")),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 00000000 00000000"
     "11000000 00000000 04000000 04000000"
     "00000000 00000000 01000000 00000100"
     "00000000 00000000 00000000 00000000"
     "ffffffff 00000000 00000000 00000000"
     "00000000 00000000",
     "01000000 02000000 03000000 04000000"
     "974e833d 722c28ff dc4f723b 17c98fcd"
     "a56c56ea 0bca3324 352d1307 44939276"),
    # TryRestorePrefillDecode: prefix + current token, default sampling block without seed
    (StageMessage(K.TryRestorePrefillDecode, pos_start=3, token_count=1, request_id=7,
                  session_id=11, current_token=9, prompt_token_count=3, tokens=[1, 2, 3, 9],
                  sampling=SamplingConfig()),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 00000000 00000000"
     "12000000 03000000 01000000 04000000"
     "00000000 00000000 01000000 08000000"
     "00000000 03000000 00000000 09000000"
     "ffffffff 00000000 00000000 00000000"
     "54000000 00000000",
     "01000000 02000000 03000000 09000000"
     "00000000 00000000 00000000 0000f03f"
     "00000000 00000000 00000000 0000f03f"
     "00000000 00000000 00000000 00000000"
     "00000000 00000000 00000000 40000000"
     "00000000 00000000 00000000 00000000"
     "ffffffff"),
    # TrimSession: truncate to token_count=12
    (StageMessage(K.TrimSession, token_count=12, request_id=7, session_id=11),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 00000000 00000000"
     "13000000 00000000 0c000000 00000000"
     "00000000 00000000 01000000 00000000"
     "00000000 00000000 00000000 00000000"
     "ffffffff 00000000 00000000 00000000"
     "00000000 00000000",
     ""),
    # PredictionReturnOpen: first frame of a prediction-return stream
    (StageMessage(K.PredictionReturnOpen, request_id=7, session_id=11),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 00000000 00000000"
     "14000000 00000000 00000000 00000000"
     "00000000 00000000 02000000 00000000"
     "00000000 00000000 00000000 00000000"
     "ffffffff 00000000 00000000 00000000"
     "00000000 00000000",
     ""),
    # VerifyWindow: window 5 at base 8: [current, 2 drafts], f32 activation 3x1
    (StageMessage(K.VerifyWindow, pos_start=8, token_count=3, request_id=7, session_id=11,
                  seq_id=5, decode_step=2, prompt_token_count=5, source_stage_index=0,
                  tokens=[9, 10, 11], activation_rows=3, activation_width=1,
                  activation=np.array([0.5, 1.5, -1.0], "<f4").tobytes()),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 0c000000 00000000"
     "15000000 08000000 03000000 03000000"
     "00000000 05000000 02000000 00000000"
     "00000000 05000000 02000000 00000000"
     "00000000 00000000 03000000 01000000"
     "00000000 00000000",
     "09000000 0a000000 0b000000 0000003f"
     "0000c03f 000080bf"),
    # RetireVerifyWindow: release verify checkpoints [8, 11)
    (StageMessage(K.RetireVerifyWindow, pos_start=8, token_count=3, request_id=7, session_id=11),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 00000000 00000000"
     "16000000 08000000 03000000 00000000"
     "00000000 00000000 01000000 00000000"
     "00000000 00000000 00000000 00000000"
     "ffffffff 00000000 00000000 00000000"
     "00000000 00000000",
     ""),
    # DiscardStaleWindows: skip windows 2..4
    (StageMessage(K.DiscardStaleWindows, request_id=7, session_id=11, tokens=[2, 4]),
     "47534d53 06000000 07000000 00000000"
     "0b000000 00000000 00000000 00000000"
     "17000000 00000000 00000000 02000000"
     "00000000 00000000 02000000 00000000"
     "00000000 00000000 00000000 00000000"
     "ffffffff 00000000 00000000 00000000"
     "00000000 00000000",
     "02000000 04000000"),
    # GetStageStatus: no session, no body; the stage answers with its own status
    (StageMessage(K.GetStageStatus),
     "47534d53 06000000 00000000 00000000"
     "00000000 00000000 00000000 00000000"
     "18000000 00000000 00000000 00000000"
     "00000000 00000000 01000000 00000000"
     "00000000 00000000 00000000 00000000"
     "ffffffff 00000000 00000000 00000000"
     "00000000 00000000",
     ""),
    # LinkProbe: filler token ids, as many as the probe's size; ACKed once read, not forwarded
    (StageMessage(K.LinkProbe, tokens=[7, 7, 7]),
     "47534d53 06000000 00000000 00000000"
     "00000000 00000000 00000000 00000000"
     "19000000 00000000 00000000 03000000"   # kind 25, 3 token ids
     "00000000 00000000 01000000 00000000"
     "00000000 00000000 00000000 00000000"
     "ffffffff 00000000 00000000 00000000"
     "00000000 00000000",
     "07000000 07000000 07000000"),
]


def test_golden_table_covers_every_kind():
    assert sorted(msg.kind for msg, _, _ in GOLDEN) == sorted(MessageKind)


@pytest.mark.parametrize("msg, header_hex, body_hex", GOLDEN,
                         ids=[m.kind.name for m, _, _ in GOLDEN])
def test_golden_bytes(msg, header_hex, body_hex):
    wire = unhex(header_hex) + unhex(body_hex)
    assert len(unhex(header_hex)) == MESSAGE_HEADER.size
    assert encode_message(msg) == wire
    decoded = decode_message(wire)
    assert decoded == msg
    assert encode_message(decoded) == wire


def test_header_layout_matches_the_documented_offsets():
    # Built by hand from the docs/protocol.md offsets table, not from the encoder's tables.
    msg = StageMessage(K.VerifyWindow, pos_start=8, token_count=2, request_id=2**64 - 1,
                       session_id=3, seq_id=9, checkpoint_generation=4, prompt_token_count=6,
                       decode_step=7, current_token=-1, source_stage_index=1, tokens=[5, 6],
                       activation_rows=2, activation_width=1,
                       activation=np.array([1.0, 2.0], "<f4").tobytes())
    expected = (struct.pack("<I", 0x534D5347) + struct.pack("<i", 6)
                + struct.pack("<QQQ", 2**64 - 1, 3, 8)
                + struct.pack("<5i", 21, 8, 2, 2, 0)
                + struct.pack("<iiI", 9, 2, 0)
                + struct.pack("<5i", 4, 6, 7, -1, 1)
                + struct.pack("<3i", 0, 2, 1) + struct.pack("<II", 0, 0)
                + struct.pack("<2i", 5, 6) + struct.pack("<2f", 1.0, 2.0))
    assert encode_message(msg) == expected


def test_decoded_arrays_are_views_of_the_input():
    msg, header_hex, body_hex = GOLDEN[9]  # VerifyWindow, f32 activation
    wire = bytearray(unhex(header_hex) + unhex(body_hex))
    decoded = decode_message(wire)
    assert decoded.activation_array().tolist() == [[0.5], [1.5], [-1.0]]
    wire[MESSAGE_HEADER.size] = 99  # first token id, little-endian low byte
    assert decoded.tokens[0] == 99
    assert decoded.activation.obj is not None


def test_activation_array_shapes_and_dtypes():
    rows = np.arange(6, dtype="<f2").reshape(2, 3)
    msg = StageMessage(K.PrefillEmbd, token_count=2, activation_dtype=ActivationDtype.f16,
                       activation_rows=2, activation_width=3, activation=rows)
    assert np.array_equal(decode_message(encode_message(msg)).activation_array(), rows)
    bf16_bits = np.array([[0x3F80, 0x4000]], "<u2")  # 1.0, 2.0 in bfloat16
    msg = StageMessage(K.PrefillEmbd, token_count=1, activation_dtype=ActivationDtype.bf16,
                       activation_rows=1, activation_width=2, activation=bf16_bits)
    assert decode_message(encode_message(msg)).activation_array().tolist() == [[0x3F80, 0x4000]]


def test_derived_phase_and_flags():
    final = StageMessage(K.PrefillFinalEmbd, sampling=SamplingConfig(), chat_metadata=b"")
    assert final.phase.name == "Prefill"
    assert final.flags == 0b101001  # FINAL_CHUNK | SAMPLING | CHAT_METADATA
    assert StageMessage(K.DecodeEmbd).flags == 0
    restore = StageMessage(K.TryRestorePrefill, cache_namespace=bytes(32))
    assert restore.flags == 1 << 16  # CACHE_NAMESPACE


def test_cache_namespace_digest():
    assert cache_namespace_digest(None) is None
    digest = cache_namespace_digest("a")
    assert len(digest) == 32 and digest == cache_namespace_digest("a")
    assert digest != cache_namespace_digest("b") and digest != cache_namespace_digest("")


# ---------------------------------------------------------------------------
# Hypothesis round trips
# ---------------------------------------------------------------------------
i32 = st.integers(I32_MIN, I32_MAX)
counts = st.integers(0, I32_MAX)
u64 = st.integers(0, U64_MAX)

samplings = st.builds(
    SamplingConfig,
    temperature=st.floats(0.0, 5.0),
    top_k=st.integers(0, 1000),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    min_p=st.floats(0.0, 1.0),
    repetition_penalty=st.floats(0.0, 4.0, exclude_min=True),
    presence_penalty=st.floats(-2.0, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    penalty_last_n=st.integers(-1, 1 << 20),
    logit_bias=st.dictionaries(i32, st.floats(allow_nan=False), max_size=8),
    seed=st.none() | st.integers(I64_MIN, I64_MAX),
    grammar=st.none() | st.just(GrammarSpec(GrammarKind.JSON_OBJECT))
    | st.builds(GrammarSpec, st.just(GrammarKind.JSON_SCHEMA), st.text(min_size=1, max_size=40)),
)


@st.composite
def messages(draw, kinds=st.sampled_from(list(MessageKind))):
    kind = draw(kinds)
    tokens = draw(st.lists(i32, max_size=12))
    if kind == K.DiscardStaleWindows:
        tokens = sorted(draw(st.lists(i32, min_size=2, max_size=2)))
    fields = dict(
        pos_start=draw(counts), token_count=draw(counts), request_id=draw(u64),
        session_id=draw(u64), seq_id=draw(i32), checkpoint_generation=draw(i32),
        prompt_token_count=draw(counts), decode_step=draw(i32), current_token=draw(i32),
        source_stage_index=draw(st.integers(-1, 64)), tokens=tokens,
        positions=draw(st.lists(i32, max_size=12)),
        sampling=draw(st.none() | samplings),
        chat_metadata=draw(st.none() | st.binary(max_size=48)),
    )
    if kind in NAMESPACE_KINDS:
        fields["cache_namespace"] = draw(st.none() | st.binary(min_size=32, max_size=32))
    if KIND_INFO[kind].has_activation and draw(st.booleans()):
        dtype = draw(st.sampled_from(list(ActivationDtype)))
        rows, width = draw(st.integers(0, 5)), draw(st.integers(0, 7)) * dtype.block_elements
        if dtype == ActivationDtype.q8:  # its scales must be finite: the codec's own blocks
            values = draw(st.lists(st.floats(-1e4, 1e4, width=32), min_size=rows * width, max_size=rows * width))
            activation = q8_encode(np.array(values, np.float32).reshape(rows, width)).tobytes()
        else:
            nbytes = dtype.nbytes(rows, width)
            activation = draw(st.binary(min_size=nbytes, max_size=nbytes))
        fields.update(activation_dtype=dtype, activation_rows=rows, activation_width=width,
                      activation=activation)
    return StageMessage(kind, **fields)


@given(messages())
def test_every_kind_round_trips(msg):
    wire = encode_message(msg)
    decoded = decode_message(wire)
    assert decoded == msg
    assert encode_message(decoded) == wire


@given(samplings)
def test_sampling_block_round_trips_exactly(cfg):
    assert decode_sampling(encode_sampling(cfg)) == cfg


# ---------------------------------------------------------------------------
# Validation: each row mutates one header field of a valid frame.
# ---------------------------------------------------------------------------
def _frame(msg: StageMessage) -> bytearray:
    return bytearray(encode_message(msg))


def _set(wire: bytearray, name: str, value: int) -> bytearray:
    fmt = next(f.fmt for f in MESSAGE_HEADER_FIELDS if f.name == name)
    struct.pack_into("<" + fmt, wire, header_offset(MESSAGE_HEADER_FIELDS, name), value)
    return wire


DECODE_PREFILL = StageMessage(K.PrefillEmbd, token_count=2, tokens=[1, 2], activation_rows=2,
                              activation_width=2, activation=bytes(16))
CONFIGURE = StageMessage(K.ConfigureGeneration, sampling=SamplingConfig(logit_bias={3: 1.0}),
                         chat_metadata=b"{}")

HEADER_CASES = [
    # (base message, field, new value, error type, message fragment)
    # wrong frame magic (e.g. a reply read as a message)
    (DECODE_PREFILL, "magic", 0x53525059, FrameError, "magic"),
    # a peer of another protocol version fails closed
    (DECODE_PREFILL, "version", 5, VersionMismatch, "version: expected 6, got 5"),
    # negative counts
    (DECODE_PREFILL, "token_count", -1, FrameError, "token_count: expected >= 0"),
    (DECODE_PREFILL, "pos_start", -5, FrameError, "pos_start"),
    (DECODE_PREFILL, "token_sideband_count", -1, FrameError, "token_sideband_count"),
    # sideband over the 1,048,576 cap
    (DECODE_PREFILL, "token_sideband_count", MAX_SIDEBAND_COUNT + 1, FrameError, "token_sideband"),
    (DECODE_PREFILL, "position_sideband_count", MAX_SIDEBAND_COUNT + 1, FrameError, "position"),
    # activation over 512 MiB, even though rows x width would agree
    (DECODE_PREFILL, "activation_bytes", MAX_ACTIVATION_BYTES + 4, FrameError, "activation_bytes"),
    # metadata over 8 MiB
    (CONFIGURE, "metadata_bytes", MAX_METADATA_BYTES + 1, FrameError, "metadata_bytes"),
    # sampling section larger than 256 logit-bias entries allow
    (CONFIGURE, "sampling_bytes", 1 << 20, FrameError, "sampling_bytes"),
    # unknown kind codes, including ones the Rust peers had (StateImport=7)
    (DECODE_PREFILL, "kind", 7, FrameError, "kind"),
    (DECODE_PREFILL, "kind", 0, FrameError, "kind"),
    # phase disagrees with kind
    (DECODE_PREFILL, "phase", 2, FrameError, "phase"),
    (DECODE_PREFILL, "phase", 3, FrameError, "phase"),
    # FINAL_CHUNK on a non-final prefill
    (DECODE_PREFILL, "flags", 1, FrameError, "FINAL_CHUNK"),
    # an unknown flag bit (spec LIGHT_CONTEXT)
    (DECODE_PREFILL, "flags", 1 << 1, FrameError, "flags"),
    (DECODE_PREFILL, "flags", 1 << 31, FrameError, "flags"),
    # the namespace section only on ConfigureGeneration and the TryRestore kinds
    (DECODE_PREFILL, "flags", 1 << 16, FrameError, "CACHE_NAMESPACE"),
    # SAMPLING flag without a sampling block
    (DECODE_PREFILL, "flags", 1 << 3, FrameError, "sampling_bytes"),
    # sampling bytes without the SAMPLING flag
    (CONFIGURE, "flags", 1 << 5, FrameError, "sampling_bytes"),
    # metadata bytes without the CHAT_METADATA flag
    (CONFIGURE, "flags", 1 << 3, FrameError, "metadata_bytes"),
    # unknown activation dtype
    (DECODE_PREFILL, "activation_dtype", 4, FrameError, "activation_dtype"),
    # q8 rows are whole blocks of 32 values
    (DECODE_PREFILL, "activation_dtype", 3, FrameError, "activation_width"),
    # explicit activation length disagrees with rows x width x itemsize
    (DECODE_PREFILL, "activation_width", 3, FrameError, "activation_bytes"),
    (DECODE_PREFILL, "activation_dtype", 1, FrameError, "activation_bytes"),
    # activation on a kind that carries none
    (StageMessage(K.Stop), "activation_rows", 1, FrameError, "activation_rows"),
    # DiscardStaleWindows needs exactly [min, max]
    (StageMessage(K.DiscardStaleWindows, tokens=[1, 2]), "token_sideband_count", 1, FrameError,
     "token_sideband_count"),
    # body length no longer matches (one sideband value more than is present)
    (DECODE_PREFILL, "token_sideband_count", 3, FrameError, "truncated"),
    (DECODE_PREFILL, "token_sideband_count", 1, FrameError, "trailing"),
]


@pytest.mark.parametrize("base, name, value, error, fragment", HEADER_CASES)
def test_header_validation(base, name, value, error, fragment):
    wire = _set(_frame(base), name, value)
    with pytest.raises(error, match=fragment):
        decode_message(wire)


def test_validation_order_magic_before_version_before_limits():
    wire = _set(_set(_set(_frame(DECODE_PREFILL), "token_count", -1), "version", 9), "magic", 0)
    with pytest.raises(FrameError, match="magic"):
        decode_message(wire)
    with pytest.raises(VersionMismatch):
        decode_message(_set(wire, "magic", 0x534D5347))


BODY_CASES = [
    # (description, base message, transform of the wire bytes, message fragment)
    ("empty buffer", DECODE_PREFILL, lambda w: b"", "truncated"),
    ("header cut short", DECODE_PREFILL, lambda w: w[:50], "truncated"),
    ("body cut short", DECODE_PREFILL, lambda w: w[:-1], "truncated"),
    ("one trailing byte", DECODE_PREFILL, lambda w: w + b"\0", "trailing"),
    ("a second frame glued on", DECODE_PREFILL, lambda w: w + w, "trailing"),
    ("namespace digest cut short", StageMessage(K.ConfigureGeneration, cache_namespace=bytes(32)),
     lambda w: w[:-1], "truncated"),
    ("DiscardStaleWindows with min > max",
     StageMessage(K.DiscardStaleWindows, tokens=[1, 2]),
     lambda w: w[:-8] + struct.pack("<2i", 5, 4), "min <= max"),
]


@pytest.mark.parametrize("what, base, transform, fragment", BODY_CASES,
                         ids=[row[0] for row in BODY_CASES])
def test_body_validation(what, base, transform, fragment):
    with pytest.raises(FrameError, match=fragment):
        decode_message(transform(bytes(_frame(base))))


def _sampling_frame(**block_fields: float) -> bytes:
    """A ConfigureGeneration frame whose sampling block fields are overwritten."""
    from skippy.protocol.constants import SAMPLING_BLOCK, SAMPLING_FIELDS
    wire = _frame(StageMessage(K.ConfigureGeneration,
                               sampling=SamplingConfig(logit_bias={1: 0.5, 9: 1.0})))
    start = MESSAGE_HEADER.size
    values = list(SAMPLING_BLOCK.unpack_from(wire, start))
    names = [f.name for f in SAMPLING_FIELDS]
    for name, value in block_fields.items():
        values[names.index(name)] = value
    SAMPLING_BLOCK.pack_into(wire, start, *values)
    return bytes(wire)


SAMPLING_CASES = [
    # (block fields to overwrite, message fragment)
    ({"temperature": float("nan")}, "temperature"),          # NaN fails SamplingConfig
    ({"presence_penalty": float("inf")}, "presence_penalty"),  # non-finite scalar
    ({"top_p": 0.0}, "top_p"),                                 # SamplingConfig range check
    ({"sampling_flags": 4}, "sampling.flags"),                 # unknown sampling flag bit
    ({"seed": 5}, "seed"),                                     # a seed without HAS_SEED
    ({"logit_bias_count": 1}, "sampling_bytes"),               # count disagrees with length
    ({"logit_bias_count": MAX_LOGIT_BIAS_COUNT + 1}, "logit_bias_count"),
]


@pytest.mark.parametrize("fields, fragment", SAMPLING_CASES)
def test_sampling_block_validation(fields, fragment):
    with pytest.raises(FrameError, match=fragment):
        decode_message(_sampling_frame(**fields))


def _grammar_block(kind: int, text: bytes) -> bytes:
    """A sampling block (no bias entries) whose grammar fields say `kind` and len(text)."""
    from skippy.protocol.constants import SAMPLING_BLOCK
    return SAMPLING_BLOCK.pack(0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0, 0, 64, 0, 0, kind, len(text), -1) + text


GRAMMAR_CASES = [
    # (grammar kind on the wire, grammar bytes, message fragment)
    (4, b"", "grammar_kind"),                   # an unknown kind
    (int(GrammarKind.LARK), b"", "grammar text"),            # a lark grammar needs its text
    (0, b"{}", "grammar_bytes"),                # text without a kind
    (int(GrammarKind.JSON_OBJECT), b"{}", "grammar text"),   # json_object carries no text
    (int(GrammarKind.JSON_SCHEMA), b"", "grammar text"),     # a schema needs its text
    (int(GrammarKind.JSON_SCHEMA), b"\xff{}", "utf-8"),     # not UTF-8
]


@pytest.mark.parametrize("kind, text, fragment", GRAMMAR_CASES)
def test_grammar_validation(kind, text, fragment):
    with pytest.raises(FrameError, match=fragment):
        decode_sampling(_grammar_block(kind, text))


def test_grammar_round_trips_and_its_length_is_checked():
    cfg = SamplingConfig(logit_bias={4: 1.0}, grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "é"}'))
    block = encode_sampling(cfg)
    assert decode_sampling(block) == cfg
    with pytest.raises(FrameError, match="sampling_bytes"):
        decode_sampling(block[:-1])  # the grammar text cut short
    with pytest.raises(FrameError, match="sampling_bytes"):
        decode_sampling(block + b" ")
    oversized = _grammar_block(int(GrammarKind.JSON_SCHEMA), b"x" * (MAX_GRAMMAR_BYTES + 1))
    with pytest.raises(FrameError, match="grammar_bytes"):  # checked before the text is read
        decode_sampling(oversized)
    with pytest.raises(ValueError, match="at most"):
        GrammarSpec(GrammarKind.JSON_SCHEMA, "x" * (MAX_GRAMMAR_BYTES + 1))


def test_logit_bias_must_be_ascending():
    wire = bytearray(_sampling_frame())
    first = len(wire) - 24  # two 12-byte entries: token 1, token 9
    struct.pack_into("<i", wire, first + 12, 1)  # second token id == first
    with pytest.raises(FrameError, match="ascending"):
        decode_message(bytes(wire))


ENCODE_CASES = [
    # (message that cannot go on the wire, message fragment)
    (StageMessage(K.PrefillEmbd, pos_start=1 << 31), "pos_start"),        # i32 overflow
    (StageMessage(K.PrefillEmbd, request_id=-1), "request_id"),          # u64 underflow
    (StageMessage(K.PrefillEmbd, token_count=-1), "token_count"),        # negative count
    (StageMessage(K.PrefillEmbd, activation_rows=2, activation_width=2,
                  activation=bytes(15)), "activation_bytes"),            # shape disagrees
    (StageMessage(K.Stop, activation_rows=1, activation_width=1,
                  activation=bytes(4)), "activation"),                   # kind carries none
    (StageMessage(K.DiscardStaleWindows, tokens=[1]), "token_sideband_count"),
    (StageMessage(K.DiscardStaleWindows, tokens=[3, 1]), "min <= max"),
    (StageMessage(K.Stop, cache_namespace=bytes(32)), "CACHE_NAMESPACE"),  # wrong kind
    (StageMessage(K.TryRestorePrefill, cache_namespace=bytes(31)), "cache_namespace"),
    (StageMessage(K.ConfigureGeneration, sampling=SamplingConfig(seed=1 << 64)), "seed"),
    (StageMessage(K.ConfigureGeneration, sampling=SamplingConfig(
        logit_bias={i: 0.0 for i in range(MAX_LOGIT_BIAS_COUNT + 1)})), "logit_bias"),
    (StageMessage(K.ConfigureGeneration, sampling=SamplingConfig(
        logit_bias={1: float("nan")})), "logit_bias"),
]


@pytest.mark.parametrize("msg, fragment", ENCODE_CASES)
def test_encoder_refuses_what_a_peer_would_reject(msg, fragment):
    with pytest.raises(FrameError, match=fragment):
        encode_message(msg)


def test_construction_rejects_tokens_outside_i32():
    with pytest.raises(ValueError, match="tokens"):
        StageMessage(K.PrefillEmbd, tokens=[1 << 31])
    with pytest.raises(ValueError):
        StageMessage(99)  # type: ignore[arg-type]


def test_parse_header_alone_gives_body_length():
    wire = _frame(CONFIGURE)
    header = parse_message_header(wire[:MESSAGE_HEADER.size])
    assert MESSAGE_HEADER.size + header.body_bytes == len(wire)


# ---------------------------------------------------------------------------
# Fuzzing: random mutations of valid frames decode cleanly or raise ProtocolError.
# ---------------------------------------------------------------------------
mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("set32"), st.integers(0, 10_000), st.integers(0, (1 << 32) - 1)),
)


def _mutate(wire: bytes, ops) -> bytes:
    data = bytearray(wire)
    for op, position, value in ops:
        position = position % (len(data) + 1)
        if op == "flip" and position < len(data):
            data[position] ^= value
        elif op == "truncate":
            del data[position:]
        elif op == "insert":
            data.insert(position, value)
        elif op == "delete" and position < len(data):
            del data[position]
        elif op == "set32":
            data[position:position + 4] = value.to_bytes(4, "little")
    return bytes(data)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(messages(), st.lists(mutations, min_size=1, max_size=4))
def test_fuzzed_message_frames_raise_only_protocol_errors(msg, ops):
    mutated = _mutate(encode_message(msg), ops)
    try:
        decoded = decode_message(mutated)
    except ProtocolError:
        return
    # Anything accepted is canonical: it re-encodes to exactly the same bytes.
    assert encode_message(decoded) == mutated


# ---------------------------------------------------------------------------
# Replies
# ---------------------------------------------------------------------------
STATS = StageReplyStats(kv_lookup_hits=2, kv_hit_stage_mask=0b101, prefill_edge_stage_index=1,
                        prefill_compute_us_at_slowest_rate=-1)

REPLY_CASES = [
    # Ack carrying merged stats
    StageReply.ack(STATS),
    # one predicted token (the tokens list defaults to [predicted])
    StageReply.token(42),
    # with its logprob and 2 top pairs, and two prompt tokens' (values exact in f32)
    StageReply.token(42, logprobs=[TokenLogprob(42, -0.25, ((42, -0.25), (7, -2.5)))],
                     prompt_logprobs=[TokenLogprob(3, -4.0, ((1, -0.5), (3, -4.0))),
                                      TokenLogprob(9, -1.0, ((9, -1.0), (2, -1.5)))]),
    # a verify window's rows, each with its logprob and no top pairs
    StageReply.window([5, 6], 3, logprobs=[TokenLogprob(5, -0.125), TokenLogprob(6, -8.0)]),
    # a PredictedToken with extra sideband tokens
    StageReply.token(42, STATS, [42, 43, 123]),
    # a verify window's target predictions, echoing window id 7
    StageReply.window([5, 6, 7, 8], 7, STATS),
    # a prediction with a native MTP draft, kept apart from the predictions
    StageReply(ReplyKind.PredictedToken, 42, [42], draft_tokens=[43, 44], draft_compute_us=12_345),
    # an empty draft is still a draft
    StageReply(ReplyKind.PredictedToken, -1, [-1], draft_tokens=[]),
    # a stage's status: stage 1, layers [19, 30), 2 open sessions, 8 lanes
    StageReply.of_status(StageStatusReport(1, 19, 30, 2, 8)),
]


@pytest.mark.parametrize("reply", REPLY_CASES)
def test_reply_round_trips(reply):
    wire = encode_reply(reply)
    assert decode_reply(wire) == reply
    assert encode_reply(decode_reply(wire)) == wire


def test_reply_golden_bytes():
    wire = encode_reply(StageReply.window([5, 6], 3, StageReplyStats(kv_lookup_hits=1)))
    assert wire[:REPLY_HEADER.size] == unhex(
        "59505253 06000000 03000000 05000000"   # magic "SRPY", version 6, PredictedTokens, 5
        "03000000 02000000 00000000 00000000"   # window 3, 2 predictions, no draft, 0 draft
        "00000000 00000000"                     # draft_compute_us
        "ffffffff 00000000")                    # no logprob block, no prompt entries
    assert wire[REPLY_HEADER.size:REPLY_HEADER.size + 8] == unhex("01000000 00000000")
    assert wire[264:] == unhex("05000000 06000000")
    status = encode_reply(StageReply.of_status(StageStatusReport(1, 19, 30, 2, 8)))
    assert status[:REPLY_HEADER.size] == unhex(
        "59505253 06000000 04000000 00000000"   # StageStatus, no prediction
        "00000000 c5000000 00000000 00000000"   # 5 status values + 2 x (83 metric + 13 probe) halves
        "00000000 00000000 ffffffff 00000000")  # no draft; logprob_top -1: no logprob block
    assert status[264:284] == unhex("01000000 13000000 1e000000 02000000 08000000")
    assert status[284:284 + 8 * METRIC_VALUE_COUNT] == bytes(8 * METRIC_VALUE_COUNT)  # every metric 0, as i64 halves
    assert status[284 + 8 * METRIC_VALUE_COUNT:] == struct.pack("<13q", *StageProbe().flat())  # nothing measured


def _set_reply(wire: bytes, name: str, value: int) -> bytes:
    data = bytearray(wire)
    fmt = next(f.fmt for f in REPLY_HEADER_FIELDS if f.name == name)
    struct.pack_into("<" + fmt, data, header_offset(REPLY_HEADER_FIELDS, name), value)
    return bytes(data)


TOKEN_REPLY = encode_reply(StageReply.token(42))
ACK_REPLY = encode_reply(StageReply.ack())
STATUS_REPLY = encode_reply(StageReply.of_status(StageStatusReport(1, 19, 30, 2, 8)))
LOGPROB_REPLY = encode_reply(StageReply.token(42, logprobs=[TokenLogprob(42, -0.25, ((42, -0.25),))]))

REPLY_ERROR_CASES = [
    # (wire bytes, error, message fragment)
    (_set_reply(TOKEN_REPLY, "magic", 0x534D5347), FrameError, "magic"),    # a message magic
    (_set_reply(TOKEN_REPLY, "version", 0), VersionMismatch, "version"),
    (_set_reply(TOKEN_REPLY, "predicted_count", MAX_PREDICTED_COUNT + 1), FrameError,
     "predicted_count"),                                                     # over 262,144
    (_set_reply(TOKEN_REPLY, "predicted_count", -1), FrameError, "predicted_count"),
    (_set_reply(TOKEN_REPLY, "kind", 5), FrameError, "reply kind"),
    (_set_reply(STATUS_REPLY, "predicted_count", 4), FrameError, "StageStatus"),
    (_set_reply(STATUS_REPLY, "predicted", 1), FrameError, "StageStatus"),
    (STATUS_REPLY[:264] + unhex("01000000 1e000000 13000000 02000000 08000000") + STATUS_REPLY[284:],
     FrameError, "stage status"),                                            # layers reversed
    (STATUS_REPLY[:264] + unhex("01000000 13000000 1e000000 ffffffff 08000000") + STATUS_REPLY[284:],
     FrameError, "stage status"),                                            # -1 sessions
    (_set_reply(STATUS_REPLY, "predicted_count", 5)[:284], FrameError, "StageStatus"),  # version 3's 5
    (_set_reply(TOKEN_REPLY, "has_draft", 2), FrameError, "has_draft"),
    (_set_reply(TOKEN_REPLY, "draft_count", 1), FrameError, "without a draft"),
    # predicted_tokens[0] != predicted
    (_set_reply(TOKEN_REPLY, "predicted", 41), FrameError, "predicted_tokens"),
    (_set_reply(ACK_REPLY, "predicted", 1), FrameError, "Ack"),
    (_set_reply(TOKEN_REPLY, "predicted_count", 0), FrameError, "predicted_count"),
    (TOKEN_REPLY[:-1], FrameError, "reply length"),                           # truncated
    (TOKEN_REPLY + b"\0\0\0\0", FrameError, "reply length"),                  # trailing
    (TOKEN_REPLY[:10], FrameError, "truncated"),
    (_set_reply(TOKEN_REPLY, "logprob_top", 21), FrameError, "logprob_top"),     # over 20
    (_set_reply(TOKEN_REPLY, "prompt_logprob_count", 1), FrameError, "without a logprob block"),
    (_set_reply(ACK_REPLY, "logprob_top", 0), FrameError, "logprob_top"),       # an Ack has none
    (LOGPROB_REPLY[:268] + struct.pack("<i", 7) + LOGPROB_REPLY[272:], FrameError,
     "logprobs token"),                                       # an entry for another token than predicted
    (LOGPROB_REPLY[:-1], FrameError, "reply length"),                         # a truncated block
]


@pytest.mark.parametrize("wire, error, fragment", REPLY_ERROR_CASES)
def test_reply_validation(wire, error, fragment):
    with pytest.raises(error, match=fragment):
        decode_reply(wire)


@settings(max_examples=300)
@given(st.sampled_from(REPLY_CASES), st.lists(mutations, min_size=1, max_size=4))
def test_fuzzed_replies_raise_only_protocol_errors(reply, ops):
    mutated = _mutate(encode_reply(reply), ops)
    try:
        decoded = decode_reply(mutated)
    except ProtocolError:
        return
    assert encode_reply(decoded) == mutated


def test_reply_encoder_refuses_bad_tokens():
    with pytest.raises(FrameError):
        encode_reply(StageReply.token(1 << 40))
    with pytest.raises(FrameError, match="predicted_tokens"):
        encode_reply(StageReply(ReplyKind.PredictedTokens, 1, [2, 3]))
    with pytest.raises(FrameError, match="stats"):
        encode_reply(StageReply.ack(StageReplyStats(kv_lookup_hits=1 << 63)))


def test_status_travels_only_in_a_stage_status_reply():
    with pytest.raises(FrameError, match="StageStatus replies only"):
        encode_reply(StageReply(ReplyKind.StageStatus))
    with pytest.raises(FrameError, match="StageStatus replies only"):
        encode_reply(StageReply(ReplyKind.Ack, status=StageStatusReport(1, 0, 1, 0, 1)))
    with pytest.raises(FrameError, match="stage status"):
        StageStatusReport(1, 5, 5, 0, 1)


def test_cache_namespace_digest_is_the_documented_construction():
    # docs/architecture.md: blake2b-256 of the domain tag "openai-cache-namespace-v1\0" and the
    # key's UTF-8 bytes, spelled out here rather than pasted, so a changed tag or hash fails.
    for key in ("tenant-a", "", "ключ 🔑"):
        expected = hashlib.blake2b(b"openai-cache-namespace-v1\x00" + key.encode("utf-8"), digest_size=32).digest()
        assert cache_namespace_digest(key) == expected
    assert cache_namespace_digest(None) is None
    assert cache_namespace_digest("tenant-a") != cache_namespace_digest("tenant-b")


TRACE = bytes(range(1, 17)) + bytes(range(0xa1, 0xa9)) + b"\x01"  # trace id, parent span id, sampled


def test_trace_context_is_the_last_body_section():
    msg = StageMessage(K.Stop, request_id=7, session_id=11, trace_context=TRACE)
    wire = encode_message(msg)
    header = parse_message_header(wire)
    assert header.flags == 1 << 17 and header.body_bytes == 25
    assert wire[MESSAGE_HEADER.size:] == unhex(
        "0102030405060708 090a0b0c0d0e0f10"   # trace id
        "a1a2a3a4a5a6a7a8 01")                # parent span id, trace flags (sampled)
    assert decode_message(wire) == msg and decode_message(wire).trace_context == TRACE
    namespaced = StageMessage(K.ConfigureGeneration, cache_namespace=b"\x05" * 32, trace_context=TRACE,
                              sampling=SamplingConfig())
    wire = encode_message(namespaced)
    assert wire[-25:] == TRACE and wire[-57:-25] == b"\x05" * 32  # after the namespace digest
    assert decode_message(wire) == namespaced


@pytest.mark.parametrize("trace, fragment", [
    (TRACE[:24], "25 bytes"),
    (bytes(16) + TRACE[16:], "non-zero trace id"),       # W3C: an all-zero trace id is invalid
    (TRACE[:16] + bytes(8) + b"\x01", "non-zero"),        # ... and so is an all-zero span id
])
def test_trace_context_must_be_a_valid_w3c_context(trace, fragment):
    with pytest.raises(FrameError, match=fragment):
        encode_message(StageMessage(K.Stop, trace_context=trace))
    if len(trace) == 25:  # the decoder refuses what the encoder would not write
        wire = bytearray(encode_message(StageMessage(K.Stop, trace_context=TRACE)))
        wire[-25:] = trace
        with pytest.raises(FrameError, match=fragment):
            decode_message(bytes(wire))
    wire = encode_message(StageMessage(K.Stop, trace_context=TRACE))
    with pytest.raises(FrameError, match="truncated"):
        decode_message(wire[:-1])


def test_stage_metrics_travel_as_i64_halves_in_a_status_reply():
    counters = {name: (1 << 40) + i for i, name in enumerate(COUNTERS)}   # past 32 bits
    gauges = {name: 3 * i for i, name in enumerate(GAUGES)}
    histograms = {name: HistogramValues(tuple(range(len(bounds) + 1)), 5_000_000_000)
                  for name, bounds in HISTOGRAMS.items()}
    metrics = StageMetricValues(counters, gauges, histograms)
    assert len(metrics.flat()) == METRIC_VALUE_COUNT == 83
    wire = encode_reply(StageReply.of_status(StageStatusReport(2, 10, 20, 1, 4, metrics)))
    first = 264 + 20  # after the header, the stats block and the five status values
    assert wire[first:first + 8] == struct.pack("<q", 1 << 40)  # low half, then high half
    decoded = decode_reply(wire).status
    assert decoded.metrics == metrics and decoded.values() == (2, 10, 20, 1, 4)
    assert encode_reply(StageReply.of_status(decoded)) == wire

    with pytest.raises(ValueError, match="COUNTERS"):
        StageMetricValues({}, gauges, histograms)


def test_a_stage_probe_travels_after_the_metrics():
    probe = StageProbe(row_ns=3_100_000, chunk_ns=41_000_000_000, chunk_rows=64, weight_bytes=5 << 30,
                       memory_available_bytes=20 << 30, link_rtt_ns=40_123_456, link_bytes_per_s=12_500_000,
                       row_dtype=int(ActivationDtype.f16), chunk_dtype=int(ActivationDtype.q8), row_cpu_ns=5_900_000,
                       threads=2, cpu_share_milli=250, cpu_ns=12_345_678_901)
    wire = encode_reply(StageReply.of_status(StageStatusReport(1, 10, 20, 0, 4, probe=probe)))
    first = 264 + 20 + 8 * 83  # the probe's i64 halves follow the metrics'
    assert wire[first:first + 8] == struct.pack("<q", 3_100_000)
    assert decode_reply(wire).status.probe == probe
    assert probe.figures()["link_chunk_dtype"] == "q8" and probe.figures()["link_mbit_s"] == 100.0
    assert StageProbe.from_figures(probe.figures()) == probe  # /v1/stages' JSON back to the probe
    final = StageProbe(row_ns=1)  # sends no rows: its dtypes are -1
    assert decode_reply(encode_reply(StageReply.of_status(StageStatusReport(1, 10, 20, 0, 4, probe=final)))
                        ).status.probe.figures()["link_row_dtype"] is None
    forged = bytearray(wire)
    forged[first + 8 * 7:first + 8 * 8] = struct.pack("<q", 9)  # row_dtype 9: no such dtype
    with pytest.raises(FrameError, match="row_dtype"):
        decode_reply(forged)


def test_logprob_block_layout():
    """docs/protocol.md §5.2 by hand: prompt entries first, then one per prediction, each the
    row's (token, logprob) pair and `logprob_top` pairs of i32 + f32."""
    reply = StageReply.token(42, logprobs=[TokenLogprob(42, -0.25, ((42, -0.25),))],
                             prompt_logprobs=[TokenLogprob(3, -4.0, ((1, -0.5),))])
    wire = encode_reply(reply)
    assert wire[40:48] == struct.pack("<ii", 1, 1)  # logprob_top 1, one prompt entry
    assert wire[264:] == (struct.pack("<i", 42) + struct.pack("<ifif", 3, -4.0, 1, -0.5)
                          + struct.pack("<ifif", 42, -0.25, 42, -0.25))
    with pytest.raises(FrameError, match="one per predicted token"):
        encode_reply(StageReply.window([5, 6], 3, logprobs=[TokenLogprob(5, -1.0)]))
    with pytest.raises(FrameError, match="pairs"):
        encode_reply(StageReply.window([5, 6], 3, logprobs=[TokenLogprob(5, -1.0), TokenLogprob(6, -1.0, ((6, -1.0),))]))


def test_sampling_logprobs_round_trip():
    for config in (SamplingConfig(logprobs=0), SamplingConfig(logprobs=20, prompt_logprobs=True, seed=3)):
        assert decode_sampling(encode_sampling(config)) == config
    with pytest.raises(ValueError, match="logprobs"):
        SamplingConfig(prompt_logprobs=True)
    with pytest.raises(FrameError, match="sampling.logprobs"):
        decode_message(_sampling_frame(logprobs=21))


# -- decode frames from a template (protocol/decode_frames.py) --------------------------------

def _decode_message(pos: int, step: int, token: int, rows: np.ndarray, dtype: ActivationDtype,
                    trace: bytes | None) -> StageMessage:
    return StageMessage(K.DecodeEmbd, request_id=9, session_id=4, pos_start=pos, token_count=1, tokens=[token],
                        current_token=token, decode_step=step, prompt_token_count=512, trace_context=trace,
                        source_stage_index=0, activation_dtype=dtype, activation_rows=1,
                        activation_width=rows.shape[1] * dtype.block_elements, activation=memoryview(rows).cast("B"))


@pytest.mark.parametrize("dtype, np_dtype", [(ActivationDtype.f32, np.float32), (ActivationDtype.f16, np.float16),
                                             (ActivationDtype.bf16, np.uint16), (ActivationDtype.q8, None)])
@pytest.mark.parametrize("trace", [None, TRACE])
def test_decode_frames_equal_encode_message_byte_for_byte(dtype, np_dtype, trace):
    from skippy.protocol.decode_frames import DecodeFrames

    rng = np.random.default_rng(7)

    def random_rows() -> np.ndarray:  # bf16 travels as its raw bits, q8 as its blocks
        if np_dtype is None:
            return q8_encode(rng.standard_normal((1, 64)).astype(np.float32))
        if np_dtype is np.uint16:
            return rng.integers(0, 2**16, (1, 24)).astype(np.uint16)
        return rng.standard_normal((1, 24)).astype(np_dtype)

    first = random_rows()
    frames = DecodeFrames(_decode_message(512, 1, 42, first, dtype, trace))
    for pos, step, token in [(512, 1, 42), (513, 2, 0), (2047, 1535, I32_MAX), (0, -1, I32_MIN), (9, 7, 151_000)]:
        rows = random_rows()
        message = _decode_message(pos, step, token, rows, dtype, trace)
        assert frames.fits(message, rows)
        assert frames.encode(pos, step, token, rows) == encode_message(message)
    # another trace context, request, session, row count or dtype: a new template
    assert not frames.fits(_decode_message(512, 1, 42, first, dtype, None if trace else TRACE), first)
    assert not frames.fits(replace(_decode_message(512, 1, 42, first, dtype, trace), request_id=10), first)
    assert not frames.fits(replace(_decode_message(512, 1, 42, first, dtype, trace), session_id=5), first)
    assert not frames.fits(_decode_message(512, 1, 42, first, dtype, trace), np.concatenate([first, first]))
    if np_dtype is np.float16:  # as many bytes, another dtype
        assert not frames.fits(_decode_message(512, 1, 42, first, dtype, trace), first.view(np.uint16))


def test_decode_frames_refuse_what_encode_message_refuses():
    from skippy.protocol.decode_frames import DecodeFrames

    rows = np.zeros((1, 8), np.float32)
    frames = DecodeFrames(_decode_message(3, 1, 5, rows, ActivationDtype.f32, None))
    for pos, step, token in [(-1, 1, 5), (I32_MAX + 1, 1, 5), (3, 1, I32_MAX + 1), (3, I32_MIN - 1, 5)]:
        with pytest.raises(FrameError):
            frames.encode(pos, step, token, rows)
        with pytest.raises((FrameError, ValueError)):
            encode_message(_decode_message(pos, step, token, rows, ActivationDtype.f32, None))
    with pytest.raises(ValueError, match="one-token DecodeEmbd"):
        DecodeFrames(StageMessage(K.Stop))


@pytest.mark.parametrize("dtype, np_dtype", [(ActivationDtype.f32, np.float32), (ActivationDtype.bf16, np.uint16)])
def test_decode_frame_reader_reads_what_decode_message_reads(dtype, np_dtype):
    from skippy.protocol.decode_frames import DecodeFrameReader

    rng = np.random.default_rng(3)
    rows = lambda: rng.integers(0, 2**15, (1, 24)).astype(np_dtype)  # noqa: E731
    first = _decode_message(512, 1, 42, rows(), dtype, None)
    reader = DecodeFrameReader(encode_message(first), first)
    for pos, step, token in [(513, 2, 7), (2047, 1535, I32_MAX), (0, -1, I32_MIN)]:
        frame = encode_message(_decode_message(pos, step, token, rows(), dtype, None))
        read = reader.read(bytearray(frame + b"the next frame"))
        assert read == decode_message(frame)
        assert (read.pos_start, read.decode_step, read.current_token) == (pos, step, token)
        assert read.tokens.tolist() == [token]
    # the sideband and the header's token are read where decode_message reads them
    odd = encode_message(replace(_decode_message(600, 3, 11, rows(), dtype, None), current_token=12))
    assert reader.read(bytearray(odd)) == decode_message(odd)

    # anything else that differs: decoded in full, where each check speaks
    others = [replace(first, session_id=5), replace(first, request_id=10), replace(first, prompt_token_count=9),
              replace(first, trace_context=TRACE), StageMessage(K.Stop, request_id=9, session_id=4),
              _decode_message(512, 1, 42, rows().astype(np.float16), ActivationDtype.f16, None),
              _decode_message(512, 1, 42, np.zeros((1, 32), np_dtype), dtype, None)]
    for other in others:
        assert reader.read(bytearray(encode_message(other))) is None
    whole = encode_message(_decode_message(513, 2, 7, rows(), dtype, None))
    assert reader.read(bytearray(whole[:-1])) is None  # not all there yet
    negative = bytearray(whole)
    negative[36:40] = (-1).to_bytes(4, "little", signed=True)  # pos_start, which the header check refuses
    assert reader.read(negative) is None
    with pytest.raises(ValueError, match="one-token DecodeEmbd"):
        DecodeFrameReader(encode_message(StageMessage(K.Stop)), StageMessage(K.Stop))


def test_token_reply_equals_encode_reply():
    from skippy.protocol.decode_frames import token_reply
    from skippy.protocol.stats import NO_STATS, is_empty

    assert NO_STATS == StageReplyStats() and is_empty(StageReplyStats()) and is_empty(NO_STATS)
    assert not is_empty(StageReplyStats(kv_lookup_hits=1))
    for token in (0, 1, 42, 151_000, I32_MAX, I32_MIN):
        assert token_reply(token) == encode_reply(StageReply.token(token))
        assert decode_reply(token_reply(token)).predicted_tokens == [token]
    for token in (I32_MAX + 1, I32_MIN - 1):
        with pytest.raises(FrameError):
            token_reply(token)


def test_token_of_reply_reads_back_token_reply_only():
    from skippy.protocol.decode_frames import TOKEN_REPLY_BYTES, token_of_reply, token_reply

    for token in (0, 1, 42, 151_000, I32_MAX, I32_MIN):
        frame = token_reply(token)
        assert len(frame) == TOKEN_REPLY_BYTES
        assert token_of_reply(frame) == token
        assert token_of_reply(frame + b"next frame") == token  # the first frame of a buffer
        assert token_of_reply(frame[:-1]) is None  # short
    for other in (StageReply.token(5, StageReplyStats(kv_lookup_hits=1)), StageReply.window([5], 1),
                  StageReply.ack()):
        assert token_of_reply(encode_reply(other)) is None
    torn = bytearray(token_reply(7))
    torn[-4:] = token_reply(8)[-4:]  # the header's token and the array's disagree
    assert token_of_reply(torn) is None


def test_a_buffer_reader_takes_whole_frames_and_reads_decode_frames_against_the_first():
    """MessageReader: what a socket's bytes hold, whole frames only, each as decode_message
    reads it (a session's one-row decode frames against its first, the rest in full)."""
    from skippy.protocol.decode_frames import MessageReader, read_reply_from

    rows = np.arange(24, dtype=np.float32).reshape(1, 24)
    messages = [_decode_message(512 + i, i, 40 + i, rows + i, ActivationDtype.f32, None) for i in range(3)]
    messages.insert(1, StageMessage(K.Stop, request_id=9, session_id=4))
    wire = bytearray(b"".join(encode_message(m) for m in messages))
    read, reader = [], MessageReader()
    for cut in (1, 103, 104, 105, len(wire)):  # bytes arrive cut anywhere
        buffer = bytearray(wire[:cut])
        while (got := reader(buffer)) is not None:
            read.append(got[0])
            del buffer[:got[1]]
        if cut == len(wire):
            assert not buffer
    assert read[-4:] == messages and read[-4:] == [decode_message(encode_message(m)) for m in messages]
    token, ack = encode_reply(StageReply.token(7)), encode_reply(StageReply.ack())
    assert read_reply_from(bytearray(token + ack))[0] == StageReply.token(7)
    assert read_reply_from(bytearray(ack[:-1])) is None and read_reply_from(bytearray(ack))[1] == len(ack)
