"""Every number of the stage wire protocol, in one place (spec §2; docs/protocol.md).

Encoders and decoders take all magics, sizes, formats and limits from here.
The layout is our own (little-endian, explicit section lengths); it follows the
Rust peers' vocabulary and kind codes but is not byte-compatible with them.
"""

from __future__ import annotations

import struct
from enum import IntEnum, IntFlag
from typing import NamedTuple

import numpy as np

# Version of this Python wire format. Frames, replies and READY carry it; any other
# value fails closed (spec §2.11): peers must upgrade together.
PROTOCOL_VERSION = 6   # 2: the CACHE_NAMESPACE section; 3: a grammar in the sampling block;
                       # 4: the TRACE_CONTEXT section, stage metrics in StageStatus;
                       # 5: logprobs (a count in the sampling block, a block in replies),
                       #    the LARK grammar kind (enforced tool calls);
                       # 6: q8 activations, LinkProbe, the stage's probe in StageStatus

# Magics are u32 written little-endian; the ASCII spelling is the value read
# most-significant byte first, as the spec writes READY's 0x53524459 ("SRDY").
AUTH_MAGIC    = 0x53415554  # "SAUT"  auth preamble, dialer -> server   (§2.1)
FETCH_MAGIC   = 0x53464554  # "SFET"  the same preamble, opening the tensor side channel (§11)
READY_MAGIC   = 0x53524459  # "SRDY"  READY, server -> dialer           (§2.1)
MESSAGE_MAGIC = 0x534D5347  # "SMSG"  stage message, upstream -> down   (§2.2)
REPLY_MAGIC   = 0x53525059  # "SRPY"  reply, downstream -> upstream     (§2.5)


class MessageKind(IntEnum):
    """`WireMessageKind` codes (spec §2.4). Codes we do not implement are unknown kinds."""

    PrefillEmbd             = 1
    DecodeEmbd              = 2
    Stop                    = 3
    PrefillFinalEmbd        = 4
    ConfigureGeneration     = 14
    TryRestorePrefill       = 17
    TryRestorePrefillDecode = 18
    TrimSession             = 19
    PredictionReturnOpen    = 20
    VerifyWindow            = 21
    RetireVerifyWindow      = 22
    DiscardStaleWindows     = 23
    GetStageStatus          = 24  # ours: this stage's layers and open sessions; not forwarded
    LinkProbe               = 25  # ours: filler tokens, ACKed once read; not forwarded (RTT, bandwidth)


class ReplyKind(IntEnum):
    """`WireReplyKind` (spec §2.5)."""

    Ack             = 1
    PredictedToken  = 2
    PredictedTokens = 3
    StageStatus     = 4  # ours: answers GetStageStatus


class Phase(IntEnum):
    """State-header phase (spec §2.3). DecodeReplay=3 and DecodeLight=4 are not used."""

    Prefill = 1
    Decode  = 2


class StateFlags(IntFlag):
    """State-header flag bits, numbered as in spec §2.3.

    Every bit we use is derived from the message itself (kind, sampling block,
    chat metadata); other bits of the spec (LIGHT_CONTEXT, FULL_STATE, model
    sidebands) have no meaning here and are rejected.
    """

    FINAL_CHUNK   = 1 << 0  # set iff kind is PrefillFinalEmbd
    SAMPLING      = 1 << 3  # a sampling block follows
    CHAT_METADATA = 1 << 5  # chat-sampling metadata follows (spec: CHAT_SAMPLING_METADATA)
    CACHE_NAMESPACE = 1 << 16  # ours: a 32-byte prefix-cache namespace digest follows
    TRACE_CONTEXT = 1 << 17    # ours: a 25-byte W3C trace context (trace id, parent span id, flags)


# Masks are compared as plain ints: `~` on an IntFlag only complements within the known bits.
KNOWN_STATE_FLAGS = (StateFlags.FINAL_CHUNK | StateFlags.SAMPLING | StateFlags.CHAT_METADATA
                     | StateFlags.CACHE_NAMESPACE | StateFlags.TRACE_CONTEXT)


