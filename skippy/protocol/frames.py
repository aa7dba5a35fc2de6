"""Stage messages and replies as dataclasses, and their pure binary encode/decode.

Decoding validates in a fixed order (magic, version, counts and limits, kind/phase/flags,
lengths, body, no trailing bytes) and returns views into the input buffer, not copies: do not
mutate the buffer while a message uses it.
"""

from __future__ import annotations

import dataclasses

import hashlib
import math
import struct
from collections import namedtuple
from dataclasses import dataclass, field, replace
from typing import NoReturn

import numpy as np

from .constants import (
    ACTIVATION_NUMPY_DTYPE, I32_MAX, I32_MIN, KIND_INFO, KNOWN_SAMPLING_FLAGS,
    KNOWN_STATE_FLAGS, LOGIT_BIAS_ENTRY, LOGPROB_PAIR, MAX_ACTIVATION_BYTES, MAX_DRAFT_COUNT,
    MAX_GRAMMAR_BYTES, MAX_LOGIT_BIAS_COUNT, MAX_METADATA_BYTES, MAX_PREDICTED_COUNT,
    MAX_PROMPT_LOGPROB_COUNT, MAX_SAMPLING_BYTES, MAX_SIDEBAND_COUNT,
    MESSAGE_HEADER, MESSAGE_HEADER_FIELDS, MESSAGE_MAGIC, NAMESPACE_BYTES, NAMESPACE_KINDS,
    PROTOCOL_VERSION, TRACE_CONTEXT_BYTES, REPLY_HEADER, REPLY_HEADER_FIELDS, REPLY_MAGIC, SAMPLING_BLOCK, STATS_BLOCK,
    ActivationDtype, GrammarKind, MessageKind, Phase, ReplyKind, SamplingFlags, StateFlags,
)
from .activation_codec import check_q8_scales
from .errors import FrameError, VersionMismatch
from .logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from .sampling_config import GrammarSpec, SamplingConfig
from .stage_metrics import METRIC_VALUE_COUNT, StageMetricValues
from .stage_probe import PROBE_VALUE_COUNT, StageProbe
from .stats import NO_STATS, StageReplyStats, decode_stats, encode_stats

_I32 = np.dtype("<i4")
Buffer = bytes | bytearray | memoryview


NAMESPACE_DOMAIN = b"openai-cache-namespace-v1\0"


def cache_namespace_digest(prompt_cache_key: str | None) -> bytes | None:
    """The wire form of a client's `prompt_cache_key`: blake2b-256 of a domain tag and the
    key's UTF-8 bytes (None stays None: the shared default namespace). Every stage hashes
    the same digest into its prefix-cache keys, and no stage ever sees the key itself."""
    if prompt_cache_key is None:
        return None
    return hashlib.blake2b(NAMESPACE_DOMAIN + prompt_cache_key.encode("utf-8"),
                           digest_size=NAMESPACE_BYTES).digest()


def _empty_i32() -> np.ndarray:
    return np.empty(0, dtype=_I32)


def _as_i32_array(name: str, values: object) -> np.ndarray:
    if type(values) is list and all(type(v) is int for v in values):
        # the decode path's case (a list of a few Python ints): numpy checks the range itself
        try:
            return np.array(values, dtype=_I32)
        except OverflowError:
            pass  # the general path below words the error
    array = np.asarray(values)
    if array.dtype != _I32 and array.size:
        if (array.dtype.kind not in "iuO"
                or not I32_MIN <= array.min() <= array.max() <= I32_MAX):
            raise ValueError(f"{name}: expected integers in [{I32_MIN}, {I32_MAX}], got "
                             f"{array.dtype} values {array.ravel()[:4].tolist()}...")
    if array.dtype != _I32:
        array = array.astype(_I32)
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {array.shape}")
    return array


def activation_fields(rows: np.ndarray, dtype: ActivationDtype, source_stage_index: int) -> dict:
    """The StageMessage fields that carry `rows` (a wire-dtype array, one item per block: see
    ACTIVATION_NUMPY_DTYPE) from `source_stage_index`."""
    return dict(source_stage_index=source_stage_index, activation_dtype=dtype, activation_rows=rows.shape[0],
                activation_width=rows.shape[1] * dtype.block_elements, activation=memoryview(rows).cast("B"))


