"""The split planner: layer ranges from what each host measured (`skippy plan --auto`,
`skippy serve --split auto`), and the tok/s they predict.

A token visits every stage in turn and comes back to stage 0, so one stream pays

    T = sum over stages of its forward of one row + every hop (one-way latency + the row's bytes / rate)

and decodes at 1 / T. A stage's forward is its layers' time plus, on the last stage, the
output head's (counted as `head_layers` layers: its weight bytes over one block's, which is
what a decode step reads). A host's layer time is affine in the rows of a forward, through
the probe's two points (one row, a prompt chunk: model/probe.py), so a batch of 8 decode rows
costs what that line says.

The plan minimises T within each host's memory. Since T only adds up, a faster host should
take every layer it can hold; measurements of equal hosts differ by noise, though, and a
plan that moved 14 layers for 1% would trade a pipeline's balance for nothing. So among the
splits within TIE_SHARE of the least T, the one whose slowest stage at 8 rows is fastest
wins (what 8 streams in flight wait on). Every host set that keeps stage 0's host (it serves the API) and the hosts' order is
planned the same way: when fewer hosts decode faster (the hops cost more than the others'
compute gives), the plan says so and uses them, unless told to use every host.

Links the chain has not measured (the closing hop back to stage 0; a link between hosts
that were not neighbours) are taken as the mean of the measured ones: the planner assumes
one network. A link's frames are in the dtype its codec would choose (protocol/
activation_codec.py), and a link never measured costs only its latency.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..protocol import ActivationDtype
from ..protocol.activation_codec import auto_dtype

TIE_SHARE = 0.03      # splits whose T is within this share of the best are equally fast
BATCH_ROWS = 8        # the aggregate's streams: one wave of this many rows a forward
MEMORY_SHARE = 0.9    # of the memory a host reports free, what a plan may use


@dataclass(frozen=True, slots=True)
class HostCost:
    """One host, as its stage measured it."""

    name: str
    row_layer_s: float      # one layer's forward of one row
    chunk_layer_s: float    # one layer's forward of a prompt chunk of `chunk_rows` rows
    chunk_rows: int
    memory_bytes: float     # what it may hold: the weights it holds now and MEMORY_SHARE of what is free

    def layer_s(self, rows: int) -> float:
        """One layer's forward of `rows` rows: affine through the probe's two points."""
        if self.chunk_rows <= 1:
            return self.row_layer_s * rows
        slope = (self.chunk_layer_s - self.row_layer_s) / (self.chunk_rows - 1)
        return self.row_layer_s + (rows - 1) * max(slope, 0.0)


@dataclass(frozen=True, slots=True)
class LinkCost:
    rtt_s: float
    bytes_per_s: float  # 0: not measured (its frames then cost nothing beyond the latency)

    def hop_s(self, nbytes: int) -> float:
        return self.rtt_s / 2 + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)


@dataclass(frozen=True, slots=True)
class ModelCost:
    num_layers: int
    head_layers: float       # the output head's work in layers (ModelArgs.head_cost_in_layers)
    hidden_size: int
    layer_bytes: float       # one layer in memory: its weights and its KV cache at full context
    first_bytes: float       # what stage 0 holds beside its layers (the token embedding)
    last_bytes: float        # what the last stage holds beside its layers (the output head)
    activation_dtype: str = "auto"  # what the links carry: a dtype name, or "auto" (the codec's choice)

    def row_bytes(self, rows: int, link: LinkCost, compute_s: float) -> int:
        if self.activation_dtype == "auto":
            dtype = (ActivationDtype.f16 if not link.bytes_per_s
                     else auto_dtype(rows, self.hidden_size, link.bytes_per_s, compute_s))
        else:
            dtype = ActivationDtype[self.activation_dtype]
        return dtype.nbytes(rows, self.hidden_size)


@dataclass(frozen=True, slots=True)
class Plan:
    hosts: tuple[int, ...]                 # indices into the hosts planned over, in stage order
    ranges: tuple[tuple[int, int], ...]    # each stage's layers [start, end)
    stage_s: tuple[float, ...]             # each stage's forward of one row
    hops_s: float                          # what one row's hops cost a token
    token_s: float                         # one stream's token: stages + hops
    batch_token_s: float                   # a token of BATCH_ROWS streams in one wave
    fewer_hosts: str = ""                  # said when fewer hosts than offered decode faster
    notes: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return 1 / self.token_s

    @property
    def batch_tok_s(self) -> float:
        return BATCH_ROWS / self.batch_token_s

    def describe(self, names: Sequence[str]) -> str:
        lines = [f"stage {i}: layers [{a}, {b}) on {names[h]}, forward {s * 1e3:.2f} ms"
                 for i, (h, (a, b), s) in enumerate(zip(self.hosts, self.ranges, self.stage_s))]
        lines.append(f"hops {self.hops_s * 1e3:.2f} ms a token; predicted {self.tok_s:.1f} tok/s one stream, "
                     f"{self.batch_tok_s:.1f} tok/s at {BATCH_ROWS} streams")
        if self.fewer_hosts:
            lines.append(self.fewer_hosts)
        return "\n".join(lines + self.notes)


def stage_s(model: ModelCost, host: HostCost, layers: int, last: bool, rows: int = 1) -> float:
    """A stage's forward of `rows` rows: its layers, and the head's on the last stage."""
    return (layers + (model.head_layers if last else 0.0)) * host.layer_s(rows)


def stage_bytes(model: ModelCost, layers: int, first: bool, last: bool) -> float:
    return layers * model.layer_bytes + (model.first_bytes if first else 0) + (model.last_bytes if last else 0)


class Links:
    """Measured links by (from host, to host); the mean of them where a pair was not measured."""

    def __init__(self, measured: dict[tuple[int, int], LinkCost]):
        self.measured = measured
        known = list(measured.values())
        self.typical = LinkCost(sum(l.rtt_s for l in known) / len(known) if known else 0.0,
                                _mean_rate(known))

    def __call__(self, a: int, b: int) -> LinkCost:
        return self.measured.get((a, b)) or self.measured.get((b, a)) or self.typical


def _mean_rate(links: list[LinkCost]) -> float:
    rates = [l.bytes_per_s for l in links if l.bytes_per_s]
    return len(rates) / sum(1 / r for r in rates) if rates else 0.0  # a byte's mean time, inverted


def hop_s(model: ModelCost, host: HostCost, layers: int, last: bool, link: LinkCost, rows: int = 1) -> float:
    """The hop after a stage: its rows' way down (their dtype the codec's choice for their
    compute), or from the final stage the token's way back to stage 0 (its latency)."""
    if last:
        return link.rtt_s / 2
    return link.hop_s(model.row_bytes(rows, link, stage_s(model, host, layers, False, rows)))