class SamplingFlags(IntFlag):
    """Flag word inside the sampling block (§2.3, our layout)."""

    HAS_SEED = 1 << 0
    PROMPT_LOGPROBS = 1 << 1  # the final stage also returns every prompt token's logprob


KNOWN_SAMPLING_FLAGS = SamplingFlags.HAS_SEED | SamplingFlags.PROMPT_LOGPROBS


class GrammarKind(IntEnum):
    """What constrains a request's output (ours, in the sampling block): 0 = nothing."""

    JSON_OBJECT = 1  # any JSON object (OpenAI's response_format json_object); no grammar text
    JSON_SCHEMA = 2  # the JSON Schema in the grammar text (response_format json_schema)
    LARK = 3  # a lark grammar in llguidance's dialect (enforced tool calls: api/tools.py writes it)


class ActivationDtype(IntEnum):
    """Element type of the activation payload (spec §2.2 "version drift": f32, f16, bf16;
    q8 is ours: blockwise 8-bit, llama.cpp's Q8_0 block, see ACTIVATION_LAYOUT)."""

    f32  = 0
    f16  = 1
    bf16 = 2
    q8   = 3

    @property
    def block_elements(self) -> int:
        """Values per block: a row's width must be a multiple of it."""
        return ACTIVATION_LAYOUT[self][0]

    @property
    def block_bytes(self) -> int:
        return ACTIVATION_LAYOUT[self][1]

    def nbytes(self, rows: int, width: int) -> int:
        """Wire bytes of `rows` rows of `width` values (width a multiple of block_elements)."""
        return rows * (width // self.block_elements) * self.block_bytes


# A row is width / elements blocks of these bytes. q8 is llama.cpp's Q8_0 block: an f16
# scale d, then 32 int8 codes q; value i = d * q[i] (protocol/activation_codec.py).
#                    dtype                 elements  bytes
ACTIVATION_LAYOUT = {ActivationDtype.f32:  (1,       4),
                     ActivationDtype.f16:  (1,       2),
                     ActivationDtype.bf16: (1,       2),
                     ActivationDtype.q8:   (32,      34)}
Q8_BLOCK_VALUES = 32

# One numpy item per block. numpy has no bfloat16: bf16 rows are their raw uint16 bit
# patterns; a q8 row is width / 32 records of (scale, codes).
Q8_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (Q8_BLOCK_VALUES,))])
ACTIVATION_NUMPY_DTYPE = {ActivationDtype.f32:  np.dtype("<f4"),
                          ActivationDtype.f16:  np.dtype("<f2"),
                          ActivationDtype.bf16: np.dtype("<u2"),
                          ActivationDtype.q8:   Q8_BLOCK}
assert all(ACTIVATION_NUMPY_DTYPE[d].itemsize == ACTIVATION_LAYOUT[d][1] for d in ActivationDtype)
_BY_NUMPY_DTYPE = {numpy_dtype: dtype for dtype, numpy_dtype in ACTIVATION_NUMPY_DTYPE.items()}


def activation_dtype_of(rows: np.ndarray) -> ActivationDtype:
    """The wire dtype of rows held as ACTIVATION_NUMPY_DTYPE says (KeyError for any other array)."""
    return _BY_NUMPY_DTYPE[rows.dtype]


# -- Limits: decoders check every count against these on the fixed header, before the body -
MiB = 1 << 20

MAX_SIDEBAND_COUNT     = 1_048_576  # i32 values per token / position sideband    (§2.2)
MAX_ACTIVATION_BYTES   = 512 * MiB  # activation payload, wire and decoded        (§2.2)
MAX_METADATA_BYTES     = 8 * MiB    # chat-sampling metadata                      (§2.2 row 10)
MAX_LOGIT_BIAS_COUNT   = 256        # logit-bias entries in a sampling block      (§2.3)
MAX_GRAMMAR_BYTES      = 256 * 1024 # a grammar's UTF-8 text in a sampling block  (ours)
MAX_PREDICTED_COUNT    = 262_144    # predicted tokens in one reply               (§2.5)
MAX_DRAFT_COUNT        = 262_144    # native MTP draft tokens in one reply        (§2.5 row 5)
MAX_PROMPT_LOGPROB_COUNT = 262_144  # prompt logprob entries in one reply        (ours)
NAMESPACE_BYTES        = 32         # prefix-cache namespace digest (ours, §4.2 item 7)
TRACE_CONTEXT_BYTES    = 25         # W3C trace context: 16-byte trace id, 8-byte span id, flags (ours)
MIN_AUTH_TOKEN_BYTES   = 1          # auth preamble token length                  (§2.1)
MAX_AUTH_TOKEN_BYTES   = 64         #                                             (§2.1)


