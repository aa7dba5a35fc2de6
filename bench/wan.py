"""A 2-stage chain across hosts as users meet it: a WAN's delay and bandwidth, mutual TLS,
the activation codec, speculation; every figure beside its floor.

Two network namespaces are two hosts (tests/netns_support.py), joined over mutual TLS from a
plan as `skippy plan` writes it. The kernel's `tc tbf` caps what each host sends to --mbps;
the one-way delay is skippy's knob on every link (stage 0's lanes, stage 1's return stream),
since this kernel has no netem, so a token pays two delays. Stage 1 runs in the second
namespace; stage 0 (this script again, as --client) in the first, driving a ChainClient.

Per cell (one-way delay x activation codec x speculation off/on):

    1 stream     decode tok/s of the copy-heavy prompt (bench/common.py), greedy, to its end
    8 streams    aggregate tok/s of 8 such streams at once
    TTFT         time to the first token of a --prompt-tokens prompt

and beside each its floor: 1 / (compute of the whole model + the round trips a token pays).
The compute is what the two stages measured of their own forwards at start (stage/measure.py:
one row, and affine in rows from a 64-row chunk: 8 rows for the aggregate, the prompt for
TTFT); the round trips are the injected delays (2 x one-way a token; 8 tokens a trip at 8
streams; the prompt pays one trip). A ratio of 1.0 is a chain that costs nothing but
compute and the wire's delay; speculation can beat the floor (several tokens a trip).
Below the table, one stream's token without speculation, taken apart: the stages' decode
forwards as they served it (their metrics around the request), the two delays, and the
rest (frames, TLS, the knob, the loops). A forward served after an idle wait for the
wire costs more than the back-to-back forwards the probe times (docs/decisions.md).

Before the table, the codecs' TTFT alone (delay 0) at each of --ttft-mbps: what q8 saves a
prompt where the wire, not the compute, is the cost.

    python bench/wan.py [--delays 0,5,20] [--codecs f16,q8] [--mbps 100] [--ttft-mbps 100,10,2] [--model GGUF]   (root)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from skippy.model.locate import bundled_model_path
from skippy.model.threads import spin_for_co_located_stages

_early = argparse.ArgumentParser(add_help=False)
_early.add_argument("--model", default=None)
MODEL = str(_early.parse_known_args()[0].model or bundled_model_path())  # the stages' spin depends on it
spin_for_co_located_stages(MODEL)  # before torch loads: the "hosts" share this machine's cores

import numpy as np  # noqa: E402

from skippy.launch.local_chain import connect_topology, plan_chain, write_plan  # noqa: E402
from skippy.launch.measured_split import measured_reports  # noqa: E402
from skippy.model.tokenizer import Tokenizer  # noqa: E402
from skippy.protocol import LinkConditioning, StageConfig, Topology  # noqa: E402
from skippy.runtime.batch_policy import ONE_WAVE_PEER_WAIT_FORWARDS  # noqa: E402
from skippy.runtime.speculation import SpeculativeSettings  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import speculative_prompts  # noqa: E402
from netns_support import cap_bandwidth, namespace_hosts, run_beside  # noqa: E402

CLI = [sys.executable, "-m", "skippy.cli"]
PORT = 7200  # every host is a fresh namespace: nothing else listens there
STREAMS = 8
SPECULATION = {"off": SpeculativeSettings(), "on": SpeculativeSettings("ngram-suffix", 1, 16)}


async def decode_forwards(client, topology) -> tuple[int, int]:
    """(decode forwards, their total µs) summed over every stage so far (its metrics)."""
    metrics = [(await client.local_status())[1]]
    for stage in topology.stages[1:]:
        status = await client.transport.query_status(stage.endpoint)
        if status is None:
            raise RuntimeError(f"{stage.endpoint} did not answer a status query")
        metrics.append(status.metrics)
    forwards = [m.histograms["forward_us.decode"] for m in metrics]
    return sum(h.count for h in forwards), sum(h.total for h in forwards)


def forward_s(probe, rows: int) -> float:
    """A stage's forward of `rows` rows, affine through its probe's one row and chunk."""
    row, chunk = probe.row_ns / 1e9, probe.chunk_ns / 1e9
    return row + (rows - 1) * max(chunk - row, 0.0) / (probe.chunk_rows - 1)


async def as_client(args) -> None:
    """--client: stage 0 of the plan in args.client, in this (namespace's) process; one JSON line."""
    plan = Path(args.client)
    topology, stage0 = Topology.load(plan / "topology.json"), StageConfig.load(plan / "stage-0.json")
    tokenizer = Tokenizer.from_gguf(MODEL)
    copy = tokenizer.encode_chat([{"role": "user", "content": speculative_prompts(3)["copy-text"]}])
    long_prompt = np.random.default_rng(0).integers(100, 40000, size=args.prompt_tokens).tolist()
    client = await connect_topology(topology, MODEL, auth_token=stage0.auth_token, ctx_size=2048,
                                    activation_dtype=stage0.activation_dtype, concurrency=STREAMS,
                                    tls=stage0.tls.resolved(plan),
                                    link_conditioning=LinkConditioning(delay_ms=args.delay) if args.delay else None,
                                    peer_wait_forwards=ONE_WAVE_PEER_WAIT_FORWARDS)
    try:
        probes = [r.probe for r in await measured_reports(client, topology)]
        if args.ttft_only:  # the codec's own figure: a long prompt's first token, nothing else
            times = [(await client.generate(long_prompt, max_tokens=1)).timings.first_token_s for _ in range(4)]
            print(json.dumps({"ttft": statistics.median(times[1:])}))
            return
        out = {"compute_s": {rows: sum(forward_s(p, rows) for p in probes)
                             for rows in (1, STREAMS, args.prompt_tokens)}}
        for name, settings in SPECULATION.items():
            ask = dict(max_tokens=args.max_tokens, stop_ids=tokenizer.eog_ids, speculative=settings)
            await client.generate(copy, **ask)  # warm: this cell's first trips, the proposer
            before = await decode_forwards(client, topology)
            one = await client.generate(copy, **ask)
            after = await decode_forwards(client, topology)
            started = time.perf_counter()
            many = await asyncio.gather(*(client.generate(copy, **ask) for _ in range(STREAMS)))
            wall = time.perf_counter() - started
            first = await client.generate(long_prompt, max_tokens=1)
            out[name] = {"one": (len(one.tokens) - 1) / one.timings.decode_s,
                         "many": sum(len(r.tokens) for r in many) / wall,
                         "ttft": first.timings.first_token_s, "tokens": len(one.tokens),
                         # a decode forward of every stage, as served to one stream (µs -> s)
                         "served_s": (after[1] - before[1]) / 1e6 / max(after[0] - before[0], 1) * len(probes)}
        print(json.dumps(out))
    finally:
        await client.close()


def measure(args, hosts, out: Path, codec: str, delay: float, *extra: str) -> dict:
    plan = out / codec
    if not plan.is_dir():
        topology, configs = plan_chain(MODEL, [f"{h.address}:{PORT}" for h in hosts],
                                       auth_token=os.urandom(16).hex(), ctx_size=2048, lane_count=STREAMS,
                                       activation_dtype=codec, threads=os.cpu_count(),
                                       peer_wait_forwards=ONE_WAVE_PEER_WAIT_FORWARDS)
        write_plan(topology, configs, plan, tls=True)
    wire = ["--downstream-wire-delay-ms", str(delay)] if delay else []
    stage = [*CLI, "stage", "--config", str(plan / "stage-1.json"), "--topology", str(plan / "topology.json"), *wire]
    client = [sys.executable, __file__, "--client", str(plan), "--delay", str(delay), "--max-tokens",
              str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens), "--model", MODEL, *extra]
    return run_beside((hosts[1].namespace, stage), (hosts[0].namespace, client), log_path=out / "stage-1.log")


