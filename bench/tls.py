"""What TLS costs a chain: the same 2-stage chain off loopback, over mutual TLS and over plain TCP.

Both chains run on this machine's own non-loopback address (so the TLS rule applies),
planned by `skippy plan`; the plain one is the same plan with its TLS files removed and
`--insecure` on every process. Streamed greedy chat through `skippy serve --topology`,
client-timed; rounds alternate between the chains; medians.

    python bench/tls.py --rounds 5 --max-tokens 96

`--speculative MODE`: both chains over mutual TLS, one serving with `--speculative MODE`
(speculation where it exists to pay: off loopback, on TLS), e.g.

    python bench/tls.py --speculative ngram-suffix --prompt copy-text --keep-eos --max-tokens 160
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import READY, resolve_model, speculative_prompts
from serve import NO_EOS, PROMPT, http_stream
from sse_client import SSEClient

from skippy.launch.local_chain import free_ports


def local_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.254", 9))  # picks the default route's address; sends nothing
        return probe.getsockname()[0]


class Chain:
    """Stage 1 as a `skippy stage` process, stage 0 as `skippy serve --topology`, from one plan."""

    def __init__(self, out: Path, host: str, threads: int, secure: bool, model: str | None, serve_args=()):
        ports = free_ports(2, host)
        cli = [sys.executable, "-m", "skippy.cli"]
        subprocess.run([*cli, "plan", "--stages", "2", "--hosts", f"{host}:{ports[0]},{host}:{ports[1]}",
                        "--out", str(out), *(["--model", model] if model else [])], check=True, capture_output=True)
        insecure = [] if secure else ["--insecure"]
        if not secure:  # the same plan without its TLS material
            for name in ("stage-0.json", "stage-1.json"):
                config = json.loads((out / name).read_text())
                config["tls"] = None
                (out / name).write_text(json.dumps(config))
        self.processes = [subprocess.Popen([*cli, "stage", "--config", str(out / "stage-1.json"), "--topology",
                                            str(out / "topology.json"), "--threads", str(threads), *insecure],
                                           stdout=subprocess.PIPE, text=True)]
        for line in self.processes[0].stdout:
            if line.startswith("skippy: stage ready"):
                break
        serve = subprocess.Popen([*cli, "serve", "--port", "0", "--topology", str(out / "topology.json"),
                                  "--threads", str(threads), "--kv-cache-mem", "0", *insecure,
                                  *(["--model", model] if model else []), *serve_args],
                                 stdout=subprocess.PIPE, text=True)
        self.processes.append(serve)
        for line in serve.stdout:
            if match := READY.search(line):
                self.url = match.group(1) + "/v1/chat/completions"
                return
        raise RuntimeError("skippy serve exited before it was ready")

    def close(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
            process.wait(timeout=60)


async def main(args: argparse.Namespace) -> None:
    host = local_address()
    model = Path(args.model).stem if args.model else "SmolLM2-135M-Instruct.Q4_1"
    prompt = PROMPT if args.prompt == "story" else speculative_prompts(3)[args.prompt]
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": args.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if not args.keep_eos:  # run to max_tokens
        body["logit_bias"] = {str(k): v for k, v in NO_EOS.items()}
    with tempfile.TemporaryDirectory() as a_dir, tempfile.TemporaryDirectory() as b_dir:
        if args.speculative:
            chains = {"TLS, speculative off": Chain(Path(a_dir), host, args.threads, True, args.model),
                      f"TLS, {args.speculative}": Chain(Path(b_dir), host, args.threads, True, args.model,
                                                        ["--speculative", args.speculative])}
        else:
            chains = {"mutual TLS": Chain(Path(a_dir), host, args.threads, True, args.model),
                      "plain TCP": Chain(Path(b_dir), host, args.threads, False, args.model)}
        rates: dict[str, list[float]] = {name: [] for name in chains}
        ttfts: dict[str, list[float]] = {name: [] for name in chains}
        try:
            client = SSEClient(timeout_s=300)
            for round_index in range(args.rounds + 1):  # round 0 warms up
                for name, chain in chains.items():
                    result = await http_stream(client, chain.url, body)
                    if round_index:
                        rates[name].append(result.decode_tok_s)
                        ttfts[name].append(result.ttft_s * 1e3)
        finally:
            for chain in chains.values():
                chain.close()
    print(f"2 stages on {host}, {args.threads} threads each, {args.max_tokens} tokens, medians of {args.rounds}")
    width = max(len(name) for name in chains)
    print(f"{'chain':<{width}} {'decode tok/s':>13} {'ms/token':>9} {'TTFT ms':>8}")
    for name in chains:
        rate = statistics.median(rates[name])
        print(f"{name:<{width}} {rate:>13.1f} {1e3 / rate:>9.3f} {statistics.median(ttfts[name]):>8.1f}")
    a_rate, b_rate = (statistics.median(rates[name]) for name in chains)
    if args.speculative:
        print(f"{args.speculative} / off, both over TLS: {b_rate / a_rate:.3f}x decode")
    else:
        print(f"TLS / plain: {a_rate / b_rate:.3f}x decode, {1e3 / a_rate - 1e3 / b_rate:+.3f} ms a token")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=resolve_model, default=None,
                        help="GGUF file, or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--speculative", default=None, help="compare this proposer against none, both over TLS")
    parser.add_argument("--prompt", default="story", choices=["story", "copy-text", "copy-code", "free-form"])
    parser.add_argument("--keep-eos", action="store_true", help="do not ban the end tokens (a reply may end early)")
    asyncio.run(main(parser.parse_args()))