# -- Struct formats, all little-endian ("<", no padding). --------------------------------
class HeaderField(NamedTuple):
    name: str
    fmt: str


# Stage message fixed header (§2.2, our layout: explicit section lengths, u64s 8-aligned).
MESSAGE_HEADER_FIELDS = (
    #            name                       fmt    offset
    HeaderField("magic",                   "I"),  # 0    MESSAGE_MAGIC
    HeaderField("version",                 "i"),  # 4    PROTOCOL_VERSION
    HeaderField("request_id",              "Q"),  # 8
    HeaderField("session_id",              "Q"),  # 16
    HeaderField("activation_bytes",        "Q"),  # 24   explicit payload length
    HeaderField("kind",                    "i"),  # 32   MessageKind
    HeaderField("pos_start",               "i"),  # 36
    HeaderField("token_count",             "i"),  # 40
    HeaderField("token_sideband_count",    "i"),  # 44
    HeaderField("position_sideband_count", "i"),  # 48
    HeaderField("seq_id",                  "i"),  # 52   window id for VerifyWindow
    HeaderField("phase",                   "i"),  # 56   Phase
    HeaderField("flags",                   "I"),  # 60   StateFlags
    HeaderField("checkpoint_generation",   "i"),  # 64
    HeaderField("prompt_token_count",      "i"),  # 68
    HeaderField("decode_step",             "i"),  # 72
    HeaderField("current_token",           "i"),  # 76
    HeaderField("source_stage_index",      "i"),  # 80   -1 = from the driver, no activation
    HeaderField("activation_dtype",        "i"),  # 84   ActivationDtype
    HeaderField("activation_rows",         "i"),  # 88
    HeaderField("activation_width",        "i"),  # 92
    HeaderField("sampling_bytes",          "I"),  # 96   0 unless SAMPLING
    HeaderField("metadata_bytes",          "I"),  # 100  0 unless CHAT_METADATA
)
MESSAGE_HEADER = struct.Struct("<" + "".join(f.fmt for f in MESSAGE_HEADER_FIELDS))  # 104 bytes

# Sampling block (§2.3, our layout): f64 so SamplingConfig round-trips exactly.
SAMPLING_FIELDS = (
    HeaderField("temperature",        "d"),  # 0
    HeaderField("top_p",              "d"),  # 8
    HeaderField("min_p",              "d"),  # 16
    HeaderField("repetition_penalty", "d"),  # 24
    HeaderField("presence_penalty",   "d"),  # 32
    HeaderField("frequency_penalty",  "d"),  # 40
    HeaderField("seed",               "q"),  # 48   meaningful iff HAS_SEED
    HeaderField("top_k",              "i"),  # 56
    HeaderField("penalty_last_n",     "i"),  # 60
    HeaderField("sampling_flags",     "I"),  # 64   SamplingFlags
    HeaderField("logit_bias_count",   "I"),  # 68
    HeaderField("grammar_kind",       "I"),  # 72   GrammarKind, 0 = none
    HeaderField("grammar_bytes",      "I"),  # 76   UTF-8 grammar text after the bias entries
    HeaderField("logprobs",           "i"),  # 80   top logprobs per row; -1 = no logprobs
)
SAMPLING_BLOCK = struct.Struct("<" + "".join(f.fmt for f in SAMPLING_FIELDS))  # 84 bytes
LOGIT_BIAS_ENTRY = struct.Struct("<id")  # token id, bias: 12 bytes, ascending token ids
MAX_SAMPLING_BYTES = (SAMPLING_BLOCK.size + MAX_LOGIT_BIAS_COUNT * LOGIT_BIAS_ENTRY.size
                      + MAX_GRAMMAR_BYTES)

