"""Decode tokens/s with and without a JSON Schema (constrained decoding), side by side.

A `skippy serve` subprocess answers greedy chat requests. Each round runs both arms at
every concurrency, in alternating order: the schema arm (response_format json_schema with
a schema whose answers run ~80 tokens), then the plain arm with max_tokens set to the
schema arm's median answer length and the end tokens banned, so both decode as many
tokens. The figure is the server's own `timings.predicted_per_second` (first token to
last, per stream); the table shows medians over the rounds, after one warm-up round (the
first grammar builds the engine's vocabulary index, ~0.3 s, once per process).

    python bench/structured.py                      # bundled SmolLM2, 2 stages, concurrency 1 and 4
    python bench/structured.py --stages 1 --rounds 7 --speculative ngram-suffix
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

import httpx
from common import resolve_model, start_serve

PROMPT = "List six people with their name and age as JSON."
NO_EOS = {"0": -100.0, "2": -100.0}  # SmolLM2's end tokens: the plain arm runs to max_tokens
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 6,
                                                      "maxItems": 6}},
          "required": ["people"], "additionalProperties": False}


async def request(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, float]:
    """(completion tokens, decode tok/s) of one request."""
    response = await client.post(url + "/v1/chat/completions", json=body)
    response.raise_for_status()
    data = response.json()
    return data["usage"]["completion_tokens"], data["timings"]["predicted_per_second"]


async def arm(client, url: str, body: dict, concurrency: int) -> list[tuple[int, float]]:
    return await asyncio.gather(*(request(client, url, body) for _ in range(concurrency)))


async def run(args: argparse.Namespace, url: str, model: str) -> None:
    base = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "speculative": args.speculative or False}
    schema_body = {**base, "max_tokens": 256,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}}
    rates: dict[tuple[int, str], list[float]] = {}
    lengths: dict[int, list[int]] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        for round_index in range(args.rounds + 1):  # round 0 warms up and is not counted
            for concurrency in args.concurrency:
                schema_first = round_index % 2 == 0
                results = {}
                for name in ("schema", "plain") if schema_first else ("plain", "schema"):
                    if name == "schema":
                        results[name] = await arm(client, url, schema_body, concurrency)
                    else:  # as many tokens as the schema arm's answers (the last round's, or a guess)
                        num_tokens = int(statistics.median(lengths.get(concurrency, [80])))
                        body = {**base, "max_tokens": num_tokens, "logit_bias": NO_EOS}
                        results[name] = await arm(client, url, body, concurrency)
                lengths.setdefault(concurrency, []).extend(n for n, _ in results["schema"])
                if round_index:
                    for name, samples in results.items():
                        rates.setdefault((concurrency, name), []).extend(rate for _, rate in samples)
    print(f"\n{'streams':>8} {'tokens':>7} {'plain tok/s':>12} {'schema tok/s':>13} {'schema/plain':>13}")
    for concurrency in args.concurrency:
        plain = statistics.median(rates[concurrency, "plain"])
        schema = statistics.median(rates[concurrency, "schema"])
        tokens = int(statistics.median(lengths[concurrency]))
        print(f"{concurrency:>8} {tokens:>7} {plain:>12.1f} {schema:>13.1f} {schema / plain:>13.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=resolve_model, default=None,
                        help="GGUF or HF directory or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2)")
    parser.add_argument("--stages", type=int, default=2, help="stages behind the API (1 = one process)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 4])
    parser.add_argument("--speculative", default=None, help="a speculative mode for both arms (ngram-suffix...)")
    args = parser.parse_args()
    command = ["--stages", str(args.stages), "--ctx-size", "2048", "--concurrency", str(max(args.concurrency)),
               "--kv-cache-mem", "0"]
    server, url, ready_line = start_serve(command + (["--model", args.model] if args.model else []))
    try:
        print(ready_line, flush=True)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        print(f"schema: {json.dumps(SCHEMA)}")
        asyncio.run(run(args, url, model))
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
