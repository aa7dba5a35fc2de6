"""How long a stream pauses when a stage of `skippy serve --ray` dies under it, and whether it
still says the same: the time from the kill to the stream's next token after its pause.

A Ray cluster of network-namespace hosts (tests/ray_support.py: a head, three worker nodes,
token authentication on, the head's health checks at 500 ms) runs a 3-stage chain over mutual
TLS. Each round streams one greedy completion and, after --kill-at pieces, SIGKILLs a stage's
`skippy stage` process or its Ray actor (stages 1 and 2 in turn); the gap is the time from the
kill to the piece that ends the pause (a piece already past the killed stage may arrive first). Every round's text is compared with an uninterrupted stream's. Last, a
spare node joins and stage 2's whole node is killed (raylet and everything in its namespace):
the stage comes back on the spare. Needs root, iproute2 and Ray (pip install 'skippy[ray]').

The chain runs twice on the same cluster, first with --ray-no-standby (a restart starts Python
afresh), then as by default (a restart hands the stage to its node's warm standby, imports
done: launch/warm_stage.py); each recovery is followed by --settle seconds, in both, so a
standby has started and imported before the next kill (as between failures in practice).

    python bench/ray_recovery.py [--kills 5] [--kill-at 15] [--max-tokens 120] [--settle 8]
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ray_support import ServedOnRay, process_in, ray_cluster  # noqa: E402

KINDS = {"process": "skippy-stage", "actor": "ray::StageHost"}  # what is killed: its name or command line


MODES = {"no standby": ["--ray-no-standby"], "standby": []}  # serve's extra arguments


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5, help="kills of each kind (default 5)")
    parser.add_argument("--kill-at", type=int, default=15, help="streamed pieces before each kill")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--settle", type=float, default=8.0, help="seconds after each recovery before the next kill")
    args = parser.parse_args()

    gaps: dict[tuple[str, str], list[float]] = {(mode, kind): [] for mode in MODES for kind in KINDS}
    same = True
    with ray_cluster(5, 4, token=secrets.token_hex(16)) as cluster, tempfile.TemporaryDirectory() as logs:
        for mode, extra in MODES.items():
            served = ServedOnRay(cluster, cluster.hosts[1], ["--stages", "3", "--threads", "1", "--max-restarts",
                                                             "100", *extra], Path(logs) / f"serve-{len(extra)}.log")
            try:
                print(f"[{mode}] API ready {served.ready_s:.1f} s after `skippy serve --ray`", flush=True)
                expected = served.stream(max_tokens=args.max_tokens)[0]
                time.sleep(args.settle)
                for round_ in range(args.kills):
                    for kind, marker in KINDS.items():
                        index = 1 + (round_ + (kind == "actor")) % 2
                        host = served.host_of(index)
                        text, gap = served.stream(lambda: os.kill(process_in(host, marker), signal.SIGKILL),
                                                  at=args.kill_at, max_tokens=args.max_tokens)
                        same &= text == expected
                        gaps[mode, kind].append(gap)
                        print(f"[{mode}] {kind:8} of stage {index} killed: stream back {gap:5.2f} s later, "
                              f"text {'same' if text == expected else 'DIFFERENT'}", flush=True)
                        wait_ready(served, index)
                        time.sleep(args.settle)
                if mode == "standby":  # the last: the cluster loses a node
                    cluster.start_node(4)
                    lost = served.host_of(2)
                    text, gap = served.stream(lambda: cluster.kill_host(lost), at=args.kill_at,
                                              max_tokens=args.max_tokens)
                    same &= text == expected
                    stage = served.stages()[2]
                    print(f"[{mode}] node of stage 2 lost: stream back {gap:5.2f} s later, on {stage['node_ip']} "
                          f"(spare {cluster.hosts[4].address}), text {'same' if text == expected else 'DIFFERENT'}")
            finally:
                served.stop()
    for (mode, kind), values in gaps.items():
        print(f"[{mode}] {kind} killed: median kill-to-next-token (after the pause) {statistics.median(values):.2f} s "
              f"over {len(values)} (min {min(values):.2f}, max {max(values):.2f})")
    print("every text the same as uninterrupted" if same else "SOME TEXT DIFFERED")
    return 0 if same else 1


def wait_ready(served: ServedOnRay, index: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while served.stages()[index]["state"] != "ready":
        if time.monotonic() > deadline:
            raise RuntimeError(f"stage {index} not ready again within {timeout_s:g} s")
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
