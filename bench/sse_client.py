"""The benches' streaming client: POST a JSON body, yield each server-sent event's data.

Client and server share this machine's cores, so the client's work per streamed chunk
lands in the served rate it measures. httpx spends 0.35-0.5 ms of CPU a chunk (h11,
anyio, line splitting; psutil over 200-token streams on 2 cores); `SSEClient`, one
asyncio connection per request that reads the chunked body and splits events itself,
~0.15-0.2 ms, and it raised the same server's streamed rate from ~162 to ~180 tok/s
(four interleaved pairs). Both speak to every server alike (ours, llama-cpp-python's),
and `HttpxSSEClient` stays for comparison (`bench/serve.py --client httpx`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HTTPStatusError(RuntimeError):
    pass


class SSEClient:
    """HTTP/1.1 over a fresh asyncio connection per request (`Connection: close`)."""

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s

    async def events(self, url: str, body: dict) -> AsyncIterator[bytes]:
        """Each `data:` payload of the response to POST `body` to `url`, as it arrives."""
        parts = urlsplit(url)
        payload = json.dumps(body).encode()
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, parts.port or 80), self.timeout_s)
        try:
            writer.write(f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                         f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                         f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
            status, headers = await self._head(reader)
            chunks = self._body(reader, headers)
            if status != 200:
                text = b"".join([chunk async for chunk in chunks]).decode(errors="replace")
                raise HTTPStatusError(f"HTTP {status} from {url}: {text[:500]}")
            pending = b""
            async for chunk in chunks:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.startswith(b"data:"):
                        yield line[5:].strip()
            if pending.startswith(b"data:"):
                yield pending[5:].strip()
        finally:
            writer.close()

    async def _head(self, reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout_s)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        return int(status_line.split()[1]), headers

    async def _body(self, reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
        timeout = self.timeout_s
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await asyncio.wait_for(reader.readline(), timeout)).split(b";")[0], 16)
                if size == 0:
                    return
                data = await asyncio.wait_for(reader.readexactly(size + 2), timeout)  # + CRLF
                yield data[:-2]
        elif "content-length" in headers:
            yield await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout)
        else:
            while data := await asyncio.wait_for(reader.read(65536), timeout):
                yield data

    async def aclose(self) -> None:
        pass


class HttpxSSEClient:
    """The same events through httpx (pooled connections)."""

    def __init__(self, timeout_s: float = 600.0):
        import httpx

        self.client = httpx.AsyncClient(timeout=timeout_s)

    async def events(self, url: str, body: dict) -> AsyncIterator[bytes]:
        async with self.client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise HTTPStatusError(f"HTTP {response.status_code} from {url}: {text[:500]}")
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    yield line[5:].strip().encode()

    async def aclose(self) -> None:
        await self.client.aclose()


def make_client(kind: str = "light", timeout_s: float = 600.0) -> SSEClient | HttpxSSEClient:
    return HttpxSSEClient(timeout_s) if kind == "httpx" else SSEClient(timeout_s)
