"""In-process chains for tests: stage servers on loopback sharing one set of weights."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field

import torch

from skippy.driver.client import ChainClient
from skippy.model.llama import Segment
from skippy.protocol import PeerEndpoint, StageConfig, plan_layer_split
from skippy.runtime.stage_runtime import StageRuntime
from skippy.stage.server import StageServer

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
     407, 19712, 8182, 2, 198, 1, 4093, 198, 17530, 2, 198, 1, 520, 9531, 198],
    list(range(300, 340)),
    [504, 3458, 282, 4649, 314],
    [28, 1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 11000],
    [4093, 17530],
]


@dataclass
class Chain:
    client: ChainClient
    servers: list[StageServer] = field(default_factory=list)

    async def close(self) -> None:
        await self.client.close()
        for server in self.servers:
            await server.close()


def stage_config(index: int, layers: tuple[int, int], model_path: str, *, downstream=None,
                 **options) -> StageConfig:
    return StageConfig(stage_id=f"s{index}", stage_index=index, layer_start=layers[0],
                       layer_end=layers[1], model_path=model_path, downstream=downstream,
                       **options)


async def start_chain(make_stage, num_stages: int, *, model_path: str = "bundled.gguf",
                      splits: list[tuple[int, int]] | None = None, lane_count: int = 4,
                      stage_options: dict | None = None, record_logits: bool = False,
                      server_telemetry=None, **client_options) -> Chain:
    """Stages 1..N-1 as in-process servers (started last to first), stage 0 as the client."""
    num_layers = make_stage().args.num_layers
    splits = splits or plan_layer_split(num_layers, num_stages)
    servers: list[StageServer] = []
    downstream = None
    for index in range(num_stages - 1, 0, -1):
        config = stage_config(index, splits[index], model_path, downstream=downstream,
                              lane_count=lane_count, **(stage_options or {}))
        runtime = StageRuntime(make_stage(*splits[index]), lane_count=lane_count,
                               record_logits=record_logits and index == num_stages - 1,
                               telemetry=server_telemetry(index) if server_telemetry else None)
        server = StageServer(config, runtime)
        await server.start()
        servers.insert(0, server)
        downstream = PeerEndpoint(stage_id=f"s{index}", stage_index=index,
                                  endpoint=server.endpoint)
    auth = (stage_options or {}).get("auth_token")
    client = ChainClient(make_stage(*splits[0]), downstream=servers[0].endpoint if servers else None,
                         auth_token=auth, record_logits=record_logits and num_stages == 1,
                         concurrency=client_options.pop("concurrency", 1), **client_options)
    await client.start()
    if servers:
        servers[-1].returns.driver_endpoint = client.return_endpoint
    return Chain(client, servers)


def reference_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """One process, whole model: greedy tokens and the logits that chose the last one."""
    cache = model.new_cache(2048)
    hidden = model.forward(torch.tensor(prompt), [Segment(cache, 0, len(prompt))])
    logits = model.compute_logits(hidden[-1:])[0]
    tokens = [int(logits.argmax())]
    while len(tokens) < num_tokens:
        hidden = model.forward(torch.tensor(tokens[-1:]), [Segment(cache, cache.length, 1)])
        logits = model.compute_logits(hidden[-1:])[0]
        tokens.append(int(logits.argmax()))
    return tokens, logits


def run(coro, timeout: float = 300):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def blocking_connect(server: StageServer, timeout_s: float = 10.0) -> socket.socket:
    """A plain socket to `server`, past its handshake (READY read; no auth token)."""
    host, port = server.endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    assert len(sock.recv(8, socket.MSG_WAITALL)) == 8  # READY
    return sock


def read_until_eof(sock: socket.socket) -> bytes:
    """Everything the stage sends until it closes (a reset counts as the end)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data
