"""A 2-stage chain over a conditioned link: what delay, bandwidth and the activation dtype
cost, as ratios to the same chain on an unconditioned link.

Every link of the chain (stage 0's lanes to stage 1 and stage 1's direct return to
stage 0) gets the same one-way delay and bandwidth cap; a token then pays two delays.
For each activation dtype (f32, f16, bf16) and link (delay 0 / 5 / 20 / 50 ms, 100 Mbit
or 1 Gbit/s) it measures decode tok/s of one stream, the aggregate of 8 concurrent
streams, and TTFT of a --prompt-tokens prompt, with a ChainClient (no HTTP).

By default both stages share loopback and the bandwidth cap is skippy's knob (stage/link.py).
With --tbf (root; `ip` and `tc`, iproute2) stage 1 runs in its own network namespace and
stage 0 (this script again, as --client) in another, joined by veth links on a bridge
(tests/netns_support.py, as tests/test_multihost_netns.py does), over mutual TLS from a
plan as `skippy plan` writes it off loopback; the cap is then the kernel's `tc tbf` on both
hosts' veth ends, and the ratios are to the uncapped namespace link. Delay still comes from
the knob: this kernel has no netem.

    python bench/wan.py [--decode-tokens 24] [--prompt-tokens 512] [--delays 0,5,20,50] [--tbf]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import resolve_model  # noqa: E402
from skippy.model.locate import bundled_model_path  # noqa: E402
from skippy.model.threads import spin_for_co_located_stages  # noqa: E402


def model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=resolve_model, default=None,
                        help="GGUF file, or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2)")


_early = argparse.ArgumentParser(add_help=False)  # the model sets the spin, before torch loads
model_argument(_early)
MODEL = Path(_early.parse_known_args()[0].model or bundled_model_path())
spin_for_co_located_stages(MODEL)  # before torch loads, as `skippy serve --stages N` does

import numpy as np  # noqa: E402

from skippy.launch.local_chain import LocalChain, connect_topology, plan_chain, write_plan  # noqa: E402
from skippy.protocol import LinkConditioning, StageConfig, Topology  # noqa: E402
from skippy.runtime.scheduler import ONE_WAVE_PEER_WAIT_FORWARDS  # noqa: E402
from skippy.stage import link, tls  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from netns_support import cap_bandwidth, namespace_hosts, run_in, start_in  # noqa: E402

CLI = [sys.executable, "-m", "skippy.cli"]
PORT = 7200  # every host is a fresh namespace: nothing else listens there


async def workload(client, args) -> tuple[float, float, float]:
    """(decode tok/s of one stream, aggregate tok/s of 8, TTFT s of the long prompt)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, size=32).tolist() for _ in range(8)]
    long_prompt = rng.integers(100, 40000, size=args.prompt_tokens).tolist()
    await client.generate(prompts[0], max_tokens=4)  # warm-up
    one = await client.generate(prompts[0], max_tokens=args.decode_tokens)
    started = time.perf_counter()
    many = await asyncio.gather(*(client.generate(p, max_tokens=args.decode_tokens) for p in prompts))
    aggregate = sum(len(r.tokens) for r in many) / (time.perf_counter() - started)
    ttft = (await client.generate(long_prompt, max_tokens=1)).timings.first_token_s
    return one.timings.decode_steps / one.timings.decode_s, aggregate, ttft


async def on_loopback(args, dtype: str, delay: float, mbps: float | None) -> tuple[float, float, float]:
    conditioning = None if mbps is None else LinkConditioning(delay_ms=delay, mbps=mbps)
    async with LocalChain(MODEL, 2, ctx_size=2048, activation_dtype=dtype, concurrency=8,
                          lane_count=8, link_conditioning=conditioning) as client:
        return await workload(client, args)


async def as_client(args) -> None:
    """--client: stage 0 of the plan in args.client, in this (namespace's) process; one JSON line."""
    plan = Path(args.client)
    topology, stage0 = Topology.load(plan / "topology.json"), StageConfig.load(plan / "stage-0.json")
    tls.use(stage0.tls.resolved(plan))
    link.use(LinkConditioning(delay_ms=args.delay) if args.delay else None)
    client = await connect_topology(topology, MODEL, auth_token=stage0.auth_token, ctx_size=2048,
                                    activation_dtype=stage0.activation_dtype, concurrency=8,
                                    peer_wait_forwards=ONE_WAVE_PEER_WAIT_FORWARDS)
    try:
        print(json.dumps(await workload(client, args)))
    finally:
        await client.close()


