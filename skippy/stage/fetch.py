"""The model a stage loads: its own copy of the file, else its slice, fetched once from a holder.

`provide_model` runs before the model loads. A file at the config's `model_path` is used as
it is. Without one, the stage's slice (model/slice.py) comes from its cache directory,
checked against its digests, or is fetched from a holder (holder.py) over the chain's
authenticated link into a partial file a later start resumes. A holder not answering yet
is waited for; a refusal, another model or a corrupt tensor stops the stage with the reason.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..model.errors import ModelLoadError
from ..model.fingerprint import check_model
from ..model.locate import cache_root
from ..model.partial_slice import PartialSlice, SliceIntegrityError
from ..model.slice import SliceLayout, check_slice_header, check_slice_tensors, plan_slice, slice_file_name
from ..protocol import (
    FrameError, ProtocolError, StageConfig, Topology, TensorRefused, read_tensor_frame, write_tensor_frame,
)
from ..protocol.tensor_frames import FetchRequest, ManifestRequest, TensorFrameKind
from .transport import LinkBroken, SocketStream, Transport, answers_later

log = logging.getLogger("skippy.stage")
CONNECT_TIMEOUT_S = 5.0
RETRY_S = 2.0              # between tries while no holder answers
SAY_EVERY_S = 10.0         # how often the stage says it is still waiting
MANIFEST_TIMEOUT_S = 3600.0    # a holder digests its file the first time it is asked (~1.4 s per GB)
CHUNK_TIMEOUT_S = 60.0     # silence mid-transfer this long: the link is cut; resume from another try
MIB = 1 << 20


@dataclass
class ProvidedModel:
    """What a stage loads (`config.model_path`), and for a cached slice the check of its
    tensors' digests, which runs on other threads while the model loads (`checked`)."""

    config: StageConfig
    checking: asyncio.Future | None = None

    async def checked(self) -> None:
        """ModelLoadError (naming the tensor) if the cached slice it loaded is corrupt."""
        if self.checking is not None:
            started = time.perf_counter()
            await self.checking
            log.info("stage %d: its cached slice's tensors checked (waited %.2f s after the load)",
                     self.config.stage_index, time.perf_counter() - started)


async def provide_model(config: StageConfig, topology: Topology | None) -> ProvidedModel:
    """The model this stage loads (see the module's doc). A stage must await `checked()` after
    loading it and before it serves."""
    who = f"stage {config.stage_index}"
    if Path(config.model_path).exists():
        check_model(config.model_path, config.model_fingerprint, who)
        return ProvidedModel(config)
    fingerprint = config.model_fingerprint
    if fingerprint is None:
        raise ModelLoadError(f"{who}: there is no model at {config.model_path}, and the config names no model "
                             f"fingerprint to fetch its layers by. Fix: --model PATH, or a config from `skippy plan`.")
    cache = Path(config.model_cache).expanduser() if config.model_cache else cache_root() / "models" / fingerprint
    target = cache / slice_file_name(config.layer_start, config.layer_end)
    provided = ProvidedModel(config.model_copy(update={"model_path": str(target)}))
    if target.exists():  # its metadata now; its tensors (hashing them all) while the model loads
        reader = check_slice_header(target, fingerprint, config.layer_start, config.layer_end)
        provided.checking = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(check_slice_tensors, reader, background=True))
        return provided
    holders = list(config.model_sources) or ([topology.driver_endpoint] if topology is not None else [])
    if not holders:
        raise ModelLoadError(f"{who}: there is no model at {config.model_path} and no holder to fetch its "
                             f"layers from. Fix: --topology (stage 0 serves them), --fetch-from HOST:PORT, or "
                             f"--model PATH.")
    if config.auth_token is None:
        raise ModelLoadError(f"{who}: a holder serves tensors only to a stage with the chain's auth token, and "
                             f"this config has none. Fix: a config from `skippy plan`, or --model PATH.")
    await SliceFetch(config, target, holders).run()  # every tensor checked as it arrived
    return provided


