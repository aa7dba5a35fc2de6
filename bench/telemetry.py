"""What tracing and per-stage metrics cost: decode tok/s with them on against off, side by side.

Two `skippy serve --stages N` subprocesses run at once, idle but for the request in flight:
"off" without an exporter, "on" with `--otlp-endpoint` at a collector in this process (an
http.server that accepts OTLP/HTTP and drops it: a real collector's work is not skippy's)
and a /metrics scrape every --scrape-interval seconds, which asks every stage for its
status and metrics over the protocol. Each round runs --requests streamed requests on one
server, then on the other, the order alternating round by round; the table shows medians
over the rounds after one warm-up round. The stage-side metric recording (a lock and a
bisect per forward) runs in both: it has no off switch.

    decode tok/s   per stream: (tokens - 1) / (last token - first token)
    TTFT           request sent -> first content chunk

    python bench/telemetry.py                      # 3 stages, 64 tokens, 5 rounds
    python bench/telemetry.py --stages 2 --rounds 9 --max-tokens 96
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import statistics
import threading
import time
from pathlib import Path

import httpx
from common import resolve_model, start_serve
from serve import NO_EOS, PROMPT, http_stream
from sse_client import SSEClient

MODEL = "SmolLM2-135M-Instruct.Q4_1"


class DropCollector:
    """OTLP/HTTP sink on a free loopback port: counts the export requests, keeps nothing."""

    def __init__(self) -> None:
        self.exports = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.exports += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def scrape(client: httpx.AsyncClient, url: str, interval_s: float, stop: asyncio.Event) -> int:
    scrapes = 0
    while not stop.is_set():
        (await client.get(url + "/metrics")).raise_for_status()
        scrapes += 1
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
    return scrapes


async def run_round(client, url: str, body: dict, requests: int, scrape_s: float | None):
    stop = asyncio.Event()
    scraper = asyncio.create_task(scrape(client, url, scrape_s, stop)) if scrape_s else None
    streams = SSEClient()
    samples = [await http_stream(streams, url + "/v1/chat/completions", body) for _ in range(requests)]
    stop.set()
    if scraper is not None:
        await scraper
    return samples


async def main_async(args: argparse.Namespace) -> None:
    collector = DropCollector()
    common = ["--stages", str(args.stages), "--threads", str(args.threads), "--concurrency", "1",
              "--kv-cache-mem", "0", *(["--model", args.model] if args.model else [])]
    servers = {"off": start_serve(common), "on": start_serve([*common, "--otlp-endpoint", collector.endpoint])}
    model = Path(args.model).stem if args.model else MODEL
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens,
            "temperature": 0, "logit_bias": NO_EOS, "stream": True, "stream_options": {"include_usage": True}}
    rates: dict[str, list[float]] = {"off": [], "on": []}
    ttfts: dict[str, list[float]] = {"off": [], "on": []}
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            for round_index in range(args.rounds + 1):
                order = ["off", "on"] if round_index % 2 == 0 else ["on", "off"]
                for name in order:
                    url = servers[name][1]
                    samples = await run_round(client, url, body, args.requests,
                                              args.scrape_interval if name == "on" else None)
                    if round_index:  # round 0 warms up
                        rates[name].append(statistics.median(s.decode_tok_s for s in samples))
                        ttfts[name].append(statistics.median(s.ttft_s for s in samples))
                print(f"round {round_index}{' (warm-up)' if not round_index else ''}: "
                      + "  ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in ("off", "on") if rates[n]), flush=True)
    finally:
        for process, _, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
        collector.close()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"\n{args.stages} stages, {args.max_tokens} tokens, {args.requests} requests a round, "
          f"{args.rounds} rounds (medians); exports received: {collector.exports}")
    print(f"{'':>22} {'off':>9} {'on':>9} {'on/off':>8}")
    print(f"{'decode tok/s':>22} {off:9.1f} {on:9.1f} {on / off:8.3f}")
    t_off, t_on = statistics.median(ttfts["off"]) * 1e3, statistics.median(ttfts["on"]) * 1e3
    print(f"{'TTFT ms':>22} {t_off:9.1f} {t_on:9.1f} {t_on / t_off:8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads a stage")
    parser.add_argument("--model", type=resolve_model, default=None,
                        help="GGUF file, or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2, help="streamed requests per server per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between /metrics scrapes (on)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