def _byte_view(buf: object) -> memoryview:
    view = memoryview(buf)  # type: ignore[arg-type]
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@dataclass(frozen=True, slots=True, eq=False)
class StageMessage:
    """One stage message (spec §2.2, §2.4).

    `phase` and `flags` are not fields: they follow from the kind and which optional
    sections are present, so they cannot disagree.
    `tokens` / `positions` become 1-D int32 arrays and `activation` a flat byte
    memoryview of `activation_rows x activation_width` elements of
    `activation_dtype`, token-major.
    """

    kind: MessageKind
    pos_start: int = 0               # decode/verify kinds: authoritative committed position (§3.4)
    token_count: int = 0             # rows; RetireVerifyWindow: retired count; Trim: new length
    request_id: int = 0              # u64
    session_id: int = 0              # u64
    seq_id: int = 0                  # VerifyWindow: the window id
    checkpoint_generation: int = 0
    prompt_token_count: int = 0
    decode_step: int = 0
    current_token: int = 0
    source_stage_index: int = -1     # -1: sent by the driver
    sampling: SamplingConfig | None = None
    chat_metadata: bytes | None = None   # opaque UTF-8 JSON for the final stage's sampler
    cache_namespace: bytes | None = None  # 32-byte prefix-cache namespace digest (NAMESPACE_KINDS)
    trace_context: bytes | None = None  # 25-byte W3C trace context: the span this message is a child of
    tokens: np.ndarray = field(default_factory=_empty_i32)
    positions: np.ndarray = field(default_factory=_empty_i32)
    activation_dtype: ActivationDtype = ActivationDtype.f32
    activation_rows: int = 0
    activation_width: int = 0
    activation: memoryview = field(default_factory=lambda: memoryview(b""))

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "kind", MessageKind(self.kind))
        set_(self, "activation_dtype", ActivationDtype(self.activation_dtype))
        set_(self, "tokens", _as_i32_array("tokens", self.tokens))
        set_(self, "positions", _as_i32_array("positions", self.positions))
        set_(self, "activation", _byte_view(self.activation))
        if self.chat_metadata is not None and not isinstance(self.chat_metadata, bytes):
            set_(self, "chat_metadata", bytes(self.chat_metadata))
        if self.cache_namespace is not None and not isinstance(self.cache_namespace, bytes):
            set_(self, "cache_namespace", bytes(self.cache_namespace))
        if self.trace_context is not None and not isinstance(self.trace_context, bytes):
            set_(self, "trace_context", bytes(self.trace_context))

    @property
    def phase(self) -> Phase:
        return KIND_INFO[self.kind].phase

    @property
    def flags(self) -> StateFlags:
        flags = StateFlags(0)
        if self.kind == MessageKind.PrefillFinalEmbd:
            flags |= StateFlags.FINAL_CHUNK
        if self.sampling is not None:
            flags |= StateFlags.SAMPLING
        if self.chat_metadata is not None:
            flags |= StateFlags.CHAT_METADATA
        if self.cache_namespace is not None:
            flags |= StateFlags.CACHE_NAMESPACE
        if self.trace_context is not None:
            flags |= StateFlags.TRACE_CONTEXT
        return flags

    def activation_array(self) -> np.ndarray:
        """The activation as a (rows, width) view; bf16 as raw uint16 bits, q8 as Q8_BLOCK
        records with their scales checked (template-read decode frames skip the body checks)."""
        dtype = self.activation_dtype
        rows = np.frombuffer(self.activation, dtype=ACTIVATION_NUMPY_DTYPE[dtype]
                             ).reshape(self.activation_rows, self.activation_width // dtype.block_elements)
        if dtype == ActivationDtype.q8:
            check_q8_scales(rows)
        return rows

    def derived(self, **values) -> StageMessage:
        """This message with `values` set as they are, without __post_init__'s normalization
        (`replace` runs it again: 12 us hot, ~50 where a decode frame is read cold). Only for
        values already in the form it makes: ints, an int32 array, a flat byte memoryview."""
        derived = _new_message(StageMessage)
        for name in _FIELDS:
            _set_field(derived, name, values[name] if name in values else getattr(self, name))
        return derived

    def with_activation(self, rows: np.ndarray, dtype: ActivationDtype, source_stage_index: int) -> StageMessage:
        """This message carrying `rows` (wire-dtype array) from `source_stage_index` instead."""
        return replace(self, **activation_fields(rows, dtype, source_stage_index))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StageMessage):
            return NotImplemented
        return (all(getattr(self, name) == getattr(other, name) for name in _SCALAR_FIELDS)
                and np.array_equal(self.tokens, other.tokens)
                and np.array_equal(self.positions, other.positions)
                and self.activation == other.activation)

    __hash__ = None  # type: ignore[assignment]


_FIELDS = tuple(StageMessage.__dataclass_fields__)
_SCALAR_FIELDS = tuple(name for name in _FIELDS if name not in ("tokens", "positions", "activation"))
_new_message, _set_field = object.__new__, object.__setattr__


class MessageHeader(namedtuple("MessageHeader", [f.name for f in MESSAGE_HEADER_FIELDS])):
    """The unpacked fixed header of a stage message (MESSAGE_HEADER_FIELDS order)."""

    __slots__ = ()

    @property
    def body_bytes(self) -> int:
        return (4 * (self.token_sideband_count + self.position_sideband_count)
                + self.activation_bytes + self.sampling_bytes + self.metadata_bytes
                + (NAMESPACE_BYTES if self.flags & _NAMESPACE else 0)
                + (TRACE_CONTEXT_BYTES if self.flags & _TRACE else 0))


# -- Stage message: validation shared by the encoder and the decoder ---------------------
_KIND_CODES = frozenset(MessageKind)
_REPLY_KIND_CODES = frozenset(ReplyKind)
_DTYPE_CODES = frozenset(ActivationDtype)
# Plain ints: IntFlag arithmetic is slow, and `~` on an IntFlag keeps only known bits.
_FINAL, _SAMPLING, _METADATA, _NAMESPACE, _TRACE = (
    int(StateFlags.FINAL_CHUNK), int(StateFlags.SAMPLING), int(StateFlags.CHAT_METADATA),
    int(StateFlags.CACHE_NAMESPACE), int(StateFlags.TRACE_CONTEXT))