def _costs(model: ModelCost, order: Sequence[int], hosts: Sequence[HostCost], links: Links, i: int,
           n: int, rows: int) -> float:
    """Stage i of `order` with n layers: its forward of `rows` rows and the hop after it."""
    last, host = i == len(order) - 1, hosts[order[i]]
    if len(order) == 1:
        return stage_s(model, host, n, last, rows)  # one process: no hop at all
    link = links(order[i], order[0] if last else order[i + 1])
    return stage_s(model, host, n, last, rows) + hop_s(model, host, n, last, link, rows)


def plan_over(model: ModelCost, order: Sequence[int], hosts: Sequence[HostCost], links: Links) -> Plan | None:
    """The best split over the hosts `order` (stage order), or None when the model does not
    fit them: the least token time, and among splits within TIE_SHARE of it the one whose
    slowest stage at BATCH_ROWS rows is fastest. A token's time adds up stage by stage (each
    stage's forward and the hop after it), so the least sum is a dynamic programme over
    (stage, layers so far), run again under each cap on the slowest stage."""
    n, total = len(order), model.num_layers
    limits = []
    for i, h in enumerate(order):
        room = hosts[h].memory_bytes - stage_bytes(model, 0, i == 0, i == n - 1)
        limits.append(min(total, math.floor(room / model.layer_bytes)) if model.layer_bytes else total)
    if min(limits) < 1 or sum(limits) < total or total < n:
        return None
    one = [[_costs(model, order, hosts, links, i, k, 1) if k else math.inf for k in range(total + 1)]
           for i in range(n)]
    batch = [[stage_s(model, hosts[order[i]], k, i == n - 1, BATCH_ROWS) for k in range(total + 1)]
             for i in range(n)]

    def least(cap: float) -> tuple[float, list[int]] | None:
        """The least token time with every stage's batch forward <= cap, and its layer counts."""
        best = {0: (0.0, [])}
        for i in range(n):
            step = {}
            for used, (cost, counts) in best.items():
                for k in range(1, limits[i] + 1):
                    if used + k > total or batch[i][k] > cap:
                        break
                    if i == n - 1 and used + k != total:
                        continue
                    value = cost + one[i][k]
                    if used + k not in step or value < step[used + k][0]:
                        step[used + k] = (value, counts + [k])
            best = step
        return best.get(total)

    unbounded = least(math.inf)
    if unbounded is None:
        return None
    bound = unbounded[0] * (1 + TIE_SHARE)
    caps = sorted({batch[i][k] for i in range(n) for k in range(1, limits[i] + 1)})
    low, high = 0, len(caps) - 1  # the smallest cap under which the least time stays within the tie
    while low < high:
        middle = (low + high) // 2
        found = least(caps[middle])
        if found is not None and found[0] <= bound:
            high = middle
        else:
            low = middle + 1
    counts = (least(caps[low]) or unbounded)[1]
    bounds = list(itertools.accumulate(counts, initial=0))
    return _plan(model, order, hosts, links, tuple(zip(bounds[:-1], bounds[1:])))


