"""A chain across three hosts, as docs/operations.md tells an operator to run it: three network
namespaces (each one host with its own address on a veth link to a bridge this test makes),
one stage per namespace from a `skippy plan` output with TLS on, `skippy serve --topology` in
the first, holding the only copy of the model: hosts b and c start with no model file and an
empty cache, and each fetches its own layers from stage 0 (stage/fetch.py, stage/holder.py).
Needs root, `ip` and `tc` (iproute2), as CI has."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from netns_support import cap_bandwidth, namespace_hosts, run_in, spawn_in, start_in, wait_ready
from skippy.model.gguf_file import GGUFIndex
from skippy.model.slice import slice_file_name
from skippy.model.source import SourceModel
from test_model_identity import renamed_copy

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "skippy.cli"]
PROMPT = "The capital of France is"
CAP_MBPS = 50  # stage 0's sends while stage 2 fetches, so the kill lands halfway through


@pytest.fixture
def hosts():
    """Three namespaces on one bridge; removed afterwards."""
    with namespace_hosts(3) as made:
        yield made


ASK = """
import httpx, json, sys
body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": sys.argv[2], "max_tokens": 12, "temperature": 0,
        "return_token_ids": True}
print(json.dumps(httpx.post(sys.argv[1] + "/v1/completions", json=body, timeout=120).json()))
"""

# On host b, with stage 1's certificate and token: tensors of another stage's layers, the
# layers of another stage than its certificate names, the wrong token; then its own tensor.
HOLDER_CHECKS = """
import asyncio, sys
from pathlib import Path
from skippy.model.gguf_file import GGUFIndex
from skippy.protocol import StageConfig, Topology, TensorRefused, read_tensor_frame, write_tensor_frame
from skippy.protocol.tensor_frames import FetchRequest, ManifestRequest, TensorFrameKind
from skippy.stage.transport import LinkBroken, SocketStream, Transport

plan = Path(sys.argv[1])
config, topology = StageConfig.load(plan / "stage-1.json"), Topology.load(plan / "topology.json")
identity = config.tls.resolved(plan)

async def ask(stage, name, token=config.auth_token):
    try:
        sock, _ = await Transport(tls_identity=identity, auth_token=token).dial(topology.driver_endpoint, tensors=True)
        stream = SocketStream(sock)
        await write_tensor_frame(stream, ManifestRequest(stage, bytes.fromhex(topology.model_fingerprint)))
        manifest = await read_tensor_frame(stream, TensorFrameKind.Manifest, timeout=60)
        names = [t.name for t in GGUFIndex.parse(manifest.header, keep=lambda key: False).tensors]
        await write_tensor_frame(stream, FetchRequest([(names.index(name), 0)]))
        chunk = await read_tensor_frame(stream, TensorFrameKind.Chunk, timeout=60)
        stream.close()
        return f"served {len(chunk.data)} bytes"
    except (TensorRefused, LinkBroken) as error:
        return f"{type(error).__name__}: {error}"

async def main():
    own = f"blk.{topology.stages[1].layer_start}.attn_q.weight"
    token = config.auth_token
    for stage, name, token in ((1, "blk.0.attn_q.weight", token), (2, "output_norm.weight", token),
                               (1, own, "not-the-chain-token"), (1, own, token)):
        print(await ask(stage, name, token))

asyncio.run(main())
"""


def progress(log_path) -> float:
    """How far a fetching stage's progress lines say it got (0 before the first)."""
    found = re.findall(r"([\d.]+) of ([\d.]+) MiB", log_path.read_text())
    return max((float(done) / float(total) for done, total in found), default=0.0)


