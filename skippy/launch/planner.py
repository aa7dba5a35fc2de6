"""The split planner: layer ranges from what each host measured (`skippy plan --auto`,
`skippy serve --split auto`), and the tok/s they predict.

A token visits every stage in turn and comes back to stage 0, so one stream pays

    T = max(sum over stages of (its forward of one row + the hop after it),  slowest stage's busy time)

and decodes at 1 / T. A stage's forward is its layers' time plus, on the last stage, the
output head's (counted as `head_layers` layers: its weight bytes over one block's, which is
what a decode step reads). A hop is half the link's round trip plus the row's bytes over its
rate, in the dtype the link's codec would choose (protocol/activation_codec.py); the last
stage's hop is its token's way back to stage 0.

The second term is a host that cannot keep up its own speed: a CPU quota (a cgroup's
cpu.max) runs a forward at full speed, then stops the process for the rest of its period
once the quota is spent. A stage whose token costs less CPU than its share of the token's
time never meets it; one that costs more is held to a token every (CPU a token) / share.
The probe measures a forward's CPU time and the share (model/probe.py); what a token costs
around its forward (frames, TLS, the event loop: ~2 ms on a quarter core, against a 2.4 ms
forward) only serving shows, so a plan made after serving a while (two reports' CPU clocks
over the tokens between them) sees it, and one made from the start's probe alone does not.
On a host without a quota the second term does not bind.

A host's layer time is affine in the rows of a forward, through the probe's two points (one
row, a prompt chunk), so a batch of 8 decode rows costs what that line says; the aggregate
of 8 streams in one wave is 8 / T at 8 rows.

The plan minimises T within each host's memory. Since the first term only adds up, a faster
host should take every layer it can hold; measurements of equal hosts differ by noise,
though, and a plan that moved 14 layers for 1% would trade a pipeline's balance for nothing.
So among the splits within TIE_SHARE of the least T, the one whose busiest stage at 8 rows
is least busy wins (what 8 streams in flight wait on). Every set of hosts that keeps stage
0's host (it serves the API), in the order given, is planned the same way: when fewer hosts
decode faster (the hops cost more than the others' compute gives), the plan says so and
uses them, unless told to use every host.

Links the chain has not measured (the closing hop back to stage 0; a link between hosts
that were not neighbours) are taken as the mean of the measured ones: the planner assumes
one network. A link whose rate was not measured costs only its latency.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..protocol import ActivationDtype
from ..protocol.activation_codec import auto_dtype

TIE_SHARE = 0.03      # splits whose T is within this share of the best are equally fast
BATCH_ROWS = 8        # the aggregate's streams: one wave of this many rows a forward
MEMORY_SHARE = 0.9    # of the memory a host reports free, what a plan may use


@dataclass(frozen=True, slots=True)
class HostCost:
    """One host, as its stage measured it."""

    name: str
    row_layer_s: float      # one layer's forward of one row, at the host's full speed
    chunk_layer_s: float    # one layer's forward of a prompt chunk of `chunk_rows` rows, likewise
    chunk_rows: int
    memory_bytes: float     # what it may hold: the weights it holds now and MEMORY_SHARE of what is free
    cpu_layer_s: float = 0.0  # the CPU time one layer's forward of one row takes (every thread's)
    cpu_share: float = math.inf  # the cores' worth of CPU time the host gives per second
    token_cpu_s: float = 0.0  # a token's CPU time on the stage beyond its forward (frames, TLS, the loop)

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
            dtype = (ActivationDtype.f32 if not link.bytes_per_s
                     else auto_dtype(rows, self.hidden_size, link.bytes_per_s, compute_s))
        else:
            dtype = ActivationDtype[self.activation_dtype]
        return dtype.nbytes(rows, self.hidden_size)


@dataclass(frozen=True, slots=True)
class Plan:
    hosts: tuple[int, ...]                 # indices into the hosts planned over, in stage order
    ranges: tuple[tuple[int, int], ...]    # each stage's layers [start, end)
    stage_s: tuple[float, ...]             # each stage's forward of one row, at its own speed
    busy_s: tuple[float, ...]              # the same at the rate its host keeps up
    hops_s: float                          # what one row's hops cost a token
    token_s: float                         # one stream's token
    batch_token_s: float                   # a token of BATCH_ROWS streams in one wave
    fewer_hosts: str = ""                  # said when fewer hosts than offered decode faster
    notes: tuple[str, ...] = ()

    @property
    def tok_s(self) -> float:
        return 1 / self.token_s

    @property
    def batch_tok_s(self) -> float:
        return BATCH_ROWS / self.batch_token_s

    def describe(self, names: Sequence[str]) -> str:
        lines = [f"stage {i}: layers [{a}, {b}) on {names[h]}, forward {s * 1e3:.2f} ms"
                 + (f" (its host's CPU share holds it to a token every {busy * 1e3:.2f} ms: the pace)"
                    if busy >= self.token_s * (1 - 1e-9) else "")
                 for i, (h, (a, b), s, busy) in enumerate(zip(self.hosts, self.ranges, self.stage_s, self.busy_s))]
        lines.append(f"hops {self.hops_s * 1e3:.2f} ms a token; predicted {self.tok_s:.1f} tok/s one stream, "
                     f"{self.batch_tok_s:.1f} tok/s at {BATCH_ROWS} streams")
        return "\n".join(lines + ([self.fewer_hosts] if self.fewer_hosts else []) + list(self.notes))


class Links:
    """Measured links by (from host, to host); the mean of them where a pair was not measured."""

    def __init__(self, measured: dict[tuple[int, int], LinkCost]):
        self.measured = measured
        known = list(measured.values())
        rates = [link.bytes_per_s for link in known if link.bytes_per_s]
        self.typical = LinkCost(sum(link.rtt_s for link in known) / len(known) if known else 0.0,
                                len(rates) / sum(1 / r for r in rates) if rates else 0.0)  # a byte's mean time

    def __call__(self, a: int, b: int) -> LinkCost:
        return self.measured.get((a, b)) or self.measured.get((b, a)) or self.typical


class Chain:
    """The costs of one host order: stage i holding k layers, at 1 row and at BATCH_ROWS."""

    def __init__(self, model: ModelCost, order: Sequence[int], hosts: Sequence[HostCost], links: Links):
        self.model, self.order, self.hosts, self.links = model, tuple(order), hosts, links
        n, total = len(order), model.num_layers
        self.limits = []  # the most layers each host can hold beside what its position adds
        for i, h in enumerate(order):
            extra = (model.first_bytes if i == 0 else 0) + (model.last_bytes if i == n - 1 else 0)
            room = hosts[h].memory_bytes - extra
            self.limits.append(min(total, math.floor(room / model.layer_bytes)) if model.layer_bytes else total)
        self.fits = min(self.limits) >= 1 and sum(self.limits) >= total >= n

    def work(self, i: int, k: int) -> float:
        """Stage i's layers with k of them: the head counts as head_layers more on the last."""
        return k + (self.model.head_layers if i == len(self.order) - 1 else 0.0)

    def forward(self, i: int, k: int, rows: int = 1) -> float:
        """Stage i's forward of `rows` rows with k layers, at its host's full speed."""
        return self.work(i, k) * self.hosts[self.order[i]].layer_s(rows)

    def busy(self, i: int, k: int, rows: int = 1) -> float:
        """The time the host's CPU share needs for a token (of each of `rows` streams) on stage i:
        its forward's CPU and what the token costs around it, over the share."""
        host = self.hosts[self.order[i]]
        cpu = self.work(i, k) * host.cpu_layer_s * host.layer_s(rows) / host.layer_s(1)
        return (cpu + rows * host.token_cpu_s) / host.cpu_share

    def hop(self, i: int, k: int, rows: int = 1) -> float:
        """The hop after stage i: its rows down, or the final stage's token back to stage 0."""
        n = len(self.order)
        if n == 1:
            return 0.0  # one process: no hop at all
        if i == n - 1:
            return self.links(self.order[i], self.order[0]).rtt_s / 2
        link = self.links(self.order[i], self.order[i + 1])
        return link.hop_s(self.model.row_bytes(rows, link, self.forward(i, k, rows)))

    def load(self, i: int, k: int, rows: int) -> float:
        """How long stage i holds a wave of `rows` streams: its forward, or its CPU share's time."""
        return max(self.forward(i, k, rows), self.busy(i, k, rows))

    def token_s(self, counts: Sequence[int], rows: int = 1) -> float:
        path = sum(self.forward(i, k, rows) + self.hop(i, k, rows) for i, k in enumerate(counts))
        return max(path, max(self.busy(i, k, rows) for i, k in enumerate(counts)))

    def least_path(self, limits: Sequence[int]) -> list[int] | None:
        """Layer counts (each <= its limit) with the least sum of forwards and hops at one row:
        a dynamic programme over (stage, layers so far), since that sum adds up stage by stage."""
        n, total = len(self.order), self.model.num_layers
        best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
        for i in range(n):
            step: dict[int, tuple[float, list[int]]] = {}
            for used, (cost, counts) in best.items():
                for k in range(1, min(limits[i], total - used) + 1):
                    if i == n - 1 and used + k != total:
                        continue
                    value = cost + self.forward(i, k) + self.hop(i, k)
                    if used + k not in step or value < step[used + k][0]:
                        step[used + k] = (value, counts + [k])
            best = step
        found = best.get(total)
        return None if found is None else found[1]

    def capped(self, cap: Callable[[int, int], bool]) -> list[int]:
        """Per stage, the most layers with `cap(i, k)` true (busy times grow with k)."""
        out = []
        for i, limit in enumerate(self.limits):
            k = 0
            while k < limit and cap(i, k + 1):
                k += 1
            out.append(k)
        return out

    def best(self, batch_cap: float = math.inf) -> list[int] | None:
        """The least T with every stage's load at BATCH_ROWS rows <= batch_cap. T is the
        larger of a path sum, which falls as the cap on the busiest stage rises, and that cap:
        a search for where the two cross."""
        caps = sorted({self.busy(i, k) for i in range(len(self.order)) for k in range(1, self.limits[i] + 1)})

        def under(cap: float) -> list[int] | None:
            return self.least_path(self.capped(lambda i, k: self.busy(i, k) <= cap
                                               and self.load(i, k, BATCH_ROWS) <= batch_cap))

        low, high = 0, len(caps) - 1
        while low < high:  # the least cap whose path sum is within it
            middle = (low + high) // 2
            counts = under(caps[middle])
            if counts is not None and self.token_s(counts) <= caps[middle]:
                high = middle
            else:
                low = middle + 1
        found = [c for c in (under(caps[low]), under(caps[low - 1]) if low else None) if c is not None]
        return min(found, key=self.token_s) if found else None


