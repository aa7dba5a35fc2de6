"""The tensor side channel on loopback (protocol/tensor_frames.py, stage/holder.py, stage/fetch.py):
its frames' bounds, a stage fetching its slice from a holder, the holder's refusals, a cut
link resumed, and a corrupt tensor named. tests/test_multihost_netns.py runs it across hosts
over mutual TLS."""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
import threading

import pytest

from architecture_support import CASES, build_reference, write_gguf
from chain_support import run
from skippy.launch.local_chain import plan_chain
from skippy.model.errors import ModelLoadError
from skippy.model.slice import slice_file_name, verify_slice
from skippy.model.source import DIGESTS_SUFFIX, SourceModel
from skippy.protocol import FrameError, TensorRefused, read_tensor_frame, write_tensor_frame
from skippy.protocol.tensor_frames import (
    MAX_BODY, TENSOR_HEADER, TENSORS_MAGIC, TENSORS_VERSION, Chunk, Done, FetchRequest, Manifest, ManifestRequest,
    Refused, TensorFrameKind, decode_tensor_body, encode_tensor_frame, parse_tensor_header,
)
from skippy.stage import fetch, pace
from skippy.stage.fetch import provide_model
from skippy.stage.holder import TensorHolder
from skippy.stage.returns import ReturnListener
from skippy.stage.transport import LinkBroken, SocketStream, Transport, answers_later

TOKEN = "tensor-channel-token"


def test_frames_round_trip_and_every_length_is_bounded_before_the_body_is_read():
    frames = [ManifestRequest(2, bytes(range(16))), Manifest(1234, b"GGUF header", [bytes(32), b"\x01" * 32]),
              FetchRequest([(3, 0), (7, 4096)]), Chunk(3, 1 << 20, b"abc"), Done(99), Refused("no, because")]
    for frame in frames:
        wire = encode_tensor_frame(frame)
        kind, length = parse_tensor_header(wire[:TENSOR_HEADER.size])
        decoded = decode_tensor_body(kind, wire[TENSOR_HEADER.size:])
        assert TENSOR_HEADER.size + length == len(wire) and bytes(decoded.body()) == frame.body()
    for kind in TensorFrameKind:  # a hostile length: refused on the 20-byte header
        with pytest.raises(FrameError, match="expected at most"):
            parse_tensor_header(TENSOR_HEADER.pack(TENSORS_MAGIC, TENSORS_VERSION, kind, MAX_BODY[kind] + 1))
    with pytest.raises(FrameError, match="kind"):
        parse_tensor_header(TENSOR_HEADER.pack(TENSORS_MAGIC, TENSORS_VERSION, 9, 0))
    with pytest.raises(FrameError, match="Manifest body: expected"):  # counts that disagree with the length
        decode_tensor_body(TensorFrameKind.Manifest, Manifest(1, b"h", [bytes(32)]).body()[:-1])
    with pytest.raises(FrameError, match="FetchRequest body"):
        decode_tensor_body(TensorFrameKind.FetchRequest, FetchRequest([(1, 2)]).body() + b"\0")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    case = CASES["llama3"]  # three layers, an untied head, rope_freqs
    return write_gguf(case, build_reference(case), tmp_path_factory.mktemp("holder") / "model.gguf")


class Holder:
    """Stage 0's return listener with a holder of `model`, and the plan of a 3-stage chain."""

    def __init__(self, model, holder_class=TensorHolder, **listener):
        self.model, self.holder_class, self.listener_options = model, holder_class, listener

    async def __aenter__(self):
        self.topology, self.configs = plan_chain(self.model, ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"],
                                                 auth_token=TOKEN)
        self.holder = self.holder_class(self.model, self.topology, where="stage 0")
        options = {"holder": self.holder, **self.listener_options}
        # no return stream opens in these tests: the listener has no engine's inbox behind it
        self.listener = ReturnListener(None, Transport(auth_token=TOKEN), **options)
        self.endpoint = await self.listener.start()
        return self

    async def __aexit__(self, *exc):
        await self.listener.close()

    def config(self, stage: int, cache):
        """Stage `stage`'s config on a host with no model file: it fetches from this holder."""
        return self.configs[stage].model_copy(update={
            "model_path": str(cache / "no-such-file.gguf"), "model_cache": str(cache),
            "model_sources": [self.endpoint]})