_UNKNOWN_FLAGS = ~int(KNOWN_STATE_FLAGS)
_COUNT_FIELDS = ("pos_start", "token_count", "prompt_token_count", "activation_rows",
                 "activation_width")


def _fail(field_name: str, expected: object, got: object) -> NoReturn:
    raise FrameError(f"{field_name}: expected {expected}, got {got}")


def _require(ok: bool, field_name: str, expected: str, got: object) -> None:
    """For cold paths; hot paths use `if ...: _fail(...)` so no message is built."""
    if not ok:
        _fail(field_name, expected, got)


def check_message_header(h: MessageHeader) -> None:
    """Everything that can be checked before the body is read, in the spec's order."""
    if h.magic != MESSAGE_MAGIC:
        _fail("magic", f"{MESSAGE_MAGIC:#010x}", f"{h.magic:#010x}")
    if h.version != PROTOCOL_VERSION:
        raise VersionMismatch("stage message", PROTOCOL_VERSION, h.version)
    # Counts and limits: nothing below allocates more than these allow.
    for name in _COUNT_FIELDS:
        if getattr(h, name) < 0:
            _fail(name, ">= 0", getattr(h, name))
    if h.source_stage_index < -1:
        _fail("source_stage_index", ">= -1", h.source_stage_index)
    if not 0 <= h.token_sideband_count <= MAX_SIDEBAND_COUNT:
        _fail("token_sideband_count", f"0..{MAX_SIDEBAND_COUNT}", h.token_sideband_count)
    if not 0 <= h.position_sideband_count <= MAX_SIDEBAND_COUNT:
        _fail("position_sideband_count", f"0..{MAX_SIDEBAND_COUNT}", h.position_sideband_count)
    if h.activation_bytes > MAX_ACTIVATION_BYTES:
        _fail("activation_bytes", f"<= {MAX_ACTIVATION_BYTES}", h.activation_bytes)
    if h.sampling_bytes > MAX_SAMPLING_BYTES:
        _fail("sampling_bytes", f"<= {MAX_SAMPLING_BYTES}", h.sampling_bytes)
    if h.metadata_bytes > MAX_METADATA_BYTES:
        _fail("metadata_bytes", f"<= {MAX_METADATA_BYTES}", h.metadata_bytes)
    # Kind, phase and flags agree.
    if h.kind not in _KIND_CODES:
        _fail("kind", f"one of {sorted(int(k) for k in MessageKind)}", h.kind)
    kind = MessageKind(h.kind)
    info = KIND_INFO[kind]
    if h.phase != info.phase:
        _fail("phase", f"{int(info.phase)} ({info.phase.name}) for {kind.name}", h.phase)
    if h.flags & _UNKNOWN_FLAGS:
        _fail("flags", f"only bits {int(KNOWN_STATE_FLAGS):#x}", f"{h.flags:#x}")
    is_final, want_final = bool(h.flags & _FINAL), kind == MessageKind.PrefillFinalEmbd
    if is_final != want_final:
        _fail("flags.FINAL_CHUNK", f"{'set' if want_final else 'clear'} for {kind.name}",
              "set" if is_final else "clear")
    if h.flags & _NAMESPACE and kind not in NAMESPACE_KINDS:
        _fail("flags.CACHE_NAMESPACE", "clear for " + kind.name + " (only "
              + ", ".join(k.name for k in sorted(NAMESPACE_KINDS)) + ")", "set")
    if h.activation_dtype not in _DTYPE_CODES:
        _fail("activation_dtype", f"one of {[int(d) for d in ActivationDtype]}", h.activation_dtype)
    if not info.has_activation:
        for name in ("activation_bytes", "activation_rows", "activation_width"):
            if getattr(h, name) != 0:
                _fail(name, f"0 for {kind.name}", getattr(h, name))
    if kind == MessageKind.DiscardStaleWindows and h.token_sideband_count != 2:
        _fail("token_sideband_count", "2 ([min_window_id, max_window_id]) for DiscardStaleWindows",
              h.token_sideband_count)
    # Section lengths (the sampling block's exact length needs its own counts: decode_sampling).
    if h.flags & _SAMPLING:
        if h.sampling_bytes < SAMPLING_BLOCK.size:
            _fail("sampling_bytes", f">= {SAMPLING_BLOCK.size} with the SAMPLING flag", h.sampling_bytes)
    elif h.sampling_bytes:
        _fail("sampling_bytes", "0 without the SAMPLING flag", h.sampling_bytes)
    if h.metadata_bytes and not h.flags & _METADATA:
        _fail("metadata_bytes", "0 without the CHAT_METADATA flag", h.metadata_bytes)
    dtype = ActivationDtype(h.activation_dtype)
    if h.activation_width % dtype.block_elements:
        _fail("activation_width", f"a multiple of {dtype.block_elements} for {dtype.name}", h.activation_width)
    if h.activation_bytes != dtype.nbytes(h.activation_rows, h.activation_width):
        _fail("activation_bytes",
              f"{dtype.nbytes(h.activation_rows, h.activation_width)} (rows {h.activation_rows} x "
              f"width {h.activation_width} / {dtype.block_elements} x {dtype.block_bytes} bytes of "
              f"{dtype.name})", h.activation_bytes)


