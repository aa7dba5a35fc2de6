"""Heterogeneous hosts: the measured split against the equal-bytes split, and the planner's
prediction against what each split then decodes.

Two network namespaces are two hosts (tests/netns_support.py), joined over mutual TLS from a
plan as `skippy plan` writes it. Stage 1's host is slow: its process runs in a cgroup whose
CPU quota is --cpu-share of one core (cpu.max, or v1's cfs quota where only v1's cpu
controller is mounted), with one thread; stage 0 (this script again, as --client, in the
first namespace) has --threads. Each round starts stage 1 and stage 0 afresh on one split,
waits for both to measure themselves and their link (stage/measure.py), decodes one stream
of --decode-tokens, and reports tok/s, the measurements and the CPU a token cost each stage
(two reports' CPU clocks around the decode).

The first round runs the equal-bytes split (`skippy plan`'s); its measurements plan the
measured split (launch/planner.py, every host used), with the tok/s it predicts. Then rounds
alternate the two splits. Printed: each split's median tok/s beside its prediction (the
measured split's made before it ever ran), and their ratio.

    python bench/split.py [--cpu-share 0.25] [--rounds 3] [--decode-tokens 128] [--model GGUF]   (root)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from skippy.model.locate import bundled_model_path  # noqa: E402
from skippy.model.threads import spin_for_co_located_stages  # noqa: E402

_early = argparse.ArgumentParser(add_help=False)
_early.add_argument("--model", default=None)
MODEL = str(_early.parse_known_args()[0].model or bundled_model_path())  # the stages' spin depends on it
spin_for_co_located_stages(MODEL)  # before torch loads: the "hosts" share this machine's cores

import numpy as np  # noqa: E402
import torch  # noqa: E402

from skippy.launch.local_chain import connect_topology, plan_chain, write_plan  # noqa: E402
from skippy.launch.measured_split import StageReport, chain_inputs, measured_reports, model_cost  # noqa: E402
from skippy.launch.planner import plan_split, predict  # noqa: E402
from skippy.protocol import StageConfig, Topology  # noqa: E402
from skippy.protocol.stage_probe import StageProbe  # noqa: E402
from skippy.stage import tls  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from netns_support import cpu_limited, namespace_hosts, run_beside  # noqa: E402

CLI = [sys.executable, "-m", "skippy.cli"]
PORT = 7300
CTX, LANES = 2048, 4


async def as_client(args) -> None:
    """--client: stage 0 of the plan in args.client, here; waits for every stage's measurements,
    decodes one stream; one JSON line: tok/s and the reports."""
    plan = Path(args.client)
    topology, stage0 = Topology.load(plan / "topology.json"), StageConfig.load(plan / "stage-0.json")
    torch.set_num_threads(args.threads)
    tls.use(stage0.tls.resolved(plan))
    client = await connect_topology(topology, MODEL, auth_token=stage0.auth_token, ctx_size=CTX,
                                    activation_dtype=stage0.activation_dtype, concurrency=1)
    try:
        await measured_reports(client, topology, stage0.auth_token)  # every stage measured, before any load
        prompt = np.random.default_rng(0).integers(100, 40000, size=32).tolist()
        await client.generate(prompt, max_tokens=8)  # warm
        before = await measured_reports(client, topology, stage0.auth_token)
        result = await client.generate(prompt, max_tokens=args.decode_tokens)
        after = await measured_reports(client, topology, stage0.auth_token)
        # what a token cost each stage's CPU in serving: its forward and everything around it
        token_cpu = [(a.probe.cpu_ns - b.probe.cpu_ns) / 1e9 / len(result.tokens) for a, b in zip(after, before)]
        print(json.dumps({"tok_s": result.timings.decode_steps / result.timings.decode_s, "token_cpu_s": token_cpu,
                          "reports": [[r.name, r.layer_start, r.layer_end, r.probe.flat()] for r in after]}))
    finally:
        await client.close()


def write_split(out: Path, hosts, ranges, name: str) -> Path:
    plan = out / name
    topology, configs = plan_chain(MODEL, [f"{h.address}:{PORT}" for h in hosts], ranges=ranges,
                                   auth_token=os.urandom(16).hex(), ctx_size=CTX, lane_count=LANES,
                                   activation_dtype="auto")
    write_plan(topology, configs, plan, tls=True)
    return plan


def run_round(args, hosts, cgroup: Path, plan: Path, log: Path) -> dict:
    stage = [*CLI, "stage", "--config", str(plan / "stage-1.json"), "--topology", str(plan / "topology.json"),
             "--threads", "1"]
    client = [sys.executable, __file__, "--client", str(plan), "--decode-tokens", str(args.decode_tokens),
              "--threads", str(args.threads), "--model", MODEL]
    return run_beside((hosts[1].namespace, stage), (hosts[0].namespace, client), log_path=log, cgroup=cgroup)


def reports_of(answer: dict) -> list[StageReport]:
    return [StageReport(name, start, end, StageProbe.from_flat(flat)) for name, start, end, flat in answer["reports"]]


def main(args: argparse.Namespace) -> None:
    if args.client:
        return asyncio.run(as_client(args))
    model = model_cost(MODEL, ctx_size=CTX, lane_count=LANES)
    with (namespace_hosts(2) as hosts, cpu_limited(args.cpu_share) as cgroup,
          tempfile.TemporaryDirectory(prefix="skippy-split-") as out):
        out = Path(out)
        equal_plan = write_split(out, hosts, None, "equal")
        equal_ranges = [(s.layer_start, s.layer_end) for s in Topology.load(equal_plan / "topology.json").stages]
        first = run_round(args, hosts, cgroup, equal_plan, out / "stage-1.log")
        host_costs, links = chain_inputs(reports_of(first), model, first["token_cpu_s"])
        names = [f"host {i}" for i in range(2)]
        predicted_equal = predict(model, host_costs, links, equal_ranges)
        plan = plan_split(model, host_costs, links, use_all_hosts=True)
        print(f"{Path(MODEL).name}: stage 1 held to {args.cpu_share:g} of a core (one thread); stage 0 "
              f"{args.threads} threads\n"
              f"measured at the first round: {[r.probe.figures() for r in reports_of(first)]}, CPU a token "
              f"cost each stage: {[f'{c * 1e3:.2f} ms' for c in first['token_cpu_s']]}\n"
              f"equal bytes {equal_ranges}: predicted {predicted_equal.tok_s:.1f} tok/s\n"
              f"measured plan:\n{plan.describe(names)}", flush=True)
        measured_plan = write_split(out, hosts, list(plan.ranges), "measured")
        rates = {"equal": [first["tok_s"]], "measured": []}
        print(f"  round 1 equal: {first['tok_s']:.1f} tok/s", flush=True)
        for round_ in range(1, args.rounds + 1):
            for name, where in (("measured", measured_plan), ("equal", equal_plan)):
                if name == "equal" and round_ == args.rounds:
                    break  # the first round was an equal one: as many of each
                answer = run_round(args, hosts, cgroup, where, out / "stage-1.log")
                rates[name].append(answer["tok_s"])
                print(f"  round {round_ + (name == 'equal')} {name}: {answer['tok_s']:.1f} tok/s", flush=True)
        equal, measured = statistics.median(rates["equal"]), statistics.median(rates["measured"])
        print(f"\n{'split':<10}{'ranges':>22}{'predicted tok/s':>18}{'measured tok/s':>17}{'measured/pred':>15}")
        for name, ranges, predicted, rate in (("equal", equal_ranges, predicted_equal.tok_s, equal),
                                              ("measured", list(plan.ranges), plan.tok_s, measured)):
            print(f"{name:<10}{str(ranges):>22}{predicted:>18.1f}{rate:>17.1f}{rate / predicted:>15.2f}")
        print(f"measured split / equal-bytes split: {measured / equal:.2f}x (medians of {len(rates['equal'])} "
              f"rounds each, interleaved)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-share", type=float, default=0.25, help="stage 1's host: this share of one core")
    parser.add_argument("--threads", type=int, default=2, help="stage 0's torch threads")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each split")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)
    main(parser.parse_args())