def main(args: argparse.Namespace) -> None:
    if args.client:
        return asyncio.run(as_client(args))
    print(f"2 stages in 2 network namespaces over mutual TLS, tc tbf {args.mbps:g} Mbit/s each way, one-way "
          f"delay by skippy's knob; {Path(MODEL).name}; 1 stream and {STREAMS} streams of the copy-heavy "
          f"prompt to its end (up to {args.max_tokens} tokens), TTFT of {args.prompt_tokens} prompt tokens; "
          f"speculation: ngram-suffix, window 1..16", flush=True)
    cells, ttft = {}, {}
    with namespace_hosts(2) as hosts, tempfile.TemporaryDirectory(prefix="skippy-wan-") as out:
        for mbps in args.ttft_mbps:  # the codec's TTFT alone, at each rate: delay 0, 3 prompts, median
            for host in hosts:
                cap_bandwidth(host, mbps)
            for codec in ("f16", "q8"):
                ttft[mbps, codec] = measure(args, hosts, Path(out), codec, 0.0, "--ttft-only")["ttft"]
            print(f"  {mbps:g} Mbit/s: TTFT f16 {ttft[mbps, 'f16'] * 1e3:.0f} ms, q8 {ttft[mbps, 'q8'] * 1e3:.0f} ms",
                  flush=True)
        for host in hosts:
            cap_bandwidth(host, args.mbps)
        for delay in args.delays:
            for codec in args.codecs:
                cells[delay, codec] = cell = measure(args, hosts, Path(out), codec, delay)
                for spec in SPECULATION:
                    r = cell[spec]
                    print(f"  {delay:g} ms {codec} speculation {spec}: 1 stream {r['one']:.1f} tok/s "
                          f"({r['tokens']} tokens), {STREAMS} streams {r['many']:.1f} tok/s, "
                          f"TTFT {r['ttft'] * 1e3:.0f} ms", flush=True)
    for mbps in args.ttft_mbps:
        print(f"TTFT of {args.prompt_tokens} prompt tokens at {mbps:g} Mbit/s, delay 0: f16 {ttft[mbps, 'f16'] * 1e3:.0f} "
              f"ms, q8 {ttft[mbps, 'q8'] * 1e3:.0f} ms: q8 {ttft[mbps, 'f16'] / ttft[mbps, 'q8']:.2f}x faster")
    if cells:
        table(args, cells)