def parse_message_header(buf: Buffer) -> MessageHeader:
    """Unpack and check the fixed header; `header.body_bytes` then says how much to read."""
    if len(buf) < MESSAGE_HEADER.size:
        _fail("message header", f"{MESSAGE_HEADER.size} bytes", f"{len(buf)} (truncated)")
    header = MessageHeader(*MESSAGE_HEADER.unpack_from(buf, 0))
    check_message_header(header)
    return header


# -- Sampling block (spec §2.3, our layout) ----------------------------------------------
_SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty")


def _check_sampling_values(cfg: SamplingConfig) -> None:
    for name in _SAMPLING_FLOATS:
        value = getattr(cfg, name)
        _require(math.isfinite(value), f"sampling.{name}", "a finite number", value)
    for token, bias in cfg.logit_bias.items():
        _require(not math.isnan(bias), f"sampling.logit_bias[{token}]", "a number (not NaN)", bias)


def encode_sampling(cfg: SamplingConfig) -> bytes:
    _check_sampling_values(cfg)
    entries = sorted(cfg.logit_bias.items())  # canonical order: ascending token id
    _require(len(entries) <= MAX_LOGIT_BIAS_COUNT, "sampling.logit_bias",
             f"<= {MAX_LOGIT_BIAS_COUNT} entries", len(entries))
    flags = SamplingFlags.HAS_SEED if cfg.seed is not None else SamplingFlags(0)
    if cfg.prompt_logprobs:
        flags |= SamplingFlags.PROMPT_LOGPROBS
    grammar = cfg.grammar
    text = b"" if grammar is None else grammar.text.encode("utf-8")
    try:
        parts = [SAMPLING_BLOCK.pack(
            cfg.temperature, cfg.top_p, cfg.min_p, cfg.repetition_penalty, cfg.presence_penalty,
            cfg.frequency_penalty, 0 if cfg.seed is None else cfg.seed, cfg.top_k,
            cfg.penalty_last_n, int(flags), len(entries), 0 if grammar is None else int(grammar.kind),
            len(text), -1 if cfg.logprobs is None else cfg.logprobs)]
        parts += [LOGIT_BIAS_ENTRY.pack(token, bias) for token, bias in entries]
    except struct.error as error:
        raise FrameError(f"sampling block: a value does not fit its wire type ({error}); "
                         "seed is i64, top_k, penalty_last_n and token ids are i32") from error
    return b"".join([*parts, text])


def decode_sampling(buf: Buffer) -> SamplingConfig:
    _require(len(buf) >= SAMPLING_BLOCK.size, "sampling block", f">= {SAMPLING_BLOCK.size} bytes",
             len(buf))
    (temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed,
     top_k, penalty_last_n, flags, bias_count, grammar_kind, grammar_bytes,
     logprobs) = SAMPLING_BLOCK.unpack_from(buf, 0)
    _require(bias_count <= MAX_LOGIT_BIAS_COUNT, "sampling.logit_bias_count",
             f"<= {MAX_LOGIT_BIAS_COUNT}", bias_count)
    _require(grammar_bytes <= MAX_GRAMMAR_BYTES, "sampling.grammar_bytes", f"<= {MAX_GRAMMAR_BYTES}",
             grammar_bytes)
    grammar_at = SAMPLING_BLOCK.size + bias_count * LOGIT_BIAS_ENTRY.size
    expected = grammar_at + grammar_bytes
    _require(len(buf) == expected, "sampling_bytes",
             f"{expected} for {bias_count} logit-bias entries and {grammar_bytes} grammar bytes", len(buf))
    _require(flags & ~int(KNOWN_SAMPLING_FLAGS) == 0, "sampling.flags",
             f"only bits {int(KNOWN_SAMPLING_FLAGS):#x}", f"{flags:#x}")
    _require(-1 <= logprobs <= MAX_TOP_LOGPROBS, "sampling.logprobs", f"-1..{MAX_TOP_LOGPROBS}", logprobs)
    has_seed = bool(flags & SamplingFlags.HAS_SEED)
    _require(has_seed or seed == 0, "sampling.seed", "0 without HAS_SEED", seed)
    logit_bias: dict[int, float] = {}
    previous = None
    for index in range(bias_count):
        offset = SAMPLING_BLOCK.size + index * LOGIT_BIAS_ENTRY.size
        token, bias = LOGIT_BIAS_ENTRY.unpack_from(buf, offset)
        _require(previous is None or token > previous, f"sampling.logit_bias[{index}].token",
                 f"> {previous} (ascending, no duplicates)", token)
        logit_bias[token] = bias
        previous = token
    try:
        cfg = SamplingConfig(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, penalty_last_n=penalty_last_n,
            logit_bias=logit_bias, seed=seed if has_seed else None,
            grammar=_decode_grammar(grammar_kind, buf[grammar_at:expected]),
            logprobs=None if logprobs < 0 else logprobs,
            prompt_logprobs=bool(flags & SamplingFlags.PROMPT_LOGPROBS))
    except ValueError as error:  # UnicodeDecodeError included
        raise FrameError(f"sampling block: {error}") from error
    _check_sampling_values(cfg)
    return cfg


