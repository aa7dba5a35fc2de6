"""A/B of two `skippy serve` processes that differ only in environment variables, rounds interleaved.

Both servers run at once (same arguments); each round streams the same greedy chat
request to A, then to B, at the given concurrency, so a noisy neighbour hurts both
alike. Prints each side's median (decode tok/s per stream at c=1, aggregate tok/s
above) and B/A per round pair. This is how docs/decisions.md's spin figures were
measured, e.g.:

    python bench/serve_ab.py --b GOMP_SPINCOUNT=1000                  # 2 stages, c=1
    python bench/serve_ab.py --b GOMP_SPINCOUNT=1000 --concurrency 8
    python bench/serve_ab.py --stages 1 --b GOMP_SPINCOUNT=10000

Two code trees: `--a PYTHONPATH=/tmp/base --b PYTHONPATH=$PWD`. Two serve settings:
`--b-args "--speculative ngram-suffix"`. Speculation through the API (the issue-44 figures):

    python bench/serve_ab.py --b-args "--speculative ngram-suffix" --prompt copy-text --max-tokens 160 --keep-eos
    python bench/serve_ab.py --b-args "--speculative ngram-suffix" --prompt free-form --max-tokens 160 --keep-eos
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import shlex

import httpx
from common import resolve_model, speculative_prompts, start_serve
from serve import NO_EOS, PROMPT
from sse_client import SSEClient


def environment(pairs: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    for pair in pairs:
        key, _, value = pair.partition("=")
        env[key] = value
    return env


async def stream(client: SSEClient, url: str, body: dict) -> list[float]:
    """The arrival time of every content chunk of one streamed request, one per token: a chunk
    that carries several (a verify window's, say) counts as that many, read from the usage."""
    times, tokens = [], None
    async for data in client.events(url, body):
        if data.startswith(b"{") and b'"content":"' in data:
            times.append(time.perf_counter())
        elif data.startswith(b"{") and b'"usage":{' in data:
            tokens = json.loads(data)["usage"]["completion_tokens"]
    if tokens is not None and tokens > len(times) and times:  # spread the extra tokens over the span
        times = [times[0] + (times[-1] - times[0]) * i / (tokens - 1) for i in range(tokens)]
    return times


async def rate(client: SSEClient, url: str, body: dict, concurrency: int) -> float:
    started = time.perf_counter()
    streams = await asyncio.gather(*(stream(client, url, body) for _ in range(concurrency)))
    if concurrency == 1:
        times = streams[0]
        return (len(times) - 1) / (times[-1] - times[0])
    return sum(len(t) for t in streams) / (max(t[-1] for t in streams) - started)


async def run(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, list[float]]:
    model = httpx.get(urls["A"] + "/v1/models").json()["data"][0]["id"]
    prompt = PROMPT if args.prompt == "story" else speculative_prompts(3)[args.prompt]
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": args.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if not args.keep_eos:  # run to max_tokens
        body["logit_bias"] = {str(k): v for k, v in NO_EOS.items()}
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
    parser.add_argument("--a-args", default="", help="more `skippy serve` arguments for server A")
    parser.add_argument("--b-args", default="", help="more `skippy serve` arguments for server B")
    parser.add_argument("--prompt", default="story", choices=["story", "copy-text", "copy-code", "free-form"],
                        help="story: bench/serve.py's; the others: bench/common.py's speculative prompts")
    parser.add_argument("--keep-eos", action="store_true", help="do not ban the end tokens (a reply may end early)")
    args = parser.parse_args()
    command = ["--stages", str(args.stages), "--ctx-size", "2048", "--concurrency", str(max(8, args.concurrency)),
               "--kv-cache-mem", "0"] + (["--model", args.model] if args.model else [])  # fmt: skip
    servers = {}
    try:
        for side, pairs, extra in (("A", args.a, args.a_args), ("B", args.b, args.b_args)):
            servers[side] = start_serve(command + shlex.split(extra), environment(pairs))
        rates = asyncio.run(run(args, {side: url for side, (_, url, _) in servers.items()}))
    finally:
        for process, _, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    a, b = statistics.median(rates["A"]), statistics.median(rates["B"])
    what = "decode tok/s per stream" if args.concurrency == 1 else "aggregate tok/s"
    print(f"{args.stages} stage(s), c={args.concurrency}, {what}, medians of {args.rounds} interleaved rounds")
    print(f"A {' '.join(args.a + [args.a_args]).strip() or '(as is)'}: {a:.1f}")
    print(f"B {' '.join(args.b + [args.b_args]).strip() or '(as is)'}: {b:.1f}")
    print(f"B/A {b / a:.3f}; per round {[round(y / x, 2) for x, y in zip(rates['A'], rates['B'])]}")


if __name__ == "__main__":
    main()