def served(caplog) -> list[int]:
    """Bytes of each fetch the holder logged, finished or broken."""
    return [int(m) for m in re.findall(r"(\d+) bytes \(", caplog.text)]


def test_a_stage_fetches_exactly_its_slice_once_and_then_starts_from_its_cache(model, tmp_path, caplog):
    async def main():
        async with Holder(model) as holder:
            with caplog.at_level(logging.INFO, logger="skippy.holder"):
                config = (await provide_model(holder.config(2, tmp_path), holder.topology)).config
                assert config.model_path == str(tmp_path / slice_file_name(2, 3))
                again = await provide_model(holder.config(2, tmp_path), holder.topology)  # cached: nothing fetched
                await again.checked()
                again = again.config
            return config, again

    config, again = run(main())
    assert again.model_path == config.model_path
    source = SourceModel.open(model)
    share = sum(source.index.tensors[i].n_bytes for i in source.slice_indices(2, 3))
    assert served(caplog) == [share]  # one fetch, of exactly the slice's tensor bytes
    assert "stage 0 served layers [2, 3) to stage-2 at 127.0.0.1:" in caplog.text
    verify_slice(tmp_path / slice_file_name(2, 3), source.fingerprint, 2, 3)


async def ask(endpoint: str, request: ManifestRequest, items=None, token: str = TOKEN):
    """A raw side-channel client: the manifest, then (with `items`) the first chunk."""
    stream = SocketStream((await Transport(auth_token=token).dial(endpoint, tensors=True))[0])
    try:
        await write_tensor_frame(stream, request)
        manifest = await read_tensor_frame(stream, TensorFrameKind.Manifest, timeout=10)
        if items is not None:
            await write_tensor_frame(stream, FetchRequest(items))
            return await read_tensor_frame(stream, TensorFrameKind.Chunk, timeout=10)
        return manifest
    finally:
        stream.close()


def test_the_holder_refuses_tensors_outside_the_askers_range_and_unauthenticated_peers(model, tmp_path, caplog):
    source = SourceModel.open(model)
    fingerprint = bytes.fromhex(source.fingerprint)
    names = [t.name for t in source.index.tensors]
    blk0 = names.index("blk.0.attn_q.weight")

    async def main():
        async with Holder(model) as holder:
            manifest = await ask(holder.endpoint, ManifestRequest(1, fingerprint))
            assert manifest.header == source.header and manifest.digests == source.digests
            own = source.slice_indices(1, 2)[0]
            assert (await ask(holder.endpoint, ManifestRequest(1, fingerprint), [(own, 0)])).tensor_index == own
            with pytest.raises(TensorRefused, match="tensor blk.0.attn_q.weight is outside stage-1's planned layers"):
                await ask(holder.endpoint, ManifestRequest(1, fingerprint), [(own, 0), (blk0, 0)])
            with pytest.raises(TensorRefused, match="no stage 7"):
                await ask(holder.endpoint, ManifestRequest(7, fingerprint))
            with pytest.raises(TensorRefused, match="it asks for model"):
                await ask(holder.endpoint, ManifestRequest(1, bytes(16)))
            with pytest.raises(LinkBroken) as refused:  # the wrong token: closed before READY
                await ask(holder.endpoint, ManifestRequest(1, fingerprint), token="not-the-chain-token")
            assert not answers_later(refused.value)
            wrong_token = holder.config(1, tmp_path).model_copy(update={"auth_token": "not-the-chain-token"})
            with pytest.raises(ModelLoadError, match="cannot fetch its layers: handshake"):
                await provide_model(wrong_token, holder.topology)  # refused at once, not waited on
        async with Holder(model, holder_class=lambda *args, **kw: None) as bare:  # a listener holding nothing
            with pytest.raises(TensorRefused, match="serves no tensors"):
                await ask(bare.endpoint, ManifestRequest(1, fingerprint))

    with caplog.at_level(logging.INFO):
        run(main())
    assert "stage 0 refused a tensor fetch from stage-1 at 127.0.0.1:" in caplog.text
    # the return listener's line for the wrong token
    assert re.search(r"stage 0's return listener: refused connection from .*: AuthError: auth token", caplog.text)