def plan_over(model: ModelCost, order: Sequence[int], hosts: Sequence[HostCost], links: Links) -> Plan | None:
    """The best split over the hosts `order` (stage order), or None when the model does not
    fit them: the least T, and among splits within TIE_SHARE of it the one whose busiest
    stage at BATCH_ROWS rows (its forward, or its CPU share's time) is least busy."""
    chain = Chain(model, order, hosts, links)
    if not chain.fits or (fastest := chain.best()) is None:
        return None
    bound = chain.token_s(fastest) * (1 + TIE_SHARE)
    caps = sorted({chain.load(i, k, BATCH_ROWS) for i in range(len(order)) for k in range(1, chain.limits[i] + 1)})
    low, high = 0, len(caps) - 1
    while low < high:  # the least cap on the busiest stage at 8 rows that keeps T within the tie
        middle = (low + high) // 2
        counts = chain.best(caps[middle])
        if counts is not None and chain.token_s(counts) <= bound:
            high = middle
        else:
            low = middle + 1
    counts = chain.best(caps[low]) or fastest
    return _plan(chain, counts)


def _plan(chain: Chain, counts: Sequence[int]) -> Plan:
    bounds = list(itertools.accumulate(counts, initial=0))
    forwards = tuple(chain.forward(i, k) for i, k in enumerate(counts))
    return Plan(chain.order, tuple(zip(bounds[:-1], bounds[1:])), forwards,
                tuple(chain.busy(i, k) for i, k in enumerate(counts)),
                sum(chain.hop(i, k) for i, k in enumerate(counts)), chain.token_s(counts),
                chain.token_s(counts, BATCH_ROWS))


