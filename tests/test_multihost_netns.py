"""A chain across three hosts, as docs/operations.md tells an operator to run it: three network
namespaces (each one host with its own address on a veth link to a bridge this test makes),
one stage per namespace from a `skippy plan` output with TLS on, `skippy serve --topology` in
the first. Needs root and `ip` (iproute2), as CI has."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from netns_support import namespace_hosts, run_in, start_in
from test_model_identity import renamed_copy

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "skippy.cli"]
PROMPT = "The capital of France is"


@pytest.fixture
def hosts():
    """Three namespaces on one bridge: [(namespace, address)]; removed afterwards."""
    with namespace_hosts(3) as made:
        yield [(host.namespace, host.address) for host in made]


ASK = """
import httpx, json, sys
body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": sys.argv[2], "max_tokens": 12, "temperature": 0,
        "return_token_ids": True}
print(json.dumps(httpx.post(sys.argv[1] + "/v1/completions", json=body, timeout=120).json()))
"""


def test_a_chain_across_three_namespaces_over_tls(hosts, gguf_path, tmp_path):
    (ns0, a0), (ns1, a1), (ns2, a2) = hosts
    plan = tmp_path / "plan"
    out = subprocess.run([*CLI, "plan", "--model", str(gguf_path), "--stages", "3",
                          "--hosts", f"{a0}:7200,{a1}:7200,{a2}:7200", "--out", str(plan)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (plan / "tls" / "ca.pem").is_file()  # off loopback: TLS material written
    stages = []
    try:
        for namespace, index in ((ns2, 2), (ns1, 1)):  # the last stage first, as the page says
            stages.append(start_in(namespace, *CLI, "stage", "--config", str(plan / f"stage-{index}.json"),
                                   "--topology", str(plan / "topology.json"), "--model", str(gguf_path),
                                   "--threads", "1", log_path=tmp_path / f"stage-{index}.log"))
        serve = start_in(ns0, *CLI, "serve", "--topology", str(plan / "topology.json"), "--model", str(gguf_path),
                         "--port", "9337", "--threads", "1", log_path=tmp_path / "serve.log")
        stages.append(serve)
        asked = run_in(ns0, sys.executable, "-c", ASK, "http://127.0.0.1:9337", PROMPT)
        assert asked.returncode == 0, asked.stderr
        answer = json.loads(asked.stdout)["choices"][0]
        one_process = subprocess.run([*CLI, "generate", "--raw", "--json", "--max-tokens", "12", PROMPT],
                                     capture_output=True, text=True, timeout=300)
        assert answer["token_ids"] == json.loads(one_process.stdout)["completion_ids"]
        serve.terminate()  # stage 0's address is free again for the checks below
        serve.wait(timeout=60)

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
        for process in reversed(stages):
            process.terminate()
        for process in stages:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