def table(args: argparse.Namespace, cells: dict) -> None:
    # the model's compute does not depend on the link: each cell's probes measured it again, and
    # the floor takes their median, so the floors differ only by their round trips
    compute = {rows: statistics.median(c["compute_s"][rows] for c in cells.values())
               for rows in ("1", str(STREAMS), str(args.prompt_tokens))}
    rows = []
    for (delay, codec), cell in cells.items():
        trip = 2 * delay / 1e3
        floors = {"one": 1 / (compute["1"] + trip), "many": STREAMS / (compute[str(STREAMS)] + trip),
                  "ttft": compute[str(args.prompt_tokens)] + trip}
        rows += [(delay, codec, spec, cell[spec], floors) for spec in SPECULATION]
    header = (f"{'delay':>6} {'codec':>5} {'spec':>4} | {'1 stream':>8} {'floor':>7} {'ratio':>5} | "
              f"{f'{STREAMS} streams':>10} {'floor':>7} {'ratio':>5} | {'TTFT ms':>8} {'floor':>7} {'ratio':>5}")
    print("\n" + header + "\n" + "-" * len(header))
    for delay, codec, spec, r, f in rows:
        print(f"{delay:>5g}ms {codec:>5} {spec:>4} | {r['one']:>8.1f} {f['one']:>7.1f} {r['one'] / f['one']:>5.2f} | "
              f"{r['many']:>10.1f} {f['many']:>7.1f} {r['many'] / f['many']:>5.2f} | "
              f"{r['ttft'] * 1e3:>8.0f} {f['ttft'] * 1e3:>7.0f} {f['ttft'] / r['ttft']:>5.2f}")
    print("(tok/s: measured / floor; TTFT: floor / measured, so 1.0 is the floor everywhere)")
    cells = {(d, c, s): r for d, c, s, r, _ in rows}
    floors = {(d, c, s): f for d, c, s, _, f in rows}
    for d, c, s in cells:
        if s == "off" and d in (5, 20):
            print(f"goal {d:g} ms {c}: 1 stream >= 0.9x its floor: {cells[d, c, s]['one'] / floors[d, c, s]['one']:.2f}x")
    for d, c, s in cells:
        if s == "on" and d == 20:
            print(f"goal 20 ms {c}: speculation on >= 2x off (copy-heavy): "
                  f"{cells[d, c, 'on']['one'] / cells[d, c, 'off']['one']:.2f}x")
        if s == "off" and d == 20:
            print(f"goal 20 ms {c}: {STREAMS} streams >= 4x 1 stream: {cells[d, c, s]['many'] / cells[d, c, s]['one']:.2f}x")
    for (d, c, s), r in cells.items():
        if s == "off":
            token_ms, served_ms, trip_ms = 1e3 / r["one"], r["served_s"] * 1e3, 2 * d
            print(f"{d:g} ms {c}, 1 stream: a token {token_ms:.2f} ms = served forwards {served_ms:.2f} (probed "
                  f"{compute['1'] * 1e3:.2f}) + delays {trip_ms:.0f} + the rest {token_ms - served_ms - trip_ms:.2f}; "
                  f"1 / (served forwards + delays) = {1e3 / (served_ms + trip_ms):.1f} tok/s")
    print(f"compute of the whole model (the probes' median): one row {compute['1'] * 1e3:.2f} ms, {STREAMS} rows "
          f"{compute[str(STREAMS)] * 1e3:.2f} ms, a {args.prompt_tokens}-token prompt "
          f"{compute[str(args.prompt_tokens)] * 1e3:.0f} ms (the probe's line from 1 to 64 rows, extended: a "
          f"pipelined prefill can beat it)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--model", default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--delays", type=lambda t: [float(x) for x in t.split(",") if x], default=[0, 5, 20],
                        help="one-way delays of the table's rows (ms); '' for no table")
    parser.add_argument("--codecs", type=lambda t: t.split(","), default=["f16", "q8"])
    parser.add_argument("--mbps", type=float, default=100.0, help="tc tbf rate each way (Mbit/s)")
    parser.add_argument("--ttft-mbps", type=lambda t: [float(x) for x in t.split(",") if x], default=[100, 10, 2],
                        help="rates at which to time the codecs' TTFT alone (delay 0); '' for none")
    parser.add_argument("--ttft-only", action="store_true", help=argparse.SUPPRESS)  # the client: TTFT alone
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # stage 0: the plan directory
    parser.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)  # its one-way delay, ms
    main(parser.parse_args())
