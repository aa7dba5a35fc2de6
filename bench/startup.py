"""Start-up: seconds from launching a server to its first answer, warm and cold, and its memory.

ours: `skippy serve --stages 1 --model M`, ready at its ready line; llama.cpp:
llama-cpp-python's own server (`python -m llama_cpp.server`, same GGUF and threads), ready
when /v1/models answers. Each server then streams one chat completion of --tokens tokens;
its resident set (VmRSS) after that is the memory column, and "runtime" is the same
server's resident set on bench/synthetic.py's tiny model (2 layers of 256, the same
vocabulary) less that file's size: what the process holds besides the model.

    warm     the model's file (and our packed cache) in the page cache, as after a restart
    cold     both evicted from the page cache first (posix_fadvise DONTNEED on each file):
             every byte comes from the disk, as after a reboot or on a fresh host
    first    ours only: the packed cache deleted first, so the weights are packed from the
             GGUF (a first start on a host); the MB/s column is the GGUF's bytes over the time

Rounds run every configuration once, in turn; the table shows medians.

    python bench/startup.py --model synthetic
    python bench/startup.py --model synthetic --rounds 3 --modes warm,cold
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from common import resident, resolve_model, start_serve

MB = 1e6


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (those no process maps)."""
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def packed_cache_dirs() -> list[Path]:
    """Where our packed weights are kept (skippy.model.packed_cache), when that exists."""
    try:
        from skippy.model.packed_cache import packed_root
    except ImportError:
        return []
    return [packed_root()]


def chat(url: str, tokens: int) -> None:
    model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Write a story about a dragon."}],
            "max_tokens": tokens, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()


class Ours:
    name = "ours (skippy serve --stages 1)"

    def __init__(self, model: Path, threads: int):
        self.model, self.threads = model, threads

    def start(self) -> tuple[subprocess.Popen, str]:
        process, url, _ = start_serve(["--stages", "1", "--model", str(self.model), "--threads", str(self.threads),
                                       "--ctx-size", "2048", "--kv-cache-mem", "0"])
        return process, url


class LlamaCppServer:
    name = "llama.cpp (llama_cpp.server)"

    def __init__(self, model: Path, threads: int):
        self.model, self.threads = model, threads

    def start(self) -> tuple[subprocess.Popen, str]:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(self.model), "--n_threads", str(self.threads),
             "--n_threads_batch", str(self.threads), "--n_ctx", "2048", "--host", "127.0.0.1", "--port", str(port),
             "--verbose", "False"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        while process.poll() is None:
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    return process, url
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError(f"llama_cpp.server exited with {process.returncode}")


def measure(server, tokens: int) -> tuple[float, int]:
    """(seconds to ready, resident bytes after one request)."""
    started = time.perf_counter()
    process, url = server.start()
    ready = time.perf_counter() - started
    try:
        chat(url, tokens)
        return ready, resident(process.pid)[0]
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic", help="GGUF file, or synthetic[:SHAPE[:TYPE]] (default)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8, help="tokens of the one request before memory is read")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["warm", "cold", "first"])
    options = parser.parse_args()
    model = Path(resolve_model(options.model))
    tiny = Path(resolve_model("synthetic:tiny:F16"))
    servers = [Ours(model, options.threads)]
    try:
        import llama_cpp.server.app  # noqa: F401

        servers.append(LlamaCppServer(model, options.threads))
    except ImportError as exc:
        print(f"llama.cpp's server skipped: {exc} (pip install -e '.[bench-llamacpp]')")
    size = model.stat().st_size
    print(f"{model} ({size / MB:.0f} MB), {options.threads} threads")

    runtime = {}
    for server in servers:
        measure(type(server)(tiny, options.threads), options.tokens)  # the page cache holds the code after this
        runtime[server.name] = measure(type(server)(tiny, options.threads), options.tokens)[1] - tiny.stat().st_size
    results: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for _ in range(options.rounds):
        for mode in options.modes:
            for server in servers:
                if mode == "first" and not isinstance(server, Ours):
                    continue
                if mode == "first":
                    for directory in packed_cache_dirs():
                        subprocess.run(["rm", "-rf", str(directory)], check=True)
                if mode == "cold":
                    evict([model, *packed_cache_dirs()])
                results.setdefault((server.name, mode), []).append(measure(server, options.tokens))

    print(f"{'server':<32} {'mode':<6} {'ready s':>8} {'MB/s':>7} {'RSS MB':>8} {'RSS/file':>9} "
          f"{'runtime MB':>11} {'(RSS-runtime)/file':>19}")
    for (name, mode), samples in results.items():
        ready = statistics.median(s[0] for s in samples)
        rss = statistics.median(s[1] for s in samples)
        print(f"{name:<32} {mode:<6} {ready:8.2f} {size / MB / ready:7.0f} {rss / MB:8.0f} {rss / size:9.2f} "
              f"{runtime[name] / MB:11.0f} {(rss - runtime[name]) / size:19.2f}")


if __name__ == "__main__":
    main()