# Reply fixed header (§2.5), followed by StageReplyStats (§2.6), then the token arrays.
REPLY_HEADER_FIELDS = (
    HeaderField("magic",            "I"),  # 0    REPLY_MAGIC
    HeaderField("version",          "i"),  # 4
    HeaderField("kind",             "i"),  # 8    ReplyKind
    HeaderField("predicted",        "i"),  # 12
    HeaderField("window_id",        "i"),  # 16
    HeaderField("predicted_count",  "i"),  # 20
    HeaderField("has_draft",        "i"),  # 24   0 or 1
    HeaderField("draft_count",      "i"),  # 28
    HeaderField("draft_compute_us", "q"),  # 32
    HeaderField("logprob_top",      "i"),  # 40   top pairs per logprob entry; -1 = no logprob block
    HeaderField("prompt_logprob_count", "i"),  # 44   prompt entries before the predicted ones
)
REPLY_HEADER = struct.Struct("<" + "".join(f.fmt for f in REPLY_HEADER_FIELDS))  # 48 bytes
# A logprob entry: (token id, logprob) for the row's token, then `logprob_top` pairs of the
# row's most likely tokens; every pair is an i32 and an f32.
LOGPROB_PAIR = struct.Struct("<if")
STATS_FIELD_COUNT = 27                                       # §2.6
STATS_BLOCK = struct.Struct(f"<{STATS_FIELD_COUNT}q")        # 216 bytes
REPLY_FIXED_BYTES = REPLY_HEADER.size + STATS_BLOCK.size     # 264 bytes

AUTH_PREFIX = struct.Struct("<IB")  # magic, token length; the token bytes follow  (§2.1)
READY = struct.Struct("<Ii")        # magic, protocol version                      (§2.1)

I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
U64_MAX = (1 << 64) - 1


def header_offset(fields: tuple[HeaderField, ...], name: str) -> int:
    """Byte offset of a named field in one of the header tables above."""
    offset = 0
    for field in fields:
        if field.name == name:
            return offset
        offset += struct.calcsize("<" + field.fmt)
    raise KeyError(name)


# -- Per-kind rules (spec §2.3 expected phase, §2.4 direction and reply). ----------------
class KindInfo(NamedTuple):
    phase: Phase                 # the phase the state header must carry
    has_activation: bool         # may carry an activation payload
    reply: ReplyKind | None      # reply owed upstream; None = fire-and-forget


K, P, R = MessageKind, Phase, ReplyKind
KIND_INFO: dict[MessageKind, KindInfo] = {
    #  kind                        phase      activation  reply
    K.PrefillEmbd:             KindInfo(P.Prefill, True,  R.Ack),             # early, on receipt
    K.DecodeEmbd:              KindInfo(P.Decode,  True,  R.PredictedToken),
    K.Stop:                    KindInfo(P.Decode,  False, R.Ack),             # with merged stats
    K.PrefillFinalEmbd:        KindInfo(P.Prefill, True,  R.PredictedToken),
    K.ConfigureGeneration:     KindInfo(P.Prefill, False, R.Ack),
    K.TryRestorePrefill:       KindInfo(P.Prefill, False, R.Ack),             # with kv stats
    K.TryRestorePrefillDecode: KindInfo(P.Prefill, True,  R.Ack),             # + a token on a hit
    K.TrimSession:             KindInfo(P.Prefill, False, R.Ack),
    K.PredictionReturnOpen:    KindInfo(P.Decode,  False, None),              # replies follow
    K.VerifyWindow:            KindInfo(P.Decode,  True,  R.PredictedTokens),
    K.RetireVerifyWindow:      KindInfo(P.Prefill, False, None),
    K.DiscardStaleWindows:     KindInfo(P.Decode,  False, None),              # tokens [min, max]
    K.GetStageStatus:          KindInfo(P.Prefill, False, R.StageStatus),
    K.LinkProbe:               KindInfo(P.Prefill, False, R.Ack),             # once the whole frame is read
}
del K, P, R

# Kinds that may carry a CACHE_NAMESPACE section: where a session learns its namespace.
NAMESPACE_KINDS = frozenset({MessageKind.ConfigureGeneration, MessageKind.TryRestorePrefill,
                             MessageKind.TryRestorePrefillDecode})
