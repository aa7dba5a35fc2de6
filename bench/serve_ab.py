"""A/B of two `skippy serve` processes that differ only in environment variables, rounds interleaved.

Both servers run at once (same arguments); each round streams the same greedy chat
request to A, then to B, at the given concurrency, so a noisy neighbour hurts both
alike. Prints each side's median (decode tok/s per stream at c=1, aggregate tok/s
above) and B/A per round pair. This is how docs/decisions.md's spin figures were
measured, e.g.:

    python bench/serve_ab.py --b GOMP_SPINCOUNT=1000                  # 2 stages, c=1
    python bench/serve_ab.py --b GOMP_SPINCOUNT=1000 --concurrency 8
    python bench/serve_ab.py --stages 1 --b GOMP_SPINCOUNT=10000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx
from common import resolve_model, start_serve
from serve import NO_EOS, PROMPT
from sse_client import SSEClient


def environment(pairs: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    for pair in pairs:
        key, _, value = pair.partition("=")
        env[key] = value
    return env


async def stream(client: SSEClient, url: str, body: dict) -> list[float]:
    """The arrival time of every content chunk of one streamed request."""
    return [time.perf_counter() async for data in client.events(url, body)
            if data.startswith(b"{") and b'"content":"' in data]


async def rate(client: SSEClient, url: str, body: dict, concurrency: int) -> float:
    started = time.perf_counter()
    streams = await asyncio.gather(*(stream(client, url, body) for _ in range(concurrency)))
    if concurrency == 1:
        times = streams[0]
        return (len(times) - 1) / (times[-1] - times[0])
    return sum(len(t) for t in streams) / (max(t[-1] for t in streams) - started)


async def run(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, list[float]]:
    model = httpx.get(urls["A"] + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": args.max_tokens, "logit_bias": {str(k): v for k, v in NO_EOS.items()}, "stream": True}
    rates: dict[str, list[float]] = {"A": [], "B": []}
    client = SSEClient()
    for round_index in range(args.rounds + 1):  # round 0 warms both up
        for side, url in urls.items():
            value = await rate(client, url + "/v1/chat/completions", body, args.concurrency)
            if round_index:
                rates[side].append(value)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--model", type=resolve_model, default=None,
                        help="GGUF file, or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--a", action="append", default=[], metavar="KEY=VALUE", help="environment of server A")
    parser.add_argument("--b", action="append", default=[], metavar="KEY=VALUE", help="environment of server B")
    args = parser.parse_args()
    command = ["--stages", str(args.stages), "--ctx-size", "2048", "--concurrency", str(max(8, args.concurrency)),
               "--kv-cache-mem", "0"] + (["--model", args.model] if args.model else [])  # fmt: skip
    servers = {}
    try:
        for side, pairs in (("A", args.a), ("B", args.b)):
            servers[side] = start_serve(command, environment(pairs))
        rates = asyncio.run(run(args, {side: url for side, (_, url, _) in servers.items()}))
    finally:
        for process, _, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    a, b = statistics.median(rates["A"]), statistics.median(rates["B"])
    what = "decode tok/s per stream" if args.concurrency == 1 else "aggregate tok/s"
    print(f"{args.stages} stage(s), c={args.concurrency}, {what}, medians of {args.rounds} interleaved rounds")
    print(f"A {' '.join(args.a) or '(as is)'}: {a:.1f}")
    print(f"B {' '.join(args.b) or '(as is)'}: {b:.1f}")
    print(f"B/A {b / a:.3f}; per round {[round(y / x, 2) for x, y in zip(rates['A'], rates['B'])]}")


if __name__ == "__main__":
    main()