class Namespaces:
    """Two namespace hosts; per measurement a fresh stage 1 in the second, stage 0 in the first."""

    def __init__(self, hosts, out: Path):
        self.hosts, self.out = hosts, out

    async def measure(self, args, dtype: str, delay: float, mbps: float | None) -> tuple[float, float, float]:
        plan = self.out / dtype
        if not plan.is_dir():
            topology, configs = plan_chain(MODEL, [f"{h.address}:{PORT}" for h in self.hosts],
                                           auth_token=os.urandom(16).hex(), ctx_size=2048, lane_count=8,
                                           activation_dtype=dtype, threads=os.cpu_count(),
                                           peer_wait_forwards=ONE_WAVE_PEER_WAIT_FORWARDS)
            write_plan(topology, configs, plan, tls=True)
        for host in self.hosts:
            cap_bandwidth(host, mbps)
        wire = ["--downstream-wire-delay-ms", str(delay)] if delay else []
        stage = start_in(self.hosts[1].namespace, *CLI, "stage", "--config", str(plan / "stage-1.json"),
                         "--topology", str(plan / "topology.json"), *wire, log_path=self.out / "stage-1.log")
        try:
            asked = run_in(self.hosts[0].namespace, sys.executable, __file__, "--client", str(plan), "--delay",
                           str(delay), "--decode-tokens", str(args.decode_tokens), "--prompt-tokens",
                           str(args.prompt_tokens), timeout=900)
            if asked.returncode != 0:
                raise RuntimeError(f"stage 0 in {self.hosts[0].namespace} failed:\n{asked.stderr}")
            return tuple(json.loads(asked.stdout.strip().splitlines()[-1]))
        finally:
            stage.terminate()
            stage.wait(timeout=60)


async def main(args: argparse.Namespace) -> None:
    if args.client:
        return await as_client(args)
    if args.tbf:
        with namespace_hosts(2) as hosts, tempfile.TemporaryDirectory(prefix="skippy-wan-") as out:
            await compare(args, "veth, uncapped", Namespaces(hosts, Path(out)).measure, "tc tbf")
    else:
        await compare(args, "loopback", on_loopback, "the knob")


async def compare(args: argparse.Namespace, base_name: str, measure, capped_by: str) -> None:
    links = [(base_name, 0.0, None)] + [
        (f"{delay:g} ms, {mbps / 1000:g} Gbit" if mbps >= 1000 else f"{delay:g} ms, {mbps:g} Mbit", delay, mbps)
        for delay in args.delays for mbps in (100.0, 1000.0)]
    print(f"2 stages, {args.decode_tokens} decode tokens, 8 streams for the aggregate, TTFT of "
          f"{args.prompt_tokens} prompt tokens; one run each (the link's delays dwarf the noise); "
          f"bandwidth capped by {capped_by}, delay by the knob; ratios to {base_name} with the same dtype",
          flush=True)
    header = f"{'link':<18}" + "".join(f"{d + ' ' + what:>16}" for d in args.dtypes
                                       for what in ("decode", "aggregate", "TTFT"))
    rows = []
    for dtype in args.dtypes:
        base = None
        for name, delay, mbps in links:
            decode, aggregate, ttft = await measure(args, dtype, delay, mbps)
            base = base or (decode, aggregate, ttft)
            rows.append((dtype, name, decode, aggregate, ttft, base))
            print(f"  {dtype} {name}: {decode:.1f} tok/s, 8 streams {aggregate:.1f} tok/s, TTFT {ttft * 1e3:.0f} ms",
                  flush=True)
    print("\n" + header)
    for name, _, _ in links:
        cells = []
        for dtype in args.dtypes:
            _, _, decode, aggregate, ttft, base = next(r for r in rows if r[0] == dtype and r[1] == name)
            cells += [f"{decode / base[0]:.2f}x", f"{aggregate / base[1]:.2f}x", f"{ttft / base[2]:.2f}x"]
        print(f"{name:<18}" + "".join(f"{cell:>16}" for cell in cells))
    print("(decode and aggregate: higher is better; TTFT: the ratio of times, lower is better)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_argument(parser)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--delays", type=lambda t: [float(x) for x in t.split(",")], default=[0, 5, 20, 50])
    parser.add_argument("--dtypes", type=lambda t: t.split(","), default=["f32", "f16", "bf16"])
    parser.add_argument("--tbf", action="store_true", help="two network namespaces, bandwidth by `tc tbf` (root)")
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # --tbf's stage 0: the plan directory
    parser.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)  # its one-way delay, ms
    asyncio.run(main(parser.parse_args()))
