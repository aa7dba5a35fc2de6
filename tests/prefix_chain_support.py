"""Prefix-cache chains for tests: in-process stage servers with a cache on each stage, kept
alive across the tests of a module on one background event loop (prefills are the cost)."""

from __future__ import annotations

import asyncio
import threading

from chain_support import Chain, stage_config
from skippy.driver.client import ChainClient
from skippy.protocol import KvCacheConfig, PeerEndpoint, plan_layer_split
from skippy.runtime.stage_runtime import StageRuntime
from skippy.runtime.stage_cache import StagePrefixCache
from skippy.stage.server import StageServer

WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo",
         "juniper", "kestrel", "lagoon", "meadow", "nickel", "orchid", "pewter", "quartz", "raven")


def system_text(num_sentences: int) -> str:
    """A long, varied system prompt in plain English (greedy output on it is well defined)."""
    sentences = []
    for i in range(num_sentences):
        a, b, c = (WORDS[(i * k + 3) % len(WORDS)] for k in (1, 5, 7))
        sentences.append(f"Rule {i + 1}: when the {a} report mentions {b}, answer with the {c} "
                         f"checklist and cite section {i % 9 + 1}.")
    return "You are a careful assistant for the harbor office. " + " ".join(sentences)


class LoopThread:
    """One event loop in a thread: servers started on it outlive a single test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="prefix-tests",
                                       daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 900.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


def stage_prefix_cache(kv: KvCacheConfig | None, model_path, layers, model, ctx_size: int):
    if kv is None:
        return None
    return StagePrefixCache.build(kv, model_path=str(model_path), layer_start=layers[0],
                                  layer_end=layers[1], kv_dtype=model.kv_dtype, ctx_size=ctx_size)


async def start_cached_chain(make_stage, model_path, num_stages: int, kv, *, lane_count: int = 4,
                             ctx_size: int = 2048, **client_options) -> Chain:
    """Like chain_support.start_chain, with a prefix cache per stage: `kv` is one
    KvCacheConfig for every stage, or a list with one per stage (None: no cache there)."""
    kvs = kv if isinstance(kv, list) else [kv] * num_stages
    splits = plan_layer_split(make_stage().args.num_layers, num_stages)
    servers: list[StageServer] = []
    downstream = None
    for index in range(num_stages - 1, 0, -1):
        config = stage_config(index, splits[index], str(model_path), downstream=downstream,
                              lane_count=lane_count, ctx_size=ctx_size)
        model = make_stage(*splits[index])
        runtime = StageRuntime(model, lane_count=lane_count, ctx_size=ctx_size,
                               prefix_cache=stage_prefix_cache(kvs[index], model_path, splits[index], model,
                                                               min(ctx_size, model.args.context_length)))
        server = StageServer(config, runtime)
        await server.start()
        servers.insert(0, server)
        downstream = PeerEndpoint(stage_id=f"s{index}", stage_index=index, endpoint=server.endpoint)
    model = make_stage(*splits[0])
    client = ChainClient(model, downstream=servers[0].endpoint if servers else None,
                         ctx_size=ctx_size, concurrency=client_options.pop("concurrency", 1),
                         prefix_cache=stage_prefix_cache(kvs[0], model_path, splits[0], model,
                                                         min(ctx_size, model.args.context_length)),
                         **client_options)
    await client.start()
    if servers:
        servers[-1].returns.driver_endpoint = client.return_endpoint
    return Chain(client, servers)


def runtimes(chain: Chain) -> list[StageRuntime]:
    return [chain.client.runtime, *(server.runtime for server in chain.servers)]


def caches(chain: Chain) -> list[StagePrefixCache | None]:
    return [runtime.prefix_cache for runtime in runtimes(chain)]


def session_counts(chain: Chain) -> list[int]:
    return [len(runtime.sessions) for runtime in runtimes(chain)]


async def clear_stage(chain: Chain, index: int) -> int:
    """Evict every entry of one stage's memory cache, on that stage's engine."""
    runtime = runtimes(chain)[index]
    engine = chain.client.engine if index == 0 else chain.servers[index - 1].engine
    return await engine.call(runtime.prefix_cache.cache.clear)
