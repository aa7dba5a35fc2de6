"""What a stage measured of itself and of its link at start (docs/protocol.md §5.3), reported in
its StageStatus reply beside its metrics: the planner's input (launch/planner.py).

i64 values in a fixed order; times in nanoseconds, sizes in bytes, rates in bytes per
second; 0 = not measured (yet); FAILED (-1) in `row_ns` or `link_rtt_ns`: that measurement
failed and will not come (the stage's log says why). The dtypes are ActivationDtype codes, -1
where the stage sends no rows (the final stage).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

from .constants import ActivationDtype

FAILED = -1  # row_ns or link_rtt_ns: the measurement ended without it


@dataclass(frozen=True, slots=True)
class StageProbe:
    # its own forward on its real kernels, the model's weights in place: one decode row, and a
    # prompt chunk of `chunk_rows` rows (its layers; the head's logits too on the final stage)
    row_ns: int = 0
    chunk_ns: int = 0
    chunk_rows: int = 0
    weight_bytes: int = 0            # the stage's weights in memory
    memory_available_bytes: int = 0  # what more it may use: MemAvailable, within its cgroup's limit
    # probe frames on the lane to its downstream (the chain's own link, TLS and all): an empty
    # frame's round trip, and the rate of a large one's bytes
    link_rtt_ns: int = 0
    link_bytes_per_s: int = 0
    # what it sends downstream: one decode row's dtype, and a prompt chunk's (the codec's
    # choice per frame under --activation-dtype auto; the configured dtype otherwise)
    row_dtype: int = -1
    chunk_dtype: int = -1
    # the CPU the host gives it: the process's CPU time per decode-row forward (all its threads'),
    # the threads that forward ran on, and the cores' worth of CPU time it may use per second
    # (its cores within its cgroup's quota), in thousandths. Under a quota the forwards ran at
    # the quota's pace and row_cpu_ns / threads is one forward's own speed (launch/planner.py)
    row_cpu_ns: int = 0
    threads: int = 0
    cpu_share_milli: int = 0
    # the process's CPU time since it started, when asked: two reports give the CPU a token
    # costs the stage in serving (its forward and everything around it: frames, TLS, the loop)
    cpu_ns: int = 0

    def __post_init__(self) -> None:
        values = self.flat()
        if min(values[1:5] + values[6:7] + values[9:]) < 0 or min(values[0], values[5]) < FAILED:
            raise ValueError(f"stage probe: expected values >= 0, got {values}")
        for name in ("row_dtype", "chunk_dtype"):
            if getattr(self, name) != -1 and getattr(self, name) not in set(ActivationDtype):
                raise ValueError(f"stage probe: {name} must be -1 or an ActivationDtype code, got {getattr(self, name)}")

    def flat(self) -> list[int]:
        return list(astuple(self))

    @classmethod
    def from_flat(cls, values: list[int]) -> StageProbe:
        if len(values) != PROBE_VALUE_COUNT:
            raise ValueError(f"stage probe: expected {PROBE_VALUE_COUNT} values, got {len(values)}")
        return cls(*values)

    def figures(self) -> dict[str, float | str | None]:
        """The measurements in a reader's units (`/v1/stages`)."""
        def dtype(code: int) -> str | None:
            return None if code < 0 else ActivationDtype(code).name

        return {"decode_row_ms": self.row_ns / 1e6, "decode_row_cpu_ms": self.row_cpu_ns / 1e6,
                "threads": self.threads, "cpu_share": self.cpu_share_milli / 1000, "cpu_s": self.cpu_ns / 1e9,
                "prefill_chunk_ms": self.chunk_ns / 1e6,
                "prefill_chunk_rows": self.chunk_rows, "weight_bytes": self.weight_bytes,
                "memory_available_bytes": self.memory_available_bytes,
                "link_rtt_ms": self.link_rtt_ns / 1e6, "link_mbit_s": self.link_bytes_per_s * 8 / 1e6,
                "link_row_dtype": dtype(self.row_dtype), "link_chunk_dtype": dtype(self.chunk_dtype)}

    @classmethod
    def from_figures(cls, figures: dict) -> StageProbe:
        """`figures`' inverse (to the nanosecond and byte): a probe read from `/v1/stages`."""
        def code(name: str | None) -> int:
            return -1 if name is None else int(ActivationDtype[name])

        return cls(row_ns=round(figures["decode_row_ms"] * 1e6), row_cpu_ns=round(figures["decode_row_cpu_ms"] * 1e6),
                   threads=int(figures["threads"]), cpu_share_milli=round(figures["cpu_share"] * 1000),
                   cpu_ns=round(figures["cpu_s"] * 1e9), chunk_ns=round(figures["prefill_chunk_ms"] * 1e6),
                   chunk_rows=int(figures["prefill_chunk_rows"]), weight_bytes=int(figures["weight_bytes"]),
                   memory_available_bytes=int(figures["memory_available_bytes"]),
                   link_rtt_ns=round(figures["link_rtt_ms"] * 1e6),
                   link_bytes_per_s=round(figures["link_mbit_s"] * 1e6 / 8),
                   row_dtype=code(figures["link_row_dtype"]), chunk_dtype=code(figures["link_chunk_dtype"]))

    @property
    def failed(self) -> bool:
        """Its forward or its link probe failed: no plan will get it from this stage."""
        return FAILED in (self.row_ns, self.link_rtt_ns)


PROBE_VALUE_COUNT = len(fields(StageProbe))