@dataclass
class SliceFetch:
    config: StageConfig
    target: Path
    holders: list[str]

    @property
    def who(self) -> str:
        return f"stage {self.config.stage_index}"

    async def run(self) -> Path:
        """Fetch from the first holder that answers; wait (and say so) while none does."""
        said, last = time.monotonic(), ""
        while True:
            for holder in self.holders:
                try:
                    return await self.fetch_from(holder)
                except TensorRefused as error:
                    raise ModelLoadError(f"{self.who}: the holder at {holder} refused to serve its layers: "
                                         f"{error}") from None
                except SliceIntegrityError as error:
                    raise ModelLoadError(f"{self.who}: from the holder at {holder}, {error}") from None
                except LinkBroken as error:
                    if not answers_later(error):
                        raise ModelLoadError(f"{self.who}: cannot fetch its layers: {error}") from None
                    last = str(error)
                except (ProtocolError, OSError, TimeoutError, asyncio.IncompleteReadError) as error:
                    last = f"the fetch from {holder} broke: {type(error).__name__}: {error}"  # resumed next try
            if time.monotonic() - said >= SAY_EVERY_S:
                print(f"skippy: {self.who} waits for a holder of its layers ({last})", file=sys.stderr, flush=True)
                said = time.monotonic()
            await asyncio.sleep(RETRY_S)

    async def fetch_from(self, holder: str) -> Path:
        config = self.config
        sock, _ = await Transport.for_stage(config).dial(holder, tensors=True, connect_s=CONNECT_TIMEOUT_S)
        stream = SocketStream(sock)
        try:
            asking = ManifestRequest(config.stage_index, bytes.fromhex(config.model_fingerprint))
            await write_tensor_frame(stream, asking)
            manifest = await read_tensor_frame(stream, TensorFrameKind.Manifest, timeout=MANIFEST_TIMEOUT_S)
            try:
                layout = plan_slice(manifest.header, manifest.file_size, config.model_fingerprint, manifest.digests,
                                    config.layer_start, config.layer_end)
            except ValueError as error:
                raise TensorRefused(f"its manifest does not fit the plan: {error}") from None
            partial = await asyncio.to_thread(PartialSlice, self.target, layout)  # hashes what an earlier try kept
            try:
                await self._receive(stream, holder, layout, partial)
                return partial.finish()
            finally:
                partial.close()
        finally:
            stream.close()

    async def _receive(self, stream: SocketStream, holder: str, layout: SliceLayout, partial: PartialSlice) -> None:
        missing = partial.missing()
        progress = Progress(f"{self.who} fetching layers [{self.config.layer_start}, {self.config.layer_end}) from "
                            f"{holder}", layout.share, partial.bytes_done)
        if not missing:
            return
        wanted = [(layout.tensors[position].source_index, first) for position, first in missing]
        await write_tensor_frame(stream, FetchRequest(wanted))
        received = 0
        for position, first in missing:
            tensor, at = layout.tensors[position], first
            while at < tensor.n_bytes:
                chunk = await read_tensor_frame(stream, TensorFrameKind.Chunk, timeout=CHUNK_TIMEOUT_S)
                if chunk.tensor_index != tensor.source_index or chunk.offset != at or \
                        at + len(chunk.data) > tensor.n_bytes:
                    raise FrameError(f"Chunk: expected tensor {tensor.source_index} ({tensor.name}) from byte {at}, "
                                     f"got tensor {chunk.tensor_index} [{chunk.offset}, "
                                     f"{chunk.offset + len(chunk.data)})")
                partial.write(position, at, chunk.data)  # its last bytes check the tensor's digest
                at += len(chunk.data)
                received += len(chunk.data)
                progress.show(partial.bytes_done)
        done = await read_tensor_frame(stream, TensorFrameKind.Done, timeout=CHUNK_TIMEOUT_S)
        if done.total_bytes != received:
            raise FrameError(f"Done: expected {received} bytes sent, got {done.total_bytes}")
        progress.finish(received, self.target)


class Progress:
    """The fetching stage's progress line on stderr: bytes, rate, ETA. On a terminal it redraws
    each second; in a log, a line each tenth of the way."""

    def __init__(self, what: str, total: int, done: int):
        self.what, self.total, self.kept = what, total, done
        self.started = self.shown_at = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.tenth = done * 10 // max(total, 1)

    def show(self, done: int) -> None:
        now = time.monotonic()
        tenth = done * 10 // max(self.total, 1)
        if (now - self.shown_at < 1.0) if self.tty else (tenth == self.tenth):
            return
        self.shown_at, self.tenth = now, tenth
        rate = (done - self.kept) / max(now - self.started, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        line = (f"skippy: {self.what}: {done / MIB:.1f} of {self.total / MIB:.1f} MiB, {rate / 1e6:.1f} MB/s, "
                f"ETA {eta:.0f} s")
        print("\r" + line if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def finish(self, received: int, path: Path) -> None:
        seconds = time.monotonic() - self.started
        kept = f"; {self.kept / MIB:.1f} MiB kept from an earlier try" if self.kept else ""
        line = (f"skippy: {self.what}: fetched {received} bytes ({received / MIB:.1f} MiB) in {seconds:.1f} s "
                f"({received / max(seconds, 1e-9) / 1e6:.1f} MB/s){kept}; cached as {path}")
        print("\n" + line if self.tty else line, file=sys.stderr, flush=True)
