"""`skippy serve --ray` on a Ray cluster of network-namespace hosts (ray_support.py): a head,
three worker nodes and, for the node-loss test, a spare that joins later; token authentication
on. The server runs on the first worker and places one stage per worker node, over mutual TLS.
A second cluster, a head and a worker without token authentication, is refused, and with
--insecure shows a worker without the model file fetching its stage's layers from stage 0 and
serving. Needs root, iproute2 and Ray (`pip install 'skippy[ray]'`; CI installs it). The
kill-to-next-token median over many kills is bench/ray_recovery.py's; here one kill of each kind."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is optional: pip install 'skippy[ray]' (CI installs it)")

from netns_support import cpu_limited, run_in  # noqa: E402
from ray_support import ServedOnRay, process_in, ray_cluster, skippy_left_on  # noqa: E402
from skippy.model.locate import bundled_model_path  # noqa: E402

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "skippy.cli"]
PROMPT = "The capital of France is"
RECOVERY_TIMEOUT_S = 30
STAGE_PROCESS = "skippy-stage"         # a stage's process name (a standby until handed its stage)
STANDBY = "skippy-standby"             # the next start's process, waiting (launch/warm_stage.py)
STAGE_ACTOR = "ray::StageHost"        # Ray's title for the actor's process


def model_seen_by_one_node(tmp_path_factory) -> Path:
    """A copy of the model in a directory that ray_cluster(hidden_on_workers=) hides from the
    worker nodes' raylets and all they start (actors, stages); `skippy serve`, started in a
    worker's namespace apart from its raylet, sees it: stage 0 holds the model there."""
    model = tmp_path_factory.mktemp("serving-node-only") / bundled_model_path().name
    shutil.copyfile(bundled_model_path(), model)
    return model


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """hosts[0] the head (no CPUs: no stage there), hosts[1..3] workers, hosts[4] the spare; the
    model file where `skippy serve` runs only, each worker node with its own empty skippy cache."""
    model = model_seen_by_one_node(tmp_path_factory)
    with ray_cluster(5, 4, token=secrets.token_hex(16), hidden_on_workers=model.parent,
                     worker_caches=tmp_path_factory.mktemp("worker-caches")) as made:
        made.model = model
        yield made


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    server = ServedOnRay(cluster, cluster.hosts[1], ["--stages", "3", "--threads", "1", "--recovery-timeout",
                                                     str(RECOVERY_TIMEOUT_S), "--model", str(cluster.model)],
                         tmp_path_factory.mktemp("ray") / "serve.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_process_ids() -> list[int]:
    """PROMPT's 12 greedy token ids from `skippy generate` in one process: the reference."""
    done = subprocess.run([*CLI, "generate", "--raw", "--json", "--max-tokens", "12", PROMPT],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["completion_ids"]


def greedy_ids(served: ServedOnRay) -> list[int]:
    """PROMPT's 12 greedy token ids through the served chain."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    asked = run_in(served.host.namespace, sys.executable, "-c", POST, served.url, json.dumps(body),
                   env=served.cluster.env())
    assert asked.returncode == 0, asked.stderr
    return json.loads(asked.stdout)["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def expected(served) -> str:
    """The 120-token story through the chain, uninterrupted (the kills must not change it)."""
    return served.stream()[0]


def test_three_stages_on_three_nodes_answer_as_one_process(served, cluster, one_process_ids):
    print(f"\nserve --ray: API ready {served.ready_s:.1f} s after the command; {served.ready_line.strip()}")
    assert "3 stages ready on Ray in" in served.log()
    stages = served.stages()
    nodes = [stage["node_ip"] for stage in stages]
    assert len(set(nodes)) == 3 and cluster.head.address not in nodes  # one worker node each
    assert nodes[0] == served.host.address  # stage 0 where skippy serve runs
    assert all(stage["endpoint"].startswith(f"{stage['node_ip']}:") and stage["state"] == "ready"
               for stage in stages)
    assert greedy_ids(served) == one_process_ids

    # the links are mutual TLS: a plain TCP peer is refused, and the stage says why
    host, port = stages[1]["endpoint"].rsplit(":", 1)
    run_in(served.host.namespace, sys.executable, "-c", PLAIN_TCP, host, port)
    assert wait_for(lambda: "it does not speak TLS" in served.log(), 10)


def test_a_killed_stage_process_then_a_killed_actor_keep_the_text(served, expected):
    """Each restart hands the stage to the standby its node kept (imports done), which
    outlives the actor that started it; a new standby follows."""
    host = served.host_of(1)
    assert wait_for(lambda: process_in(host, STANDBY), 30)
    standby = process_in(host, STANDBY)
    text, gap = served.stream(lambda: os.kill(process_in(host, STAGE_PROCESS), signal.SIGKILL))
    print(f"\nstage 1's process SIGKILLed mid-stream: stream back {gap:.2f} s after the kill")
    assert text == expected and gap < RECOVERY_TIMEOUT_S
    assert wait_for(lambda: served.stages()[1]["state"] == "ready", 30)
    stage = served.stages()[1]
    assert (stage["restarts"], stage["node_ip"], stage["moves"]) == (1, host.address, 0), stage  # the same node
    assert "its stage process exited with signal SIGKILL" in stage["last_failure"], stage
    # the standby took the stage
    assert process_in(host, STAGE_PROCESS) == standby, (process_in(host, STAGE_PROCESS), standby)
    assert wait_for(lambda: process_in(host, STANDBY) not in (None, standby), 30)  # and another waits

    host = served.host_of(2)
    assert wait_for(lambda: process_in(host, STANDBY), 30)
    actor, stage_pid, standby = (process_in(host, marker) for marker in (STAGE_ACTOR, STAGE_PROCESS, STANDBY))
    text, gap = served.stream(lambda: os.kill(actor, signal.SIGKILL))
    print(f"stage 2's actor SIGKILLed mid-stream: stream back {gap:.2f} s after the kill")
    assert text == expected and gap < RECOVERY_TIMEOUT_S
    # its stage dies with it (PR_SET_PDEATHSIG), no orphan serving; on a loaded machine the
    # kernel may still be tearing the two processes down when the standby answers
    assert wait_for(lambda: not os.path.exists(f"/proc/{stage_pid}"), 10), stage_pid
    # the killed actor's standby, taken by its successor
    assert process_in(host, STAGE_PROCESS) == standby, (process_in(host, STAGE_PROCESS), standby)
    assert wait_for(lambda: served.stages()[2]["state"] == "ready", 30), served.stages()[2]
    stage = served.stages()[2]
    assert stage["restarts"] == 1 and "its Ray actor died" in stage["last_failure"], stage


def test_a_placement_the_cluster_cannot_hold_fails_naming_it(served, cluster):
    done = run_in(served.host.namespace, *CLI, "serve", "--ray", cluster.address, "--stages", "6", "--port", "9400",
                  "--ray-placement-timeout", "3", env=cluster.env())
    assert done.returncode == 2
    assert "Ray could not place the chain's 6 stages within 3 s (STRICT_SPREAD: 6 nodes with {CPU: 1} each" \
        in done.stderr, done.stderr
    assert "waiting for Ray to place 6 stage bundles" in done.stderr  # its progress, while it waited
    left = skippy_left_on(cluster)  # the serving chain's group only: the refused one's is removed
    assert left["groups"] == [left["actors"][0].rsplit("-stage-", 1)[0]]


def test_a_lost_node_moves_its_stage_to_the_spare(served, cluster, expected):
    spare = cluster.hosts[4]
    cluster.start_node(4)
    assert not list(cluster.node_cache(4).glob("models/*/*"))  # nothing fetched there yet
    lost = served.host_of(2)  # the final stage: stage 1 is re-pointed to wherever it lands
    text, gap = served.stream(lambda: cluster.kill_host(lost))
    print(f"\nstage 2's node lost mid-stream (raylet and all): stream back {gap:.2f} s after the loss")
    assert text == expected and gap < RECOVERY_TIMEOUT_S
    stage = served.stages()[2]
    assert (stage["state"], stage["node_ip"], stage["moves"]) == ("ready", spare.address, 1)
    assert stage["endpoint"] == f"{spare.address}:7202"
    # the spare has no model file: it fetched the stage's slice from stage 0 into its own cache
    fetched = [path.name for path in cluster.node_cache(4).glob("models/*/layers-*.gguf")]
    assert fetched == [f"layers-{stage['layer_start']}-{stage['layer_end']}.gguf"]
    assert "stage 1: the next stage is now at" in served.log()  # re-pointed, not restarted
    assert served.stages()[1]["restarts"] == 1
    assert served.stream()[0] == expected  # and the next request goes through the spare


def test_ctrl_c_leaves_no_actor_no_placement_group_no_stage(served, cluster):
    assert skippy_left_on(cluster)["actors"]  # the chain's, while it serves
    assert served.stop(signal.SIGINT) == 0
    assert skippy_left_on(cluster) == {"actors": [], "groups": []}
    assert not any(process_in(host, marker) for host in cluster.hosts for marker in (STAGE_PROCESS, STANDBY))


@pytest.fixture(scope="module")
def open_cluster(tmp_path_factory):
    """A head (1 CPU) and a worker, without token authentication; a copy of the model in a
    directory the worker does not see (its mount namespace hides it); the worker's own, empty
    skippy cache."""
    model = tmp_path_factory.mktemp("head-only") / bundled_model_path().name
    shutil.copyfile(bundled_model_path(), model)
    with ray_cluster(2, 2, token=None, head_cpus=1, hidden_on_workers=model.parent,
                     worker_caches=tmp_path_factory.mktemp("worker-caches")) as made:
        yield made, model


def test_a_cluster_without_token_auth_is_refused_off_loopback(open_cluster):
    unsecured, model = open_cluster
    done = run_in(unsecured.head.namespace, *CLI, "serve", "--ray", unsecured.address, "--stages", "2",
                  "--model", str(model), env=unsecured.env())
    assert done.returncode == 2
    assert "runs without token authentication" in done.stderr and "RAY_AUTH_MODE=token" in done.stderr
    assert skippy_left_on(unsecured) == {"actors": [], "groups": []}  # refused before placing anything


def test_a_measured_split_restarts_the_stages_a_node_fetching_each_slice(open_cluster, one_process_ids, tmp_path):
    """(--insecure: this cluster has no token.) `--split auto` from a lopsided first split
    (--weights 1,4): once both stages measured themselves, the chain starts again on the split
    the measurements give, on the same nodes. The worker has no model file: its stage fetches
    its slice from stage 0 over the chain's link into the node's cache, for each split, and
    the chain answers as one process does."""
    unsecured, model = open_cluster
    worker = unsecured.hosts[1]
    served = ServedOnRay(unsecured, unsecured.head, ["--stages", "2", "--model", str(model), "--insecure",
                                                     "--split", "auto", "--weights", "1,4"],
                         tmp_path / "serve.log", port=9401)
    try:
        print(f"\nserve --ray --split auto, worker fetching its layers: API ready {served.ready_s:.1f} s "
              "after the command")
        assert "without token authentication (--insecure)" in served.log()  # warned, then used
        stage = served.stages()[1]
        assert stage["node_ip"] == worker.address
        assert greedy_ids(served) == one_process_ids
        # the first split, then the measured one: stage 1 fetched a slice for each (their
        # progress, and where each was cached, in the serve log)
        fetches = re.findall(r"stage 1 fetching layers \[(\d+), (\d+)\) from", served.log())
        first, measured = dict.fromkeys(fetches)  # each split's, in order (a line each tenth of the way)
        assert tuple(map(int, measured)) == (stage["layer_start"], stage["layer_end"]) != tuple(map(int, first))
        assert "skippy: measured split (the first split predicted" in served.output
        fetched = {path.name: path for path in unsecured.node_cache(1).glob("models/*/layers-*.gguf")}
        assert set(fetched) == {f"layers-{a}-{b}.gguf" for a, b in (first, measured)}
        current = fetched[f"layers-{stage['layer_start']}-{stage['layer_end']}.gguf"]
        assert current.stat().st_size < model.stat().st_size  # its slice, not the file
        assert wait_for(lambda: f"cached as {current}" in served.log(), 10), served.log()[-3000:]
    finally:
        assert served.stop(signal.SIGINT) == 0
    assert skippy_left_on(unsecured) == {"actors": [], "groups": []}


def test_a_restart_applies_the_split_advice_on_ray(open_cluster, one_process_ids, tmp_path):
    """(--insecure: this cluster has no token.) Under `--split auto`, once the worker's stage
    runs slower than its probe said (a cgroup holds it to a tenth of a core), `/v1/stages`
    advises other ranges; when that stage dies, the restart starts every stage on them (the
    worker fetching its new slice) and the chain answers as one process does."""
    unsecured, model = open_cluster
    worker = unsecured.hosts[1]
    served = ServedOnRay(unsecured, unsecured.head, ["--stages", "2", "--model", str(model), "--insecure",
                                                     "--split", "auto"], tmp_path / "serve.log", port=9402)
    try:
        before = [(s["layer_start"], s["layer_end"]) for s in served.stages()]
        # The stages of the measured split probe themselves at their first quiet moment after
        # the restart that applied it; a probe run under the limit would predict the slow
        # forwards and the stage would never drift.
        assert wait_for(lambda: all(s["measured"]["decode_row_ms"] > 0 for s in served.stages()), 60), served.stages()
        with cpu_limited(0.1) as procs:
            procs.write_text(str(process_in(worker, STAGE_PROCESS)))
            served.stream(max_tokens=48)
            assert wait_for(lambda: (served.get("/v1/stages")["split_advice"] or {}).get("ranges"), 10), \
                [(s["id"], s["predicted_vs_measured"]) for s in served.stages()]
            advised = [tuple(r) for r in served.get("/v1/stages")["split_advice"]["ranges"]]
            time.sleep(1.5)  # the supervisor's next status query holds the slow forwards
            assert advised != before and len(advised) == 2, (advised, before)
            os.kill(process_in(worker, STAGE_PROCESS), signal.SIGKILL)
            assert wait_for(lambda: [(s["layer_start"], s["layer_end"]) for s in served.stages()] == advised
                            and all(s["state"] == "ready" for s in served.stages()), 120), served.log()[-3000:]
        assert greedy_ids(served) == one_process_ids
        line = " ".join(f"[{a}, {b})" for a, b in before) + " -> " + " ".join(f"[{a}, {b})" for a, b in advised)
        assert f"restarting every stage on the advised split: {line}" in served.log()
    finally:
        assert served.stop(signal.SIGINT) == 0
    assert skippy_left_on(unsecured) == {"actors": [], "groups": []}


POST = """
import httpx, json, sys
print(json.dumps(httpx.post(sys.argv[1] + "/v1/completions", json=json.loads(sys.argv[2]), timeout=120).json()))
"""
PLAIN_TCP = """
import socket, sys, time
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as sock:
    sock.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
    time.sleep(0.5)
"""


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False

