"""A stage from its spec: `build_stage(spec)` builds one in this process, with no process-wide state.

`skippy stage` builds one from a config file (stage/process.py); a cluster engine that places
stages itself hands each its `StageSpec`. Everything comes from the spec, decided whole
before anything starts; nothing patches what it built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.grammar import GrammarCompiler
from ..model.loader import load_stage
from ..protocol import StageConfig, Topology
from ..runtime.batch_policy import BatchSettings
from ..runtime.stage_cache import StagePrefixCache
from ..runtime.stage_runtime import StageRuntime
from ..telemetry import Telemetry
from .server import StageServer

WEIGHT_DTYPES = {"auto": "auto", "f32": "float32", "f16": "float16", "bf16": "bfloat16", "int4": "int4", "int8": "int8"}


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One stage, decided whole: its config and the chain's topology (None: predictions are
    relayed up the lanes, and it serves no tensors)."""
    config: StageConfig
    topology: Topology | None = None


def build_stage(spec: StageSpec) -> StageServer:
    """Load the stage's layers and build its server (not started: `await server.start()`)."""
    config = spec.config
    if config.threads:
        torch.set_num_threads(config.threads)
    telemetry = Telemetry(f"skippy-stage{config.stage_index}", config.otlp_endpoint, otlp_protocol=config.otlp_protocol)
    model = load_stage(config.model_path, (config.layer_start, config.layer_end),
                       dtype=WEIGHT_DTYPES[config.weight_dtype], device=config.device,
                       progress=False, repack=config.repack_weights, prefill_precision=config.prefill_precision)
    ctx_size = min(config.ctx_size, model.args.context_length)
    prefix_cache = StagePrefixCache.build(config.kv_cache, model_path=config.model_path, layer_start=config.layer_start,
                                          layer_end=config.layer_end, kv_dtype=model.kv_dtype, ctx_size=ctx_size,
                                          weights=model.weight_format)
    # the final stage samples, so it compiles each request's grammar (lazily: the first one)
    grammars = GrammarCompiler.for_model(config.model_path) if model.layers.is_last else None
    batch = BatchSettings(peer_wait_forwards=config.peer_wait_forwards, waves=config.decode_waves)
    runtime = StageRuntime(model, lane_count=config.lane_count, ctx_size=ctx_size, telemetry=telemetry, batch=batch,
                           prefix_cache=prefix_cache, grammars=grammars)
    return StageServer(config, runtime, topology=spec.topology, telemetry=telemetry)
