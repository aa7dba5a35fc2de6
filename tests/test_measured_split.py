"""A chain's stages measure their forward and their link once they are quiet (stage/measure.py),
report it in StageStatus and /v1/stages, and a split is planned from it (launch/measured_split.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest

from chain_support import PROMPTS, run, start_chain
from skippy.driver.chain_backend import ChainBackend
from skippy.driver.split_check import MIN_FORWARDS
from skippy.launch import local_chain
from skippy.launch.local_chain import LocalChain
from skippy.launch.measured_split import StageReport, advisor, chain_inputs, cpu_share_of, model_cost
from skippy.launch.planner import plan_split
from skippy.protocol import ActivationDtype, Topology, TopologyStage
from skippy.protocol.stage_probe import StageProbe
from skippy.stage.measure import CHUNK_ROWS
from skippy.stage.transport import Transport


def topology_of(chain, splits) -> Topology:
    endpoints = [chain.client.return_endpoint, *(s.endpoint for s in chain.servers)]
    return Topology(topology_id="t", model_id="m", stages=[
        TopologyStage(stage_id=f"s{i}", stage_index=i, endpoint=e, layer_start=a, layer_end=b)
        for i, (e, (a, b)) in enumerate(zip(endpoints, splits))])


def test_stages_measure_themselves_and_their_links(make_stage, gguf_path):
    splits = [(0, 10), (10, 20), (20, 30)]

    async def main():
        chain = await start_chain(make_stage, 3, splits=splits, activation_dtype="auto",
                                  stage_options={"activation_dtype": "auto"})
        try:
            measurements = [chain.client.measurement, *(s.measurement for s in chain.servers)]
            await asyncio.wait_for(asyncio.gather(*(m.done.wait() for m in measurements)), 120)
            reports = [await Transport().query_status(s.endpoint) for s in chain.servers]
            probes = [chain.client.measurement.probe, *(r.probe for r in reports)]
            def fixed(probe):  # what a report carries but the clock and the free memory, which move
                return dataclasses.replace(probe, cpu_ns=0, memory_available_bytes=0)

            assert [fixed(r.probe) for r in reports] == [fixed(s.measurement.probe) for s in chain.servers]
            for index, probe in enumerate(probes):
                final = index == 2
                assert 0 < probe.row_ns < probe.chunk_ns and probe.chunk_rows == CHUNK_ROWS
                assert probe.row_cpu_ns > 0 and probe.threads >= 1 and probe.cpu_share_milli >= 1000  # no quota here
                assert probe.cpu_ns > 0
                assert probe.weight_bytes > 0 and probe.memory_available_bytes > 0
                # LinkProbe frames were ACKed by the stage below; the final stage sends nothing down
                assert (probe.link_rtt_ns > 0 and probe.link_bytes_per_s > 0) != final
                # loopback moves f32 in far less than 5% of any frame's compute
                assert (probe.row_dtype, probe.chunk_dtype) == ((-1, -1) if final else (0, 0))

            # a plan from them: every layer placed, a prediction to go with it
            model = model_cost(gguf_path, ctx_size=2048, lane_count=4)
            hosts, links = chain_inputs([StageReport(f"s{i}", a, b, p)
                                         for i, ((a, b), p) in enumerate(zip(splits, probes))], model)
            plan = plan_split(model, hosts, links, use_all_hosts=True)
            assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == 30 and 10 < plan.tok_s < 10_000

            # serving: each stage's decode forward, predicted from its probe, against measured
            backend = ChainBackend(chain.client, topology_of(chain, splits), advise=advisor(model, use_all_hosts=True))
            for _ in range(2):
                await chain.client.generate(PROMPTS[1], max_tokens=MIN_FORWARDS)
            statuses = await backend.status()
            assert [s.probe.row_ns for s in statuses] == [p.row_ns for p in probes]
            assert all(s.probe.cpu_ns > p.cpu_ns for s, p in zip(statuses, probes))  # the clock ran on
            for status in statuses:
                compared = status.predicted_vs_measured
                assert compared is not None and compared["decode_rows"] == 1.0
                assert compared["off_by"] == pytest.approx(
                    compared["measured_decode_forward_ms"] / compared["predicted_decode_forward_ms"] - 1)
            # a stage far off its prediction: the advice is the split its measured time gives
            slow = dataclasses.replace(statuses[2], predicted_vs_measured={**statuses[2].predicted_vs_measured,
                                                                           "off_by": 2.0})
            on_time = [dataclasses.replace(s, predicted_vs_measured={**s.predicted_vs_measured, "off_by": 0.0})
                       for s in statuses]
            assert await backend.split_advice(on_time) is None
            advice = await backend.split_advice([*on_time[:2], slow])
            assert advice["ranges"][-1][1] == 30 and advice["ranges"][-1][0] > 20  # the slow stage does less
        finally:
            await chain.close()

    run(main())


def test_the_codec_picks_each_frames_dtype_from_the_measurements():
    from skippy.model.probe import ForwardTimes
    from skippy.stage.link_probe import LinkTimes
    from skippy.stage.measure import LinkCodec

    codec = LinkCodec("auto", 576)
    assert codec.dtype_for(1) == ActivationDtype.f32  # not measured yet: as chains always sent
    codec.forward, codec.link = ForwardTimes(2e-3, 25e-3, 64), LinkTimes(10e-3, 100e6 / 8)  # 100 Mbit/s
    assert (codec.dtype_for(1), codec.dtype_for(64)) == (ActivationDtype.f16, ActivationDtype.q8)
    odd = LinkCodec("auto", 580)  # no whole q8 blocks
    odd.forward, odd.link = codec.forward, codec.link
    assert odd.dtype_for(64) == ActivationDtype.f16
    assert LinkCodec("q8", 576).dtype_for(1) == ActivationDtype.q8  # a fixed dtype is that dtype
    local = LinkCodec("auto", 576, loopback=True)  # measured slow (a busy machine): still f32
    local.forward, local.link = codec.forward, codec.link
    assert (local.dtype_for(1), local.dtype_for(64)) == (ActivationDtype.f32, ActivationDtype.f32)


def test_a_burst_stalled_by_a_busy_machine_does_not_set_the_links_rate():
    """A stalled end only ever makes a burst slow: the link's rate is its best burst's, so a
    machine busy at start does not make `auto` send narrower rows than the link needs."""
    from skippy.protocol import StageReply
    from skippy.protocol.stream import read_message, write_reply
    from skippy.stage.link_probe import BURST_FRAMES, MAX_FRAME_BYTES, measure_link

    STALL_S = 1.0
    big_frames = 0

    async def downstream(reader, writer):  # ACKs each probe; the first full-size burst stalls
        nonlocal big_frames
        while (msg := await read_message(reader)) is not None:
            if msg.tokens is not None and msg.tokens.nbytes >= MAX_FRAME_BYTES:
                big_frames += 1
                if big_frames == 1:
                    await asyncio.sleep(STALL_S)
            await write_reply(writer, StageReply.ack())
        writer.close()

    async def main():
        server = await asyncio.start_server(downstream, "127.0.0.1", 0)
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, server.sockets[0].getsockname()[:2])
        try:
            return await measure_link(sock, Transport())
        finally:
            sock.close()
            server.close()

    link = asyncio.run(main())
    assert big_frames > BURST_FRAMES  # bursts after the stalled one were timed
    assert link.bytes_per_s > BURST_FRAMES * MAX_FRAME_BYTES / STALL_S * 2  # not the stalled burst's rate


@pytest.mark.slow
def test_split_auto_starts_the_chain_again_on_the_measured_split(gguf_path, monkeypatch):
    """LocalChain(split="auto"), serve --split auto's chain: it measures, plans, and starts again
    on the plan's ranges. Its stages share one machine and measure alike, so the plan is often
    the equal split it started on: the plan is moved here so that the restart happens. f32 on
    loopback (auto's pick) keeps the greedy tokens of any split."""
    planned, before = local_chain.plan_from_measurements, []

    async def moved(client, *args, **kwargs):
        now, plan = await planned(client, *args, **kwargs)
        assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == 30 and len(plan.hosts) == 2  # every host: asked
        before.append((await client.generate(PROMPTS[1], max_tokens=6)).tokens)
        return now, dataclasses.replace(plan, ranges=((0, 7), (7, 30)))

    monkeypatch.setattr(local_chain, "plan_from_measurements", moved)

    async def main():
        chain = LocalChain(gguf_path, 2, threads=1, ctx_size=256, split="auto")
        async with chain as client:
            assert [(s.layer_start, s.layer_end) for s in chain.topology.stages] == [(0, 7), (7, 30)]
            assert chain.first_plan.tok_s > 0 and "predicted" in chain.plan.describe(["a", "b"])
            assert (await client.generate(PROMPTS[1], max_tokens=6)).tokens == before[0]

    run(main())


def test_a_stage_that_cannot_read_its_quota_gets_what_its_forwards_got():
    # bench/split.py's slow host: one thread, a quarter of a core, its cgroup unreadable from
    # inside `ip netns exec` (cpu_share_milli 0): 6.9 ms of CPU in each 28.6 ms forward
    capped = StageProbe(row_ns=28_600_000, row_cpu_ns=6_900_000, threads=1)
    assert cpu_share_of(capped) == pytest.approx(0.241, abs=1e-3)
    free = dataclasses.replace(capped, row_ns=2_450_000, row_cpu_ns=4_250_000, threads=2)  # ~1.7 of 2 threads
    assert cpu_share_of(free) == float("inf")
    assert cpu_share_of(dataclasses.replace(capped, cpu_share_milli=500)) == 0.5  # a quota read is the quota


def test_plan_auto_writes_the_split_a_servers_stages_measured(tmp_path, gguf_path, capsys):
    """`skippy plan --auto --from URL`: a running server's /v1/stages (its schema, as the API
    builds it) to a written plan. Stage 1's host is 4x slower a layer: it gets fewer layers."""
    import http.server
    import json
    import threading

    from skippy.api.schemas import StageInfo, StageList
    from skippy.cli import main as cli

    def probe(row_ms: float, link: bool) -> dict:
        return StageProbe(row_ns=round(row_ms * 1e6), chunk_ns=round(row_ms * 1e7), chunk_rows=CHUNK_ROWS,
                          weight_bytes=50 << 20, memory_available_bytes=8 << 30, row_cpu_ns=round(row_ms * 1e6),
                          threads=1, cpu_share_milli=4000, link_rtt_ns=500_000 if link else 0,
                          link_bytes_per_s=125_000_000 if link else 0).figures()

    listing = StageList(data=[
        StageInfo(id="stage-0", layer_start=0, layer_end=19, endpoint="10.0.0.1:9000", state="ready",
                  active_sessions=0, measured=probe(19 * 0.1, True)),
        StageInfo(id="stage-1", layer_start=19, layer_end=30, endpoint="10.0.0.2:9001", state="ready",
                  active_sessions=0, measured=probe(19 * 0.4, False))]).model_dump_json().encode()

    class Stages(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            assert self.path == "/v1/stages"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(listing)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stages)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert cli(["plan", "--auto", "--all-hosts", "--from", f"http://127.0.0.1:{server.server_port}",
                    "--model", str(gguf_path), "--out", str(tmp_path)]) == 0
    finally:
        server.shutdown()
    printed = capsys.readouterr().out
    assert "predicted" in printed and "tok/s" in printed
    topology = json.loads((tmp_path / "topology.json").read_text())
    ranges = [(s["layer_start"], s["layer_end"]) for s in topology["stages"]]
    assert [s["endpoint"] for s in topology["stages"]] == ["10.0.0.1:9000", "10.0.0.2:9001"]
    assert ranges[0][0] == 0 and ranges[-1][1] == 30 and ranges[0][1] > 19  # the slow host holds fewer


def test_a_failed_link_probe_is_tried_again_and_a_lasting_failure_is_reported_at_once(monkeypatch):
    """Under load one link probe can fail (a reply past its timeout, a reset) where the next passes:
    StageMeasurement tries it again. One that keeps failing is reported (FAILED), and a planner
    waiting for every stage's measurements learns it at once instead of waiting out its timeout."""
    from types import SimpleNamespace

    from skippy.launch.measured_split import measured_reports
    from skippy.model.probe import ForwardTimes
    from skippy.protocol import MessageKind, StageReply
    from skippy.protocol.stage_probe import FAILED
    from skippy.protocol.stream import read_message, write_reply
    from skippy.stage import measure

    monkeypatch.setattr(measure, "QUIET_S", 0.01)
    monkeypatch.setattr(measure, "LINK_RETRY_S", 0.01)
    monkeypatch.setattr(measure, "measure_forward", lambda model, rows: ForwardTimes(2e-3, 25e-3, rows, 2e-3, 1))

    async def measure_against(refusals: int):
        """A measurement whose downstream drops the connection on its first `refusals` LinkProbes."""
        probes_seen = 0

        async def downstream(reader, writer):
            nonlocal probes_seen
            while (msg := await read_message(reader)) is not None:
                if msg.kind == MessageKind.LinkProbe:
                    probes_seen += 1
                    if probes_seen <= refusals:
                        break  # refused: the connection closes under the probe
                await write_reply(writer, StageReply.ack())
            writer.close()

        server = await asyncio.start_server(downstream, "127.0.0.1", 0)
        address = server.sockets[0].getsockname()[:2]

        async def dial(transport, endpoints, wait_s=0):  # the fake speaks no handshake: a plain socket
            sock = socket.socket()
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, address)
            return sock

        monkeypatch.setattr(measure, "dial_downstream", dial)
        runtime = SimpleNamespace(model=SimpleNamespace(args=SimpleNamespace(hidden_size=576), parameter_bytes=1),
                                  sessions={})
        measurement = measure.StageMeasurement(runtime, activation_dtype="auto", downstream="127.0.0.1:1",
                                               transport=Transport())

        async def call(fn):
            return fn()

        try:
            measurement.start(call)
            await asyncio.wait_for(measurement.done.wait(), 60)
        finally:
            await measurement.close()
            server.close()
        return measurement, probes_seen

    async def main():
        once, seen = await measure_against(refusals=1)
        assert not once.failed and once.probe.link_rtt_ns > 0 and once.probe.link_bytes_per_s > 0
        assert seen > 2  # after the refused one, a whole probe: its round trips and bursts
        always, seen = await measure_against(refusals=1000)
        assert always.failed and always.probe.link_rtt_ns == FAILED and always.probe.failed
        assert seen == measure.LINK_TRIES  # each try's first probe was refused
        assert always.probe.row_ns > 0  # the forward it did measure still shows

        # a planner waiting for every stage's measurements hears of it at once
        fine = StageProbe(row_ns=1, chunk_ns=2, chunk_rows=64)
        stages = [TopologyStage(stage_id=f"stage-{i}", stage_index=i, endpoint=f"127.0.0.1:{9000 + i}",
                                layer_start=15 * i, layer_end=15 * i + 15) for i in range(2)]

        async def query_status(endpoint):
            return SimpleNamespace(probe=fine)

        client = SimpleNamespace(measurement=always, transport=SimpleNamespace(query_status=query_status))
        with pytest.raises(RuntimeError, match="stage-0 failed"):
            await asyncio.wait_for(measured_reports(client, Topology(topology_id="t", model_id="m", stages=stages),
                                                    timeout_s=300), 5)

    run(main())