def predict(model: ModelCost, hosts: Sequence[HostCost], links: dict[tuple[int, int], LinkCost],
            ranges: Sequence[tuple[int, int]]) -> Plan:
    """What a given split over every host (in order) predicts, e.g. the equal-bytes one."""
    return _plan(Chain(model, range(len(hosts)), hosts, Links(links)), [b - a for a, b in ranges])


def plan_split(model: ModelCost, hosts: Sequence[HostCost], links: dict[tuple[int, int], LinkCost], *,
               use_all_hosts: bool = False) -> Plan:
    """The split of `model` over `hosts` (stage 0's host first) that decodes one stream
    fastest, within each host's memory; over fewer hosts when that is faster, unless
    `use_all_hosts`. ValueError when the model fits no set of them."""
    table = Links(links)
    everyone = plan_over(model, range(len(hosts)), hosts, table)
    candidates = [plan for size in range(1, len(hosts) + 1)
                  for rest in itertools.combinations(range(1, len(hosts)), size - 1)
                  if (plan := plan_over(model, (0, *rest), hosts, table)) is not None]
    if not candidates:
        raise ValueError(f"the model ({model.num_layers} layers) fits in none of the hosts' memory, "
                         f"alone or together")
    best = min(candidates, key=lambda p: (p.token_s, len(p.hosts)))
    if everyone is None:
        return replace(best, notes=(f"the model does not fit all {len(hosts)} hosts' memory in any split "
                                    f"that uses every one of them",))
    if len(best.hosts) < len(hosts) and best.token_s < everyone.token_s:
        names = ", ".join(hosts[h].name for h in best.hosts)
        said = (f"fewer hosts are faster: {len(best.hosts)} of {len(hosts)} ({names}) predict "
                f"{best.tok_s:.1f} tok/s against {everyone.tok_s:.1f} on all {len(hosts)}: the hops cost more "
                f"than the other hosts' compute gives")
        if use_all_hosts:
            return replace(everyone, fewer_hosts=said + " (every host used, as asked)")
        return replace(best, fewer_hosts=said + " (pass --all-hosts to use every host anyway)")
    return everyone