class CuttingHolder(TensorHolder):
    """Its first fetch breaks off after two chunks, as a cut link would."""

    cuts = 1

    async def _stream(self, stream, source, items):
        sent = 0
        async for length in super()._stream(stream, source, items):
            yield length
            sent += 1
            if sent == 2 and CuttingHolder.cuts:
                CuttingHolder.cuts -= 1
                raise ConnectionResetError("the link was cut")


def test_a_cut_transfer_resumes_where_it_stopped(model, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(fetch, "RETRY_S", 0.05)

    async def main():
        async with Holder(model, holder_class=CuttingHolder) as holder:
            with caplog.at_level(logging.INFO, logger="skippy.holder"):
                return (await provide_model(holder.config(1, tmp_path), holder.topology)).config

    config = run(main())
    source = SourceModel.open(model)
    share = sum(source.index.tensors[i].n_bytes for i in source.slice_indices(1, 2))
    verify_slice(tmp_path / slice_file_name(1, 2), source.fingerprint, 1, 2)
    assert config.model_path.endswith(slice_file_name(1, 2))
    first, second = served(caplog)
    assert "broke after" in caplog.text and 0 < first < share
    assert first + second == share  # nothing fetched twice


def test_a_tensor_that_arrives_corrupt_is_refused_naming_it(model, tmp_path):
    copy = tmp_path / "holder" / "model.gguf"
    copy.parent.mkdir()
    copy.write_bytes(model.read_bytes())
    source = SourceModel.open(copy)
    cached = copy.with_name(copy.name + DIGESTS_SUFFIX)
    record = json.loads(cached.read_text())
    victim = source.slice_indices(1, 2)[2]
    record["digests"][victim] = "ab" * 32  # the holder's list says another digest than its bytes give
    cached.write_text(json.dumps(record))

    async def main():
        async with Holder(copy) as holder:
            await provide_model(holder.config(1, tmp_path / "cache"), holder.topology)

    name = source.index.tensors[victim].name
    with pytest.raises(ModelLoadError, match=f"tensor {re.escape(name)} arrived corrupt"):
        run(main())
    assert not (tmp_path / "cache" / slice_file_name(1, 2)).exists()  # nothing partial under the final name


def test_a_fetch_is_paced_a_little_below_what_its_link_delivered(monkeypatch):
    """stage/pace.py on a real socket: a probe, then the kernel paces at HEADROOM of what it saw, then a probe."""
    monkeypatch.setattr(pace, "PROBE_S", 0.1)
    monkeypatch.setattr(pace, "CRUISE_S", 0.1)
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    drain = threading.Thread(target=lambda: [None for _ in iter(lambda: peer.recv(1 << 20), b"")], daemon=True)
    drain.start()

    def max_pacing_rate() -> int:  # tcpi_max_pacing_rate, before tcpi_bytes_acked
        return struct.unpack_from("<Q", client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232), 112)[0]

    paced = pace.Pace(client)
    unlimited = (pace.UNPACED, (1 << 64) - 1)  # the kernel widens a 32-bit ~0 to 64 bits
    assert paced.works and paced.probing and max_pacing_rate() in unlimited
    while paced.probing:
        client.sendall(bytes(1 << 16))
        paced.tick()
    assert paced.rate > 1e6 and max_pacing_rate() == int(pace.HEADROOM * paced.rate)
    while not paced.probing:
        client.sendall(bytes(1 << 16))
        paced.tick()
    assert max_pacing_rate() in unlimited
    client.close()
    drain.join(timeout=10)  # the peer reads to the end
    peer.close()
    server.close()