def _decode_grammar(kind: int, text: Buffer) -> GrammarSpec | None:
    if kind == 0:
        _require(len(text) == 0, "sampling.grammar_bytes", "0 without a grammar_kind", len(text))
        return None
    _require(kind in _GRAMMAR_KIND_CODES, "sampling.grammar_kind",
             f"0 or one of {sorted(int(k) for k in GrammarKind)}", kind)
    return GrammarSpec(GrammarKind(kind), bytes(text).decode("utf-8"))  # strict: a bad byte is an error


_GRAMMAR_KIND_CODES = frozenset(GrammarKind)


# -- Stage message encode / decode -------------------------------------------------------
def _pack(layout: struct.Struct, fields: tuple, values: tuple, what: str) -> bytes:
    try:
        return layout.pack(*values)
    except struct.error:
        for spec, value in zip(fields, values):
            try:
                struct.pack("<" + spec.fmt, value)
            except struct.error as error:
                raise FrameError(f"{what}.{spec.name}: expected a value of wire type "
                                 f"'{spec.fmt}', got {value!r}") from error
        raise


def encode_message(msg: StageMessage) -> bytes:
    """Header, then the body's sections."""
    sampling = encode_sampling(msg.sampling) if msg.sampling is not None else b""
    metadata = msg.chat_metadata if msg.chat_metadata is not None else b""
    namespace = msg.cache_namespace if msg.cache_namespace is not None else b""
    if msg.cache_namespace is not None and len(namespace) != NAMESPACE_BYTES:
        _fail("cache_namespace", f"{NAMESPACE_BYTES} bytes", len(namespace))
    trace = msg.trace_context if msg.trace_context is not None else b""
    if msg.trace_context is not None:
        _check_trace_context(trace)
    values = (MESSAGE_MAGIC, PROTOCOL_VERSION, msg.request_id, msg.session_id,
              msg.activation.nbytes, int(msg.kind), msg.pos_start, msg.token_count,
              len(msg.tokens), len(msg.positions), msg.seq_id, int(msg.phase), int(msg.flags),
              msg.checkpoint_generation, msg.prompt_token_count, msg.decode_step,
              msg.current_token, msg.source_stage_index, int(msg.activation_dtype),
              msg.activation_rows, msg.activation_width, len(sampling), len(metadata))
    header = _pack(MESSAGE_HEADER, MESSAGE_HEADER_FIELDS, values, "message")
    check_message_header(MessageHeader(*values))  # never emit what a peer would reject
    if msg.kind == MessageKind.DiscardStaleWindows:
        _check_discard_range(msg.tokens)
    if msg.activation_dtype == ActivationDtype.q8:
        msg.activation_array()  # checks its scales
    # Fixed-stride arrays first, so they stay 4-byte aligned for zero-copy views.
    return b"".join((header, memoryview(np.ascontiguousarray(msg.tokens)).cast("B"),
                     memoryview(np.ascontiguousarray(msg.positions)).cast("B"), msg.activation,
                     sampling, metadata, namespace, trace))


def _check_trace_context(trace: Buffer) -> None:
    """W3C trace context, binary: trace id (16), parent span id (8), trace flags (1). An
    all-zero id is invalid in W3C, so a frame never names one."""
    _require(len(trace) == TRACE_CONTEXT_BYTES, "trace_context", f"{TRACE_CONTEXT_BYTES} bytes", len(trace))
    _require(any(trace[:16]) and any(trace[16:24]), "trace_context",
             "a non-zero trace id and span id", bytes(trace).hex())


def _check_discard_range(tokens: np.ndarray) -> None:
    _require(int(tokens[0]) <= int(tokens[1]), "DiscardStaleWindows tokens",
             "[min_window_id, max_window_id] with min <= max", tokens.tolist())