def test_a_chain_across_three_namespaces_over_tls(hosts, gguf_path, tmp_path):
    (ns0, a0), (ns1, a1), (ns2, a2) = ((host.namespace, host.address) for host in hosts)
    plan = tmp_path / "plan"
    out = subprocess.run([*CLI, "plan", "--model", str(gguf_path), "--stages", "3",
                          "--hosts", f"{a0}:7200,{a1}:7200,{a2}:7200", "--out", str(plan)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (plan / "tls" / "ca.pem").is_file()  # off loopback: TLS material written
    for index in (1, 2):  # hosts b and c have no model file: the plan's path names none there
        config = json.loads((plan / f"stage-{index}.json").read_text())
        (plan / f"stage-{index}.json").write_text(json.dumps({**config, "model_path": f"/host-{index}/none.gguf"}))
    caches = {index: tmp_path / f"cache-{index}" for index in (1, 2)}  # empty
    stage_command = lambda index: [*CLI, "stage", "--config", str(plan / f"stage-{index}.json"),  # noqa: E731
                                   "--topology", str(plan / "topology.json"), "--model-cache", str(caches[index]),
                                   "--threads", "1"]
    processes = []
    try:
        # stage 0 first: it holds the model, serves the others their layers and waits for them
        serve = spawn_in(ns0, *CLI, "serve", "--topology", str(plan / "topology.json"), "--model", str(gguf_path),
                         "--port", "9337", "--threads", "1", log_path=tmp_path / "serve.log")
        processes.append(serve)
        cap_bandwidth(hosts[0], CAP_MBPS)
        fetching = spawn_in(ns2, *stage_command(2), log_path=tmp_path / "stage-2-killed.log")
        processes.append(fetching)
        deadline = time.monotonic() + 120
        while progress(tmp_path / "stage-2-killed.log") < 0.3:
            assert fetching.poll() is None and time.monotonic() < deadline, (tmp_path / "stage-2-killed.log").read_text()
            time.sleep(0.05)
        fetching.send_signal(signal.SIGKILL)  # halfway through its transfer
        fetching.wait(timeout=30)
        assert progress(tmp_path / "stage-2-killed.log") < 0.9
        assert not (caches[2] / slice_file_name(*stage_range(plan, 2))).exists()  # nothing partial under its name
        processes.append(start_in(ns2, *stage_command(2), log_path=tmp_path / "stage-2.log"))  # it resumes
        cap_bandwidth(hosts[0], None)
        processes.append(start_in(ns1, *stage_command(1), log_path=tmp_path / "stage-1.log"))
        wait_ready(serve, tmp_path / "serve.log")
        resumed = (tmp_path / "stage-2.log").read_text()
        assert "kept from an earlier try" in resumed, resumed

        asked = run_in(ns0, sys.executable, "-c", ASK, "http://127.0.0.1:9337", PROMPT)
        assert asked.returncode == 0, asked.stderr
        answer = json.loads(asked.stdout)["choices"][0]
        one_process = subprocess.run([*CLI, "generate", "--raw", "--json", "--max-tokens", "12", PROMPT],
                                     capture_output=True, text=True, timeout=300)
        assert answer["token_ids"] == json.loads(one_process.stdout)["completion_ids"]

        # each host holds its share of the tensor bytes and the metadata, and fetched it about once
        source = SourceModel.open(gguf_path)
        holder_log = (tmp_path / "serve.log").read_text()
        for index in (1, 2):
            share = sum(source.index.tensors[i].n_bytes for i in source.slice_indices(*stage_range(plan, index)))
            cached = sum(file.stat().st_size for file in caches[index].rglob("*") if file.is_file())
            metadata = slice_index(caches[index] / slice_file_name(*stage_range(plan, index))).data_start
            fetched = sum(int(n) for pattern in (rf"to stage-{index} at \S+ \d+ tensors, (\d+) bytes",
                                                 rf"fetch by stage-{index} at \S+ broke after (\d+) bytes")
                          for n in re.findall(pattern, holder_log))
            print(f"host {'abc'[index]}: cache {cached} bytes = {(cached - metadata) / share:.4f} x its share "
                  f"({share} tensor bytes) + {metadata} of metadata; fetched {fetched} = {fetched / share:.3f} x")
            assert cached <= 1.02 * share + metadata
            assert share <= fetched <= (1.1 if index == 2 else 1.0) * share, holder_log
        assert "broke after" in holder_log  # the killed fetch, on the holder's side

        # the holder refuses another stage's tensors, a certificate naming another stage, a wrong token
        checks = run_in(ns1, sys.executable, "-c", HOLDER_CHECKS, str(plan))
        assert checks.returncode == 0, checks.stderr
        outside, impostor, unauthenticated, own = checks.stdout.strip().splitlines()
        assert "TensorRefused" in outside and "blk.0.attn_q.weight is outside stage-1's planned layers" in outside
        assert "TensorRefused" in impostor and "certificate names stage-1" in impostor
        assert "LinkBroken" in unauthenticated and "refuse our auth token" in unauthenticated
        assert own.startswith("served ")
        serve.terminate()  # stage 0's address is free again for the checks below
        serve.wait(timeout=60)

        # a flipped byte in stage 2's cached slice: it refuses to start, naming the tensor
        processes[2].terminate()
        processes[2].wait(timeout=60)
        cached_slice = caches[2] / slice_file_name(*stage_range(plan, 2))
        index = slice_index(cached_slice)
        victim = index.tensors[len(index.tensors) // 2]
        at = index.data_start + victim.offset + victim.n_bytes // 2
        data = bytearray(cached_slice.read_bytes())
        data[at] ^= 0x10
        cached_slice.write_bytes(data)
        corrupt = run_in(ns2, *stage_command(2))
        assert corrupt.returncode == 2 and f"tensor {victim.name} does not match its digest" in corrupt.stderr, \
            corrupt.stderr

        # a wrong token: refused, and the error says so
        wrong = run_in(ns0, *CLI, "generate", "--topology", str(plan / "topology.json"), "--model", str(gguf_path),
                       "--auth-token", "not-the-chain-token", "--raw", "--max-tokens", "2", PROMPT)
        assert wrong.returncode == 2 and "auth token" in wrong.stderr, wrong.stderr
        # a certificate from another CA: stage 0's TLS from another plan
        other = tmp_path / "other"
        subprocess.run([*CLI, "plan", "--model", str(gguf_path), "--stages", "3", "--hosts",
                        f"{a0}:7300,{a1}:7300,{a2}:7300", "--out", str(other)], check=True, capture_output=True)
        stranger = tmp_path / "stranger"
        stranger.mkdir()
        shutil.copy(plan / "topology.json", stranger)
        shutil.copytree(other / "tls", stranger / "tls")
        config = json.loads((plan / "stage-0.json").read_text())  # the right token, the wrong CA
        (stranger / "stage-0.json").write_text(json.dumps(config))
        refused = run_in(ns0, *CLI, "generate", "--topology", str(stranger / "topology.json"), "--model",
                         str(gguf_path), "--raw", "--max-tokens", "2", PROMPT)
        assert refused.returncode == 2 and "certificate verify failed" in refused.stderr, refused.stderr
        # a different model file on a stage's host
        different = renamed_copy(gguf_path, tmp_path / "different.gguf")
        mismatch = run_in(ns1, *CLI, "stage", "--config", str(plan / "stage-1.json"), "--model", str(different))
        assert mismatch.returncode == 2 and "fingerprint" in mismatch.stderr
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def stage_range(plan, index: int) -> tuple[int, int]:
    config = json.loads((plan / f"stage-{index}.json").read_text())
    return config["layer_start"], config["layer_end"]


def slice_index(path) -> GGUFIndex:
    with open(path, "rb") as handle:
        return GGUFIndex.parse(handle.read(16 << 20), str(path), keep=lambda key: False)  # the header's far shorter
