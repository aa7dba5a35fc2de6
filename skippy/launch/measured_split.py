"""From what stages measured to the planner's inputs (launch/planner.py), and back to a plan.

A stage reports its forward of one row and of a prompt chunk over the layers it holds (and
the head on the final stage, the embedding lookup on stage 0: both are counted in, as a
step pays them): a host's time per layer is that over its layers plus, on the final stage,
the head's `head_cost_in_layers`. Its memory is the weights it holds and MEMORY_SHARE of
what it reports free. A model's bytes come from the GGUF's tensor table (its own sizes; a
loaded stage repacks some types, see docs/architecture.md), plus the KV cache a layer needs
at full context on every lane.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..driver.backend import StageStatus
from ..driver.split_check import DRIFT
from ..model.args import ModelArgs
from ..model.gguf_loader import open_gguf
from ..model.loader import model_args
from ..protocol import Topology
from ..protocol.stage_probe import StageProbe
from .planner import MEMORY_SHARE, HostCost, LinkCost, ModelCost, Plan, plan_split, predict

KV_BYTES = 2  # float16 keys and values (a quantized model's; float32 weights keep float32: 4)
RESTART_GAIN = 0.10  # the least predicted gain (one stream or 8) that advises another split
UNLIMITED_SHARE = 0.75  # back-to-back forwards that got this share of their threads' time had no quota
_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class StageReport:
    """One stage as the chain sees it: where, which layers, what it measured."""

    name: str
    layer_start: int
    layer_end: int
    probe: StageProbe


def model_cost(model_path: str | Path, *, ctx_size: int, lane_count: int, activation_dtype: str = "auto",
               args: ModelArgs | None = None) -> ModelCost:
    args = args or model_args(model_path)
    kv = 2 * args.num_kv_heads * args.head_dim * KV_BYTES * ctx_size * lane_count
    layer, first, last = _weight_bytes(Path(model_path), args)
    return ModelCost(num_layers=args.num_layers, head_layers=args.head_cost_in_layers,
                     hidden_size=args.hidden_size, layer_bytes=layer + kv, first_bytes=first, last_bytes=last,
                     activation_dtype=activation_dtype)


def _weight_bytes(path: Path, args: ModelArgs) -> tuple[float, float, float]:
    """(one layer's weights on average, the embedding's, the head's) in the file; a Hugging
    Face directory's from the shapes, as float32."""
    if path.is_dir():
        per_layer = (args.hidden_size * args.head_dim * (2 * args.num_heads + 2 * args.num_kv_heads)
                     + 3 * args.hidden_size * args.intermediate_size) * 4
        embedding = args.vocab_size * args.hidden_size * 4
        return per_layer, embedding, embedding
    blocks, named = 0, {}
    for tensor in open_gguf(path).tensors:
        if _BLOCK.match(tensor.name):
            blocks += tensor.n_bytes
        else:
            named[tensor.name] = tensor.n_bytes
    embedding = named.get("token_embd.weight", 0)
    head = named.get("output.weight", embedding)  # tied: the head is built from the embedding
    return blocks / args.num_layers, embedding, head + named.get("output_norm.weight", 0)


def host_cost(report: StageReport, model: ModelCost, token_cpu_s: float | None = None) -> HostCost:
    """The host behind a stage's report, per layer. `token_cpu_s`: the CPU a token cost the stage
    in serving (two reports' cpu_ns over the tokens between them), when known. Under a CPU quota
    smaller than its threads could use, the probe's forwards ran at the quota's pace: one
    forward's own speed is then its CPU time over its threads."""
    p = report.probe
    layers = report.layer_end - report.layer_start
    work = layers + (model.head_layers if report.layer_end == model.num_layers else 0.0)
    share = cpu_share_of(p)
    speed = 1.0
    if p.threads and share < p.threads and p.row_cpu_ns:
        speed = min(1.0, p.row_cpu_ns / p.threads / p.row_ns)  # the share of a forward's wall time it ran
    beyond = 0.0 if token_cpu_s is None else max(0.0, token_cpu_s - p.row_cpu_ns / 1e9)
    return HostCost(report.name, speed * p.row_ns / 1e9 / work, speed * p.chunk_ns / 1e9 / work, p.chunk_rows,
                    p.weight_bytes + MEMORY_SHARE * p.memory_available_bytes,
                    cpu_layer_s=p.row_cpu_ns / 1e9 / work, cpu_share=share, token_cpu_s=beyond)


def cpu_share_of(probe: StageProbe) -> float:
    """The cores' worth of CPU the host gives the stage: the quota its cgroup states, or where
    the stage could not read it (cpu_share_milli 0), what its probe's back-to-back forwards got,
    their CPU over their wall time, when that is well under their threads (OpenMP's serial
    parts leave a free host's 2 threads ~1.7); inf: no limit seen."""
    if probe.cpu_share_milli:
        return probe.cpu_share_milli / 1000
    if probe.row_cpu_ns and probe.row_ns > 0 and probe.threads:
        got = probe.row_cpu_ns / probe.row_ns
        return got if got < UNLIMITED_SHARE * probe.threads else math.inf
    return math.inf


def chain_inputs(reports: Sequence[StageReport], model: ModelCost,
                 token_cpu_s: Sequence[float | None] | None = None) -> tuple[list[HostCost], dict]:
    """(hosts, links) of a running chain, stage 0's host first; ValueError naming a stage
    that has not measured itself yet. `token_cpu_s`: per stage, the CPU a token cost it in
    serving, where known (host_cost)."""
    failed = [r.name for r in reports if r.probe.failed]
    if failed:
        raise ValueError(f"the measurement of {', '.join(failed)} failed (its log says why); a restart "
                         f"of that stage measures again")
    missing = [r.name for r in reports if not r.probe.row_ns]
    if missing:
        raise ValueError(f"no measurement from {', '.join(missing)} yet (a stage measures itself "
                         f"once it is up; ask again in a few seconds)")
    links = {(i, i + 1): LinkCost(r.probe.link_rtt_ns / 1e9, float(r.probe.link_bytes_per_s))
             for i, r in enumerate(reports[:-1]) if r.probe.link_rtt_ns > 0}
    cpu = token_cpu_s or [None] * len(reports)
    return [host_cost(r, model, c) for r, c in zip(reports, cpu)], links


def drift_scaled(probe: StageProbe, drift: dict | None) -> StageProbe:
    """`probe` with its times scaled by what the stage's decode forward measured over what the
    probe predicted (split_check.py): serving's own figure, where there is one. Not on a host
    under a CPU quota: its served forwards wait out the quota, which its token's CPU (the
    planner's busy term) accounts for already."""
    if not drift or (probe.threads and cpu_share_of(probe) < probe.threads):
        return probe
    factor = 1 + drift["off_by"]
    return replace(probe, row_ns=round(probe.row_ns * factor), chunk_ns=round(probe.chunk_ns * factor))


def reports_of(statuses: Sequence[StageStatus]) -> list[StageReport]:
    """A chain's stage statuses as reports, their times as serving measured them."""
    return [StageReport(s.endpoint, s.layer_start, s.layer_end,
                        drift_scaled(s.probe or StageProbe(), s.predicted_vs_measured)) for s in statuses]


def reports_of_listing(stages: list[dict]) -> tuple[list[StageReport], list[float | None]]:
    """The same from `/v1/stages`' JSON (`skippy plan --auto --from URL`), and the CPU a token
    cost each stage over the last seconds (None where it decoded nothing)."""
    reports = []
    for stage in stages:
        if not stage["measured"]:
            raise ValueError(f"{stage['id']} reports no measurements (is it up?)")
        probe = drift_scaled(StageProbe.from_figures(stage["measured"]), stage.get("predicted_vs_measured"))
        reports.append(StageReport(stage["endpoint"], stage["layer_start"], stage["layer_end"], probe))
    return reports, [stage["figures"].get("cpu_ms_per_token", 0.0) / 1e3 or None for stage in stages]


def advisor(model: ModelCost, *, use_all_hosts: bool) -> Callable[[list[StageStatus]], dict]:
    """ChainBackend's `advise`: the split the stages' measured decode forwards give."""
    def advise(statuses: list[StageStatus]) -> dict:
        reports = reports_of(statuses)
        token_cpu = [s.figures.get("cpu_ms_per_token", 0.0) / 1e3 or None for s in statuses]
        try:
            hosts, links = chain_inputs(reports, model, token_cpu)
            plan = plan_split(model, hosts, links, use_all_hosts=use_all_hosts)
        except ValueError as error:
            return {"detail": str(error)}
        current = [(r.layer_start, r.layer_end) for r in reports]
        now = predict(model, hosts, links, current)
        advice = {"ranges": [list(r) for r in plan.ranges], "hosts": [hosts[h].name for h in plan.hosts],
                  "predicted_tok_s": plan.tok_s, "predicted_tok_s_8_streams": plan.batch_tok_s,
                  "current_split_predicted_tok_s": now.tok_s,
                  "current_split_predicted_tok_s_8_streams": now.batch_tok_s, "fewer_hosts": plan.fewer_hosts}
        drift = f"a stage's decode forward is more than {DRIFT:.0%} off its prediction"
        if list(plan.ranges) == current and len(plan.hosts) == len(reports):
            return {**advice, "detail": f"{drift}, but its measured times give this same split: nothing to change"}
        gain = max(plan.tok_s / now.tok_s, plan.batch_tok_s / now.batch_tok_s) - 1
        if gain < RESTART_GAIN:  # within what the measurements' noise moves: not worth every stage's restart
            ranges = " ".join(f"[{a}, {b})" for a, b in plan.ranges)
            return {**advice, "ranges": [list(r) for r in current], "hosts": [r.name for r in reports],
                    "predicted_tok_s": now.tok_s, "predicted_tok_s_8_streams": now.batch_tok_s,
                    "detail": f"{drift}; the split its measured times give ({ranges}, {plan.tok_s:.1f} tok/s, "
                              f"{plan.batch_tok_s:.1f} at 8 streams) gains {gain:.1%} on this one, under the "
                              f"{RESTART_GAIN:.0%} a restart must gain: nothing to change"}
        return {**advice, "detail": f"{drift}; this split is what the measured times give. Apply it with `skippy plan "
                                    f"--auto --from <this server> --out DIR` and a restart of the stages from DIR "
                                    f"(a local chain: `skippy serve --split auto` measures again at start)"}
    return advise


async def measured_reports(client, topology: Topology, *, timeout_s: float = 300.0) -> list[StageReport]:
    """Every stage's report once each has measured itself (and its link, all but the last):
    stage 0 from `client` (this process), the others over the protocol (dialed as its lanes
    are: `client.transport`'s TLS and auth token). RuntimeError at once when a stage reports
    that its measurement failed (it retries its link probe itself: stage/measure.py)."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = [client.transport.query_status(s.endpoint) for s in topology.stages[1:]]
        remote = await asyncio.gather(*statuses)
        probes = [client.measurement.probe, *(StageProbe() if r is None else r.probe for r in remote)]
        failed = [s.stage_id for s, p in zip(topology.stages, probes) if p.failed]
        if failed:
            raise RuntimeError(f"the measurement of {', '.join(failed)} failed (its log says why)")
        if all(p.row_ns and (p.link_rtt_ns or i == len(probes) - 1) for i, p in enumerate(probes)):
            return [StageReport(s.endpoint, s.layer_start, s.layer_end, p) for s, p in zip(topology.stages, probes)]
        if time.monotonic() > deadline:
            raise RuntimeError(f"stages did not measure themselves within {timeout_s:g} s")
        await asyncio.sleep(0.25)


async def plan_from_measurements(client, topology: Topology, model: ModelCost, *,
                                 use_all_hosts: bool) -> tuple[Plan, Plan]:
    """A launcher's entry point (a local chain's `--split auto`; Ray's placed chain alike): once
    every stage of the running `topology` has measured itself and its link, (what the running
    split predicts, the measured plan). The plan's `hosts` index `topology.stages`; a launcher
    restarts its stages on `plan.ranges` over those hosts' endpoints when they differ."""
    reports = await measured_reports(client, topology)
    hosts, links = chain_inputs(reports, model)
    current = [(r.layer_start, r.layer_end) for r in reports]
    return predict(model, hosts, links, current), plan_split(model, hosts, links, use_all_hosts=use_all_hosts)