def decode_message_body(header: MessageHeader, body: Buffer) -> StageMessage:
    """Decode the body that follows an already checked header; arrays are views of `body`."""
    view = _byte_view(body)
    if len(view) < header.body_bytes:
        _fail("message body", f"{header.body_bytes} bytes", f"{len(view)} (truncated)")
    offset = 0

    def take(nbytes: int) -> memoryview:
        nonlocal offset
        section = view[offset:offset + nbytes]
        offset += nbytes
        return section

    tokens = np.frombuffer(take(4 * header.token_sideband_count), dtype=_I32)
    positions = np.frombuffer(take(4 * header.position_sideband_count), dtype=_I32)
    activation = take(header.activation_bytes)
    sampling_view = take(header.sampling_bytes)
    sampling = decode_sampling(sampling_view) if header.flags & _SAMPLING else None
    metadata_view = take(header.metadata_bytes)
    metadata = bytes(metadata_view) if header.flags & _METADATA else None
    namespace = bytes(take(NAMESPACE_BYTES)) if header.flags & _NAMESPACE else None
    trace = bytes(take(TRACE_CONTEXT_BYTES)) if header.flags & _TRACE else None
    if trace is not None:
        _check_trace_context(trace)
    if header.kind == MessageKind.DiscardStaleWindows:
        _check_discard_range(tokens)
    if header.activation_dtype == ActivationDtype.q8:
        check_q8_scales(np.frombuffer(activation, dtype=ACTIVATION_NUMPY_DTYPE[ActivationDtype.q8]))
    if len(view) != offset:
        _fail("frame length", f"{offset} body bytes",
              f"{len(view)} ({len(view) - offset} trailing)")
    return StageMessage(
        kind=MessageKind(header.kind), pos_start=header.pos_start, token_count=header.token_count,
        request_id=header.request_id, session_id=header.session_id, seq_id=header.seq_id,
        checkpoint_generation=header.checkpoint_generation,
        prompt_token_count=header.prompt_token_count, decode_step=header.decode_step,
        current_token=header.current_token, source_stage_index=header.source_stage_index,
        sampling=sampling, chat_metadata=metadata, cache_namespace=namespace, trace_context=trace,
        tokens=tokens,
        positions=positions,
        activation_dtype=ActivationDtype(header.activation_dtype),
        activation_rows=header.activation_rows, activation_width=header.activation_width,
        activation=activation)


def decode_message(buf: Buffer) -> StageMessage:
    """Decode exactly one stage message from `buf` (header and body, nothing after)."""
    view = _byte_view(buf)
    header = parse_message_header(view)
    return decode_message_body(header, view[MESSAGE_HEADER.size:])


# -- Replies (spec §2.5) -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StageStatusReport:
    """A stage's answer to GetStageStatus, sent in a StageStatus reply's token array: these
    five i32 values, in this order, then each of `metrics`' i64 values and then each of
    `probe`'s as two i32 (low half first, as an unsigned 32-bit pattern)."""

    stage_index: int
    layer_start: int
    layer_end: int
    active_sessions: int  # sessions open on this stage, over all its connections
    lane_count: int
    metrics: StageMetricValues = field(default_factory=StageMetricValues)
    probe: StageProbe = field(default_factory=StageProbe)  # what it measured of itself and its link

    def __post_init__(self) -> None:
        values = self.values()
        if min(values) < 0 or self.layer_start >= self.layer_end:
            _fail("stage status", "non-negative values and layer_start < layer_end", values)

    def values(self) -> tuple[int, ...]:
        return (self.stage_index, self.layer_start, self.layer_end, self.active_sessions, self.lane_count)

    def wire_values(self) -> list[int]:
        flat = self.metrics.flat() + self.probe.flat()
        try:
            pairs = struct.unpack(f"<{2 * len(flat)}i", struct.pack(f"<{len(flat)}q", *flat))
        except struct.error as error:
            raise FrameError(f"stage metrics: expected i64 values ({error})") from error
        return [*self.values(), *pairs]

    @classmethod
    def from_wire(cls, values: list[int]) -> StageStatusReport:
        pairs = values[STATUS_VALUE_COUNT:]
        flat = list(struct.unpack(f"<{len(pairs) // 2}q", struct.pack(f"<{len(pairs)}i", *pairs)))
        return cls(*values[:STATUS_VALUE_COUNT], StageMetricValues.from_flat(flat[:METRIC_VALUE_COUNT]),
                   StageProbe.from_flat(flat[METRIC_VALUE_COUNT:]))


STATUS_VALUE_COUNT = 5
STATUS_WIRE_COUNT = STATUS_VALUE_COUNT + 2 * (METRIC_VALUE_COUNT + PROBE_VALUE_COUNT)


