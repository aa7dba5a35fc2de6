"""The stage wire protocol: constants, frames, stats, handshake, stream I/O and configs.

No torch here; asyncio only in `stream`. See docs/protocol.md.
"""

from .configs import (
    KvCacheConfig, LinkConditioning, PeerEndpoint, StageConfig, Timeouts, TlsConfig, Topology, TopologyStage,
    is_loopback, parse_endpoint, plan_layer_split,
)
from .constants import (
    KIND_INFO, PROTOCOL_VERSION, ActivationDtype, MessageKind, Phase, ReplyKind, StateFlags,
)
from .errors import AuthError, FrameError, HandshakeTimeout, ProtocolError, VersionMismatch
from .frames import (
    StageMessage, StageReply, StageStatusReport, activation_fields, cache_namespace_digest, decode_message,
    decode_reply, encode_message, encode_reply,
)
from .handshake import AuthPreamble, Ready
from .sampling_config import SamplingConfig
from .stats import (
    LOOKUP_ERROR, NO_STATS, StageReplyStats, lookup_observation, merge, merge_all, prefill_compute_observation,
    prefill_edge_observation, record_observation, restore_missed_below,
    stage_mask,
)
from .stream import (
    client_handshake, read_message, read_reply, read_tensor_frame,
    write_message, write_reply, write_tensor_frame,
)
from .tensor_frames import TensorRefused

__all__ = [
    "ActivationDtype", "AuthError", "AuthPreamble", "FrameError", "HandshakeTimeout", "KIND_INFO", "KvCacheConfig", "LinkConditioning",
    "MessageKind", "NO_STATS", "PROTOCOL_VERSION", "PeerEndpoint", "Phase", "ProtocolError", "Ready",
    "ReplyKind", "SamplingConfig", "StageConfig", "StageMessage", "StageReply", "StageReplyStats",
    "StageStatusReport", "StateFlags", "activation_fields", "Timeouts", "TlsConfig", "Topology", "TopologyStage", "VersionMismatch",
    "cache_namespace_digest", "client_handshake",
    "decode_message", "decode_reply", "encode_message", "encode_reply",
    "is_loopback", "merge", "merge_all", "parse_endpoint", "plan_layer_split",
    "prefill_compute_observation", "prefill_edge_observation", "read_message", "read_reply", "read_tensor_frame",
    "stage_mask", "TensorRefused", "write_message", "write_reply",
    "write_tensor_frame",
]
