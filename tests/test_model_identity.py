"""Model identity: a plan carries the model's fingerprint, a host points a stage at its own copy
(`skippy stage --model PATH`), and a stage whose file is not the planned one refuses to start."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from skippy.launch.local_chain import free_ports
from skippy.model.fingerprint import model_fingerprint
from skippy.model.gguf_loader import open_gguf
from skippy.protocol import StageConfig, Topology
from test_standby_stages import start_stage

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "skippy.cli"]


def renamed_copy(gguf_path, out):
    """The same weights under another `general.name`: a different file, header-wise."""
    shutil.copyfile(gguf_path, out)
    name = open_gguf(gguf_path).fields["general.name"].encode()
    data = bytearray(out.read_bytes()[: 1 << 20])
    at = data.index(name)
    with open(out, "r+b") as handle:
        handle.seek(at)
        handle.write(bytes([name[0] ^ 0x20]) + name[1:])  # same length: the layout is unchanged
    return out


def test_a_stage_runs_on_its_own_copy_and_refuses_another_model(gguf_path, tmp_path):
    endpoints = [f"127.0.0.1:{port}" for port in free_ports(2)]
    plan = subprocess.run([*CLI, "plan", "--stages", "2", "--hosts", ",".join(endpoints), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    expected = model_fingerprint(gguf_path)
    assert Topology.load(tmp_path / "topology.json").model_fingerprint == expected
    assert StageConfig.load(tmp_path / "stage-1.json").model_fingerprint == expected
    assert len(expected) == 32 and model_fingerprint(gguf_path) == expected  # stable

    other = renamed_copy(gguf_path, tmp_path / "other.gguf")
    assert model_fingerprint(other) != expected
    refused = subprocess.run([*CLI, "stage", "--config", str(tmp_path / "stage-1.json"), "--model", str(other)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert expected in refused.stderr and model_fingerprint(other) in refused.stderr and "Fix:" in refused.stderr
    served = subprocess.run([*CLI, "generate", "--topology", str(tmp_path / "topology.json"), "--model", str(other),
                             "hi"], capture_output=True, text=True, timeout=120)
    assert served.returncode == 2 and "stage 0" in served.stderr and expected in served.stderr

    copy = tmp_path / "elsewhere" / "model.gguf"  # this host keeps the same file at another path
    copy.parent.mkdir()
    shutil.copyfile(gguf_path, copy)
    stage = start_stage(tmp_path / "stage-1.json", tmp_path / "topology.json", tmp_path / "stage-1.log",
                        extra=["--model", str(copy)])
    try:
        run = subprocess.run([*CLI, "generate", "--topology", str(tmp_path / "topology.json"), "--model", str(copy),
                              "--raw", "--max-tokens", "4", "The capital of France is"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and run.stdout.strip(), run.stderr
    finally:
        stage.terminate()
        stage.wait(timeout=30)