@dataclass(frozen=True, slots=True)
class StageReply:
    """A reply upstream: an Ack, one predicted token, a verify window's predictions, or a
    stage's status.

    `predicted_tokens[0] == predicted` for the prediction kinds. `draft_tokens` is the
    optional native MTP draft, kept apart from the target's predictions. `logprobs` is one
    entry per predicted token, `prompt_logprobs` one per prompt token after the first (on
    the first-token reply); every entry of a reply has the same number of top pairs.
    """

    kind: ReplyKind
    predicted: int = 0
    predicted_tokens: list[int] = field(default_factory=list)
    window_id: int = 0                  # echoes a VerifyWindow's seq_id
    stats: StageReplyStats = field(default_factory=StageReplyStats)
    draft_tokens: list[int] | None = None
    draft_compute_us: int = 0
    status: StageStatusReport | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ReplyKind(self.kind))
        tokens = [int(t) for t in self.predicted_tokens]
        if not tokens and self.kind == ReplyKind.PredictedToken:
            tokens = [self.predicted]
        object.__setattr__(self, "predicted_tokens", tokens)
        if self.draft_tokens is not None:
            object.__setattr__(self, "draft_tokens", [int(t) for t in self.draft_tokens])

    @classmethod
    def ack(cls, stats: StageReplyStats | None = None) -> StageReply:
        return cls(ReplyKind.Ack, stats=stats or NO_STATS)

    @classmethod
    def token(cls, predicted: int, stats: StageReplyStats | None = None,
              predicted_tokens: list[int] | None = None, logprobs: list[TokenLogprob] | None = None,
              prompt_logprobs: list[TokenLogprob] | None = None) -> StageReply:
        return cls(ReplyKind.PredictedToken, predicted, predicted_tokens or [predicted],
                   stats=stats or NO_STATS, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    @classmethod
    def window(cls, predicted_tokens: list[int], window_id: int,
               stats: StageReplyStats | None = None,
               logprobs: list[TokenLogprob] | None = None) -> StageReply:
        return cls(ReplyKind.PredictedTokens, predicted_tokens[0] if predicted_tokens else 0,
                   list(predicted_tokens), window_id, stats or NO_STATS, logprobs=logprobs)

    @classmethod
    def of_status(cls, status: StageStatusReport) -> StageReply:
        return cls(ReplyKind.StageStatus, status=status)


class ReplyHeader(namedtuple("ReplyHeader", [f.name for f in REPLY_HEADER_FIELDS])):
    __slots__ = ()

    @property
    def body_bytes(self) -> int:
        """Bytes after the fixed part (header + stats block)."""
        return 4 * (self.predicted_count + self.draft_count) + _LOGPROB_PAIR_BYTES * self.num_logprob_pairs

    @property
    def num_logprob_pairs(self) -> int:
        if self.logprob_top < 0:
            return 0
        return (self.prompt_logprob_count + self.predicted_count) * (1 + self.logprob_top)


_LOGPROB_PAIR_BYTES = LOGPROB_PAIR.size
_PAIR_DTYPE = np.dtype([("token", "<i4"), ("logprob", "<f4")])


def check_reply_header(h: ReplyHeader) -> None:
    if h.magic != REPLY_MAGIC:
        _fail("reply magic", f"{REPLY_MAGIC:#010x}", f"{h.magic:#010x}")
    if h.version != PROTOCOL_VERSION:
        raise VersionMismatch("reply", PROTOCOL_VERSION, h.version)
    if not 0 <= h.predicted_count <= MAX_PREDICTED_COUNT:
        _fail("predicted_count", f"0..{MAX_PREDICTED_COUNT}", h.predicted_count)
    if not 0 <= h.draft_count <= MAX_DRAFT_COUNT:
        _fail("draft_count", f"0..{MAX_DRAFT_COUNT}", h.draft_count)
    if h.kind not in _REPLY_KIND_CODES:
        _fail("reply kind", f"one of {[int(k) for k in ReplyKind]}", h.kind)
    if h.has_draft not in (0, 1):
        _fail("has_draft", "0 or 1", h.has_draft)
    if not h.has_draft and (h.draft_count or h.draft_compute_us):
        _fail("draft_count/draft_compute_us", "0 without a draft",
              (h.draft_count, h.draft_compute_us))
    if h.kind == ReplyKind.Ack:
        if h.predicted or h.predicted_count or h.has_draft:
            _fail("Ack reply", "no predictions and no draft",
                  (h.predicted, h.predicted_count, h.has_draft))
    elif h.kind == ReplyKind.StageStatus:
        if h.predicted or h.predicted_count != STATUS_WIRE_COUNT or h.has_draft or h.window_id:
            _fail("StageStatus reply", f"{STATUS_WIRE_COUNT} status and metric values, no prediction, "
                  "window or draft", (h.predicted, h.predicted_count, h.window_id, h.has_draft))
    elif h.predicted_count < 1:
        _fail("predicted_count", f">= 1 for {ReplyKind(h.kind).name}", h.predicted_count)
    if not -1 <= h.logprob_top <= MAX_TOP_LOGPROBS:
        _fail("logprob_top", f"-1..{MAX_TOP_LOGPROBS}", h.logprob_top)
    if not 0 <= h.prompt_logprob_count <= MAX_PROMPT_LOGPROB_COUNT:
        _fail("prompt_logprob_count", f"0..{MAX_PROMPT_LOGPROB_COUNT}", h.prompt_logprob_count)
    if h.logprob_top >= 0 and h.kind not in _PREDICTION_KINDS:
        _fail("logprob_top", f"-1 for {ReplyKind(h.kind).name}", h.logprob_top)
    if h.logprob_top < 0 and h.prompt_logprob_count:
        _fail("prompt_logprob_count", "0 without a logprob block", h.prompt_logprob_count)
    if h.prompt_logprob_count and h.kind != ReplyKind.PredictedToken:
        _fail("prompt_logprob_count", "0 except on PredictedToken", h.prompt_logprob_count)


_PREDICTION_KINDS = frozenset({ReplyKind.PredictedToken, ReplyKind.PredictedTokens})


def _check_first_prediction(predicted: int, tokens: list[int] | np.ndarray) -> None:
    if len(tokens) and int(tokens[0]) != predicted:
        _fail("predicted_tokens[0]", f"== predicted ({predicted})", int(tokens[0]))


def parse_reply_header(buf: Buffer) -> ReplyHeader:
    if len(buf) < REPLY_HEADER.size:
        _fail("reply header", f"{REPLY_HEADER.size} bytes", f"{len(buf)} (truncated)")
    header = ReplyHeader(*REPLY_HEADER.unpack_from(buf, 0))
    check_reply_header(header)
    return header


def encode_reply(reply: StageReply) -> bytes:
    draft = reply.draft_tokens
    if (reply.kind == ReplyKind.StageStatus) != (reply.status is not None):
        _fail("reply status", "set on StageStatus replies only", reply.kind.name)
    tokens = reply.predicted_tokens if reply.status is None else reply.status.wire_values()
    logprob_block, top, num_prompt = _encode_logprobs(reply)
    values = (REPLY_MAGIC, PROTOCOL_VERSION, int(reply.kind), reply.predicted, reply.window_id,
              len(tokens), int(draft is not None), len(draft or ()), reply.draft_compute_us, top, num_prompt)
    header = _pack(REPLY_HEADER, REPLY_HEADER_FIELDS, values, "reply")
    check_reply_header(ReplyHeader(*values))
    _check_first_prediction(reply.predicted, reply.predicted_tokens)
    try:
        arrays = struct.pack(f"<{len(tokens) + len(draft or ())}i", *tokens, *(draft or ()))
    except struct.error as error:
        raise FrameError(f"reply tokens: expected i32 token ids ({error})") from error
    return header + encode_stats(reply.stats) + arrays + logprob_block


def _encode_logprobs(reply: StageReply) -> tuple[bytes, int, int]:
    """(the logprob block, logprob_top, prompt_logprob_count); (b"", -1, 0) without one."""
    if reply.logprobs is None:
        if reply.prompt_logprobs:
            _fail("reply logprobs", "set with prompt_logprobs", None)
        return b"", -1, 0
    if len(reply.logprobs) != len(reply.predicted_tokens):
        _fail("reply logprobs", f"one per predicted token ({len(reply.predicted_tokens)})",
              len(reply.logprobs))
    entries = [*(reply.prompt_logprobs or ()), *reply.logprobs]
    top = len(entries[0].top) if entries else 0
    for index, entry in enumerate(entries):
        if len(entry.top) != top:
            _fail(f"reply logprobs[{index}].top", f"{top} pairs (as every entry)", len(entry.top))
    for entry, token in zip(reply.logprobs, reply.predicted_tokens):
        if entry.token != token:
            _fail("reply logprobs token", f"the predicted token {token}", entry.token)
    pairs = np.empty((len(entries), 1 + top), dtype=_PAIR_DTYPE)
    for row, entry in enumerate(entries):
        pairs[row, 0] = (entry.token, entry.logprob)
        for column, pair in enumerate(entry.top, 1):
            pairs[row, column] = pair
    return pairs.tobytes(), top, len(reply.prompt_logprobs or ())


def _decode_logprobs(header: ReplyHeader, view: memoryview, offset: int, predicted: list[int]):
    """(logprobs, prompt_logprobs) from the block at `offset`; (None, None) without one."""
    if header.logprob_top < 0:
        return None, None
    top = header.logprob_top
    pairs = np.frombuffer(view, dtype=_PAIR_DTYPE, offset=offset).reshape(-1, 1 + top)
    tokens, logprobs = pairs["token"].tolist(), pairs["logprob"].tolist()
    entries = [TokenLogprob(row_tokens[0], row_logprobs[0], tuple(zip(row_tokens[1:], row_logprobs[1:])))
               for row_tokens, row_logprobs in zip(tokens, logprobs)]
    num_prompt = header.prompt_logprob_count
    for entry, token in zip(entries[num_prompt:], predicted):
        if entry.token != token:
            _fail("reply logprobs token", f"the predicted token {token}", entry.token)
    return entries[num_prompt:], (entries[:num_prompt] or None) if num_prompt else None


def decode_reply_body(header: ReplyHeader, body: Buffer) -> StageReply:
    """Decode what follows the reply header: the stats block and the token arrays."""
    view = _byte_view(body)
    expected = STATS_BLOCK.size + header.body_bytes
    if len(view) != expected:
        _fail("reply length", f"{expected} bytes after the header", len(view))
    stats = decode_stats(view[:STATS_BLOCK.size])
    num_ids = header.predicted_count + header.draft_count
    tokens = np.frombuffer(view, dtype=_I32, offset=STATS_BLOCK.size, count=num_ids)
    predicted = tokens[:header.predicted_count].tolist()
    if header.kind == ReplyKind.StageStatus:
        try:
            status = StageStatusReport.from_wire(predicted)
        except ValueError as error:
            raise FrameError(f"StageStatus reply: {error}") from error
        return StageReply(ReplyKind.StageStatus, stats=stats, status=status)
    _check_first_prediction(header.predicted, predicted)
    logprobs, prompt_logprobs = _decode_logprobs(header, view, STATS_BLOCK.size + 4 * num_ids, predicted)
    return StageReply(
        kind=ReplyKind(header.kind), predicted=header.predicted, predicted_tokens=predicted,
        window_id=header.window_id, stats=stats,
        draft_tokens=tokens[header.predicted_count:].tolist() if header.has_draft else None,
        draft_compute_us=header.draft_compute_us, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def decode_reply(buf: Buffer) -> StageReply:
    view = _byte_view(buf)
    header = parse_reply_header(view)
    return decode_reply_body(header, view[REPLY_HEADER.size:])
