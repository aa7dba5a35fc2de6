"""A holder of the model file serves stages that have none their tensors (docs/protocol.md §11).

Any process that loaded the planned GGUF answers the tensor side channel on its own port
(past the token and TLS checks): the file's header and digests, then exactly the tensors of
the asking stage's planned layers; any other request, or a certificate naming another
stage, is refused. The holder keeps decoding while it serves: reads run on their own thread
at nice 19, and the kernel paces the socket a little below the link (pace.py), so its own
frames find no queue of tensors ahead of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..model.source import SourceModel
from ..model.threads import lower_priority
from ..protocol import ProtocolError, Topology, TopologyStage, read_tensor_frame, write_tensor_frame
from ..protocol.tensor_frames import (
    Done, FetchRequest, Manifest, ManifestRequest, Refused, TensorFrameKind, chunk_prefix,
)
from .pace import Pace
from .transport import SocketStream

log = logging.getLogger("skippy.holder")
log.setLevel(logging.INFO)  # a fetch is rare and an operator wants its line without --log-level INFO
CHUNK_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 30.0      # the dialer's first frame must come within this
FETCH_REQUEST_TIMEOUT_S = 600.0   # it checks what it kept from an earlier try before asking (hashing)
MIB = 1 << 20


class Refusal(Exception):
    """A request this holder will not serve; the reason goes to the dialer and the log."""


class TensorHolder:
    def __init__(self, model_path: str | Path, topology: Topology, *, where: str):
        """`where` names this process in log lines ("stage 0"). Nothing is read until a stage asks."""
        self.model_path, self.topology, self.where = Path(model_path), topology, where
        self._pool: ThreadPoolExecutor | None = None
        self._source: asyncio.Future | None = None

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="skippy-holder", initializer=lower_priority)
        return self._pool

    async def source(self) -> SourceModel:
        """The file's header and digests: read (and digested, the first time ever) once."""
        if self._source is None:
            self._source = asyncio.get_running_loop().run_in_executor(self.pool, self._open_source)
        return await asyncio.shield(self._source)

    def _open_source(self) -> SourceModel:
        if not self.model_path.is_file():
            raise Refusal(f"{self.where} holds no GGUF file to serve tensors from")
        source = SourceModel.open(self.model_path)
        if source.fingerprint != self.topology.model_fingerprint:
            raise Refusal(f"{self.where} loads another file than the planned model (a slice of it?): it serves "
                          f"no tensors")
        return source

    async def serve(self, stream: SocketStream) -> None:
        """One fetch on a side-channel connection, then close it."""
        peer = asker = stream.peer()
        started, sent, total = time.monotonic(), 0, 0
        try:
            request = await read_tensor_frame(stream, TensorFrameKind.ManifestRequest, timeout=REQUEST_TIMEOUT_S)
            stage = self._asker(request, stream)
            asker = f"{stage.stage_id} at {peer}"
            source = await self.source()
            if request.fingerprint.hex() != source.fingerprint:
                raise Refusal(f"it asks for model {request.fingerprint.hex()}; this holder has {source.fingerprint}")
            await write_tensor_frame(stream, Manifest(source.size, source.header, source.digests))
            fetch = await read_tensor_frame(stream, TensorFrameKind.FetchRequest, timeout=FETCH_REQUEST_TIMEOUT_S)
            items = self._check(fetch, source, stage)
            total = sum(source.index.tensors[i].n_bytes - first for i, first in items)
            started = time.monotonic()
            async for length in self._stream(stream, source, items):
                sent += length
            await write_tensor_frame(stream, Done(sent))
            seconds = time.monotonic() - started
            log.info("%s served layers [%d, %d) to %s: %d tensors, %d bytes (%.1f MiB) in %.1f s (%.1f MB/s)",
                     self.where, stage.layer_start, stage.layer_end, asker, len(items), sent, sent / MIB, seconds,
                     sent / max(seconds, 1e-9) / 1e6)
        except Refusal as refusal:
            log.warning("%s refused a tensor fetch from %s: %s", self.where, asker, refusal)
            with contextlib.suppress(ConnectionError, OSError):
                await write_tensor_frame(stream, Refused(str(refusal)))
        except (ProtocolError, TimeoutError, ConnectionError, OSError, asyncio.IncompleteReadError) as error:
            log.info("%s: the fetch by %s broke after %d bytes (%.1f MiB) of %d in %.1f s: %s", self.where, asker,
                     sent, sent / MIB, total, time.monotonic() - started, f"{type(error).__name__}: {error}")
        except Exception:  # a bug of ours: this fetch ends, the holder and its stage go on
            log.exception("%s: the fetch by %s failed after %d bytes", self.where, asker, sent)
        finally:
            stream.close()

    def _asker(self, request: ManifestRequest, stream: SocketStream) -> TopologyStage:
        """The stage the dialer says it is; off loopback its certificate must name that stage."""
        if not 0 <= request.stage_index < len(self.topology.stages):
            raise Refusal(f"there is no stage {request.stage_index} in this chain")
        stage = self.topology.stages[request.stage_index]
        certificate = stream.peer_certificate()
        if certificate:  # TLS: `skippy plan` names each certificate after its stage (stage-1, stage-1-standby-1)
            names = [value for rdn in certificate.get("subject", ()) for key, value in rdn if key == "commonName"]
            if not any(name == stage.stage_id or name.startswith(f"{stage.stage_id}-standby-") for name in names):
                raise Refusal(f"it asks for {stage.stage_id}'s layers, but its certificate names {', '.join(names)}")
        return stage

    def _check(self, fetch: FetchRequest, source: SourceModel, stage: TopologyStage) -> list[tuple[int, int]]:
        """The request's items, if every one is a tensor of the asker's planned layers."""
        planned = set(source.slice_indices(stage.layer_start, stage.layer_end))
        seen = set()
        for index, first in fetch.items:
            if index >= len(source.index.tensors):
                raise Refusal(f"there is no tensor {index} (the file has {len(source.index.tensors)})")
            tensor = source.index.tensors[index]
            if index not in planned:
                raise Refusal(f"tensor {tensor.name} is outside {stage.stage_id}'s planned layers "
                              f"[{stage.layer_start}, {stage.layer_end})")
            if first >= tensor.n_bytes or index in seen:
                raise Refusal(f"tensor {tensor.name}: byte {first} of {tensor.n_bytes}, or asked twice")
            seen.add(index)
        return fetch.items

    async def _stream(self, stream: SocketStream, source: SourceModel, items: list[tuple[int, int]]):
        """Send the items' bytes as Chunks, each read (off the loop) while the one before drains."""
        tensors, start = source.index.tensors, source.index.data_start
        pieces = [(i, at, min(CHUNK_BYTES, tensors[i].n_bytes - at), start + tensors[i].offset + at)
                  for i, first in items for at in range(first, tensors[i].n_bytes, CHUNK_BYTES)]
        if not pieces:
            return
        loop = asyncio.get_running_loop()
        pace = Pace(stream.sock)  # behind the holder's own frames (pace.py)
        fd = os.open(source.path, os.O_RDONLY)
        read = lambda piece: loop.run_in_executor(self.pool, os.pread, fd, piece[2], piece[3])  # noqa: E731
        pending = read(pieces[0])
        try:
            for n, (index, at, length, _) in enumerate(pieces):
                data = await pending
                pending = read(pieces[n + 1]) if n + 1 < len(pieces) else None
                if len(data) != length:
                    raise OSError(f"{source.path} ended early (tensor {tensors[index].name}): did it change?")
                stream.write(chunk_prefix(index, at, length))
                stream.write(data)
                await stream.drain()
                pace.tick()
                yield length
        finally:
            if pending is not None:
                with contextlib.suppress(BaseException):
                    await pending  # the read in flight ends before its file closes
            os.close(fd)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


async def serve_tensors(holder: TensorHolder | None, stream: SocketStream, *, where: str) -> None:
    """A side-channel connection on a listener: its holder serves it, or it is refused."""
    if holder is not None:
        await holder.serve(stream)
        return
    log.warning("%s refused a tensor fetch from %s: it was started without a topology", where, stream.peer())
    with contextlib.suppress(ConnectionError, OSError):
        await write_tensor_frame(stream, Refused(f"{where} serves no tensors: it was started without a topology"))
    stream.close()
