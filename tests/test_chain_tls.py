"""A chain off loopback: `skippy plan` writes a chain token and TLS certificates, every link
runs over mutual TLS, and a stage refuses to listen off loopback without them."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import signal
import ssl
import subprocess
import sys
import time

import httpx
import pytest

from frontend_support import ServeProcess
from skippy.launch.local_chain import free_ports
from skippy.protocol import StageConfig, TlsConfig
from skippy.stage import certificates, tls
from skippy.stage.transport import LinkBroken, Transport
from test_standby_stages import start_stage

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


def local_address() -> str:
    """This machine's own non-loopback IPv4 address (the one its default route uses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.254", 9))  # no packet is sent: this only picks the route
        address = probe.getsockname()[0]
    assert not address.startswith("127."), "the test needs a non-loopback IPv4 address on this machine"
    return address


def test_a_chain_off_loopback_runs_over_mutual_tls(tmp_path):
    host = local_address()
    endpoints = [f"{host}:{port}" for port in free_ports(2, host)]
    plan = subprocess.run([sys.executable, "-m", "skippy.cli", "plan", "--stages", "2", "--hosts", ",".join(endpoints),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    stage1 = StageConfig.load(tmp_path / "stage-1.json")
    assert stage1.auth_token and stage1.tls is not None  # generated: nobody passed them
    assert (tmp_path / "tls" / "stage-1.key").stat().st_mode & 0o077 == 0  # owner-only
    assert (tmp_path / "stage-1.json").stat().st_mode & 0o077 == 0
    process = start_stage(tmp_path / "stage-1.json", tmp_path / "topology.json", tmp_path / "stage-1.log")
    server = None
    try:
        server = ServeProcess(["--topology", str(tmp_path / "topology.json"), "--threads", "1"],
                              tmp_path / "serve.log")  # token and TLS from the plan's stage-0.json
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                "return_token_ids": True}
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        one_process = subprocess.run([sys.executable, "-m", "skippy.cli", "generate", "--raw", "--json",
                                      "--max-tokens", "12", PROMPT], capture_output=True, text=True, timeout=300)
        assert answer["token_ids"] == json.loads(one_process.stdout)["completion_ids"]
        assert httpx.get(server.url + "/readyz").status_code == 200  # status queries pass TLS too
        # the final stage's direct return to stage 0 passed TLS as well (else it relays, with a warning)
        assert "direct prediction return unavailable" not in (tmp_path / "stage-1.log").read_text()

        async def probes() -> None:
            stage_endpoint = endpoints[1]
            right = stage1.tls.resolved(tmp_path)
            assert await Transport(tls_identity=right, auth_token=stage1.auth_token).query_status(stage_endpoint)
            # plain TCP to a TLS listener: refused
            assert await Transport(auth_token=stage1.auth_token).query_status(stage_endpoint) is None
            other = certificates.issue_certificates(tmp_path / "other" / "tls", {"stranger": host})["stranger"]
            stranger = Transport(tls_identity=other.resolved(tmp_path / "other"), auth_token=stage1.auth_token)
            with pytest.raises(LinkBroken, match="certificate"):  # a certificate from another CA: refused
                await stranger.dial(stage_endpoint)
            # the right CA, the wrong token: refused by the token check inside TLS
            assert await Transport(tls_identity=right, auth_token="not-the-chain-token").query_status(
                stage_endpoint) is None
            assert await Transport(tls_identity=right, auth_token=stage1.auth_token).query_status(
                stage_endpoint) is not None  # still serving

        asyncio.run(probes())
        # the stage said whom it refused and why, once each, without a traceback
        log = (tmp_path / "stage-1.log").read_text()
        refused = [line for line in log.splitlines() if "TLS handshake from" in line]
        assert len(refused) == 2, log
        assert "level=WARNING" in refused[0] and f"stage 1: TLS handshake from {host}:" in refused[0]
        assert "does not speak TLS" in refused[0] and "another chain's CA" in refused[1], refused
        assert "Traceback" not in log
    finally:
        if server is not None:
            server.stop()
        process.terminate()
        process.wait(timeout=30)


def test_a_stage_refuses_to_listen_off_loopback_without_token_and_tls(tmp_path):
    config = StageConfig(stage_id="stage-1", stage_index=1, layer_start=19, layer_end=30, model_path="unused.gguf",
                         bind_addr=f"0.0.0.0:{free_ports(1)[0]}")
    config.save(tmp_path / "stage-1.json")
    run = subprocess.run([sys.executable, "-m", "skippy.cli", "stage", "--config", str(tmp_path / "stage-1.json")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "without an auth token and TLS" in run.stderr and "Fix:" in run.stderr and "--insecure" in run.stderr
    with pytest.raises(ValueError, match="without TLS"):  # a token alone is not enough
        tls.check_exposure("stage 1", "0.0.0.0", auth_token="token", tls=None, insecure=False)
    tls.check_exposure("stage 1", "0.0.0.0", auth_token="token", tls=TlsConfig(ca_file="a", cert_file="b",
                                                                               key_file="c"), insecure=False)
    tls.check_exposure("stage 1", "127.0.0.1", auth_token=None, tls=None, insecure=False)  # loopback: fine


def test_insecure_listens_off_loopback_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="skippy.stage"):
        tls.check_exposure("stage 1", "0.0.0.0", auth_token=None, tls=None, insecure=True)
    assert "--insecure" in caplog.text and "open to the network" in caplog.text


def test_a_listener_logs_each_refused_tls_handshake_once_and_keeps_serving(tmp_path, caplog, monkeypatch):
    """Every way a dialer fails TLS gets one WARNING naming its address and why; a repeat
    within a minute is counted, not logged; good dialers are served throughout."""
    host = local_address()
    right = certificates.issue_certificates(tmp_path / "a" / "tls", {"stage": host, "peer": host})
    stranger = certificates.issue_certificates(tmp_path / "b" / "tls", {"stranger": host})["stranger"].resolved(tmp_path / "b")

    async def dial(port: int, context: ssl.SSLContext | None, data: bytes = b"") -> bool:
        """Whether the listener answered READY over this TLS context (None: plain TCP)."""
        try:
            reader, writer = await asyncio.open_connection(host, port, ssl=context)
            writer.write(data)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(8), 10)
            writer.close()
            return len(answer) == 8
        except (ssl.SSLError, ConnectionError):
            return False

    async def main() -> None:
        accepted = []

        async def keep(sock, peer) -> None:
            accepted.append(sock)

        listener = await Transport(tls_identity=right["stage"].resolved(tmp_path / "a")).listen(
            host, 0, keep, where="stage 1")
        port = listener.port
        good = tls.context(right["peer"].resolved(tmp_path / "a"), host, server=False)
        other_ca = tls.context(stranger, host, server=False)  # trusts another CA only: hangs up on the stage
        other_cert = ssl.create_default_context(cafile=str(tmp_path / "a" / "tls" / "ca.pem"))
        other_cert.load_cert_chain(stranger.cert_file, stranger.key_file)  # trusts the stage, is not trusted
        no_cert = ssl.create_default_context(cafile=str(tmp_path / "a" / "tls" / "ca.pem"))
        try:
            assert await dial(port, good)
            assert not await dial(port, other_ca)
            for _ in range(3):
                assert not await dial(port, other_cert)
            assert not await dial(port, no_cert)
            assert not await dial(port, None, b"plain TCP, no TLS at all" * 4)
            assert await dial(port, good)  # still serving
            monkeypatch.setattr(tls, "REFUSAL_LOG_EVERY_S", 0.0)
            assert not await dial(port, other_cert)
            await asyncio.sleep(0.2)  # the listener's side of the last refusal
            assert len(accepted) == 2
        finally:
            await listener.close()
            for sock in accepted:
                sock.close()

    with caplog.at_level(logging.WARNING, logger="skippy.stage"):
        asyncio.run(main())
    lines = [record for record in caplog.records if "TLS handshake from" in record.getMessage()]
    messages = [record.getMessage() for record in lines]
    assert all(record.levelno == logging.WARNING and record.exc_info is None for record in lines)
    assert all(message.startswith(f"stage 1: TLS handshake from {host}:") for message in messages), messages
    assert len(messages) == 5, messages  # the 2nd and 3rd of the same refusal: counted only
    assert "another CA" in messages[0] and "hung up" in messages[0]
    assert "not from this chain's CA (CERTIFICATE_VERIFY_FAILED" in messages[1]
    assert "sent no client certificate" in messages[2]
    assert "does not speak TLS (plain TCP?) (WRONG_VERSION_NUMBER)" in messages[3]
    assert "not from this chain's CA" in messages[4] and "(2 more like it from" in messages[4]


def test_a_request_survives_a_killed_stage_over_tls(tmp_path):
    """The recovery of a chain off loopback, every link mutual TLS: the final stage SIGKILLed
    mid-stream and started again on its port; the stream pauses, replays itself onto the whole
    chain, and its text is the uninterrupted run's."""
    from test_serve_recovery import complete
    from test_standby_stages import stream_while

    host = local_address()
    endpoints = [f"{host}:{port}" for port in free_ports(3, host)]
    plan = subprocess.run([sys.executable, "-m", "skippy.cli", "plan", "--stages", "3", "--hosts", ",".join(endpoints),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    topology = tmp_path / "topology.json"
    stages = {i: start_stage(tmp_path / f"stage-{i}.json", topology, tmp_path / f"stage-{i}.log") for i in (1, 2)}
    server = None
    try:
        server = ServeProcess(["--topology", str(topology), "--threads", "1"], tmp_path / "serve.log")
        prompt = "Story: once upon a time, in a village by the sea,"
        started = time.perf_counter()
        expected = complete(server.url, prompt, max_tokens=160)
        took = time.perf_counter() - started

        def kill_and_restart() -> None:
            stages[2].send_signal(signal.SIGKILL)
            stages[2].wait(30)
            stages[2] = start_stage(tmp_path / "stage-2.json", topology, tmp_path / "stage-2b.log")

        assert stream_while(server.url, prompt, kill_and_restart, took / 3) == expected
        log = (tmp_path / "serve.log").read_text()
        assert "resumed on a fresh lane" in log and "TLS handshake" not in log  # recovered, over TLS
        assert "direct prediction return unavailable" not in (tmp_path / "stage-2b.log").read_text()
    finally:
        if server is not None:
            server.stop()
        for process in stages.values():
            process.terminate()
            process.wait(timeout=30)