def _plan(model: ModelCost, order: Sequence[int], hosts: Sequence[HostCost], links: Links,
          ranges: Sequence[tuple[int, int]]) -> Plan:
    n = len(order)
    counts = [b - a for a, b in ranges]
    one = tuple(stage_s(model, hosts[h], k, i == n - 1) for i, (h, k) in enumerate(zip(order, counts)))
    hops = sum(_costs(model, order, hosts, links, i, k, 1) for i, k in enumerate(counts)) - sum(one)
    batch = sum(_costs(model, order, hosts, links, i, k, BATCH_ROWS) for i, k in enumerate(counts))
    return Plan(tuple(order), tuple(ranges), one, hops, sum(one) + hops, batch)


def predict(model: ModelCost, hosts: Sequence[HostCost], links: dict[tuple[int, int], LinkCost],
            ranges: Sequence[tuple[int, int]]) -> Plan:
    """What a given split over every host (in order) predicts, e.g. the equal-bytes one."""
    return _plan(model, list(range(len(hosts))), hosts, Links(links), ranges)


def plan_split(model: ModelCost, hosts: Sequence[HostCost], links: dict[tuple[int, int], LinkCost], *,
               use_all_hosts: bool = False) -> Plan:
    """The split of `model` over `hosts` (stage 0's host first) that decodes one stream
    fastest, within each host's memory; over fewer hosts when that is faster, unless
    `use_all_hosts`. ValueError when the model fits no set of them."""
    table = Links(links)
    everyone = plan_over(model, range(len(hosts)), hosts, table)
    candidates = []
    for size in range(1, len(hosts) + 1):
        for rest in itertools.combinations(range(1, len(hosts)), size - 1):
            plan = plan_over(model, (0, *rest), hosts, table)
            if plan is not None:
                candidates.append(plan)
    if not candidates:
        raise ValueError(f"the model ({model.num_layers} layers) fits in none of the hosts' memory, "
                         f"alone or together")
    best = min(candidates, key=lambda p: (p.token_s, len(p.hosts)))
    if everyone is not None and len(best.hosts) < len(hosts) and best.token_s < everyone.token_s:
        names = ", ".join(hosts[h].name for h in best.hosts)
        said = (f"fewer hosts are faster: {len(best.hosts)} of {len(hosts)} ({names}) predict "
                f"{best.tok_s:.1f} tok/s against {everyone.tok_s:.1f} on all {len(hosts)}: the hops cost more "
                f"than the other hosts' compute gives")
        if use_all_hosts:
            return _with(everyone, fewer_hosts=said + " (every host used, as asked)")
        return _with(best, fewer_hosts=said + " (pass --all-hosts to use every host anyway)")
    if everyone is None:
        return _with(best, notes=[f"the model does not fit all {len(hosts)} hosts' memory in any split "
                                  f"that uses every one of them"])
    return everyone if use_all_hosts or everyone.token_s <= best.token_s else best


def _with(plan: Plan, **changes) -> Plan:
    return replace(plan, **changes)
