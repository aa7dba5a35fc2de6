"""Time to first token and decode tokens/s through the OpenAI HTTP API, against direct generation.

A `skippy serve` subprocess (the same command a user runs) answers streaming chat
requests from this process at concurrency 1, 4 and 8. The reference is the
`skippy generate` path with no HTTP at concurrency 1: `generate_tokens` in this
process for --stages 1, a `LocalChain` driven by its `ChainClient` for --stages N.
llama.cpp (llama-cpp-python, same GGUF, same prompt ids, greedy with the same end
tokens banned) runs one stream in this process in every round too, when it imports:
its server runs one request at a time, so its single-stream rate is the bar for our
aggregate (issue 12: 8 streams on 2 stages >= 3x). llama-cpp-python's own OpenAI server
(`python -m llama_cpp.server`, same GGUF and threads) answers the same streamed request
as well, so the HTTP rows compare like with like: a served rate includes the client's
work on the same cores. (Its TTFT is not comparable: that server keeps the previous
request's KV and reuses the shared prompt prefix, while ours runs cold prefills here.)
Every request uses the same prompt ids and runs exactly --max-tokens tokens
(greedy, end-of-generation tokens banned by logit_bias in both paths, so both do
the same sampling work). One round runs every configuration once, in turn; the
table shows medians over the rounds, after one warm-up round that is not counted.
The streaming client is bench/sse_client.py's light one (the client shares these cores,
and httpx's ~0.4 ms of CPU a chunk would count against whichever server it reads);
`--client httpx` runs httpx instead.

    TTFT             request sent -> first token (HTTP: the first content chunk)
    decode tok/s     per stream: (tokens - 1) / (last token - first token)
    aggregate tok/s  all streams' tokens / (first request sent -> last token)

    python bench/serve.py                          # bundled SmolLM2, 2 stages (as `skippy serve`)
    python bench/serve.py --stages 1 --rounds 5 --max-tokens 96
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from common import resident, resolve_model, start_serve
from sse_client import HttpxSSEClient, SSEClient, make_client

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPT = "Write a long story about a dragon who learns to paint."
NO_EOS = {0: -100.0, 2: -100.0}  # SmolLM2's end tokens (<|endoftext|>, <|im_end|>): run to max_tokens


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_s: float
    decode_tok_s: float
    num_tokens: int
    started: float
    finished: float


def sample(started: float, token_times: list[float]) -> Sample:
    first, last, n = token_times[0], token_times[-1], len(token_times)
    return Sample(first - started, (n - 1) / (last - first) if n > 1 else 0.0, n, started, last)


# ---- through HTTP -------------------------------------------------------------------


async def http_stream(client: SSEClient | HttpxSSEClient, url: str, body: dict) -> Sample:
    started = time.perf_counter()
    token_times: list[float] = []
    num_tokens, finish = 0, None
    async for data in client.events(url, body):
        if not data.startswith(b"{"):
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        if chunk.get("usage"):
            num_tokens = chunk["usage"]["completion_tokens"]
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            token_times.append(time.perf_counter())
        if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
            finish = chunk["choices"][0]["finish_reason"]
    # A chunk can carry two tokens (a character split across them); spread the count evenly.
    # llama-cpp-python's server sends no usage in a stream: a stream it ended for its length ran
    # max_tokens tokens (a random model's text splits characters often); otherwise count its chunks.
    num_tokens = num_tokens or (body["max_tokens"] if finish == "length" else len(token_times))
    result = sample(started, token_times)
    rate = (num_tokens - 1) / (token_times[-1] - token_times[0])
    return Sample(result.ttft_s, rate, num_tokens, result.started, result.finished)


async def http_round(client: SSEClient | HttpxSSEClient, url: str, body: dict, concurrency: int) -> list[Sample]:
    return await asyncio.gather(*(http_stream(client, url, body) for _ in range(concurrency)))


class Server:
    def __init__(self, args: argparse.Namespace):
        command = ["--stages", str(args.stages), "--ctx-size", "2048", "--concurrency", str(max(args.concurrency)),
                   "--kv-cache-mem", "0"]  # every request repeats the prompt: measure cold prefills  # fmt: skip
        if args.model:
            command += ["--model", args.model]
        if args.threads:
            command += ["--threads", str(args.threads)]
        if not args.repack:
            command += ["--no-repack"]
        command += ["--dtype", args.dtype]
        self.process, self.url, self.ready_line = start_serve(command)

    def memory(self) -> list[tuple[str, int, int]]:
        """(process, resident bytes now, peak resident bytes) for `skippy serve` and each stage it started."""
        import psutil

        serve = psutil.Process(self.process.pid)
        processes = [("serve (stage 0)", serve)] + [(f"stage {i + 1}", p) for i, p in enumerate(serve.children())]
        return [(name, *resident(p.pid)) for name, p in processes]

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


# ---- direct (no HTTP) ---------------------------------------------------------------


class Direct:
    """`skippy generate`'s path: one process, or stage 0 of a LocalChain in this process."""

    def __init__(self, args: argparse.Namespace, path: Path, loop: asyncio.AbstractEventLoop):
        from skippy.protocol.sampling_config import SamplingConfig

        self.args, self.path, self.loop = args, path, loop
        self.sampling = SamplingConfig(temperature=0.0, logit_bias=NO_EOS)
        self.chain = self.model = None
        if args.stages == 1:
            from skippy.model.loader import load_stage

            self.model = load_stage(path, dtype=args.dtype, progress=False, repack=args.repack)
        else:
            from skippy.launch.local_chain import LocalChain

            self.chain = LocalChain(path, args.stages, ctx_size=2048, threads=args.threads, repack=args.repack,
                                    dtype=args.dtype)
            self.client = loop.run_until_complete(self.chain.start())

    def generate(self, prompt_ids: list[int], stop_ids: frozenset[int]) -> Sample:
        token_times: list[float] = []
        started = time.perf_counter()
        if self.model is not None:
            from skippy.runtime.local_generation import GenerationLimits, generate_tokens

            limits = GenerationLimits(self.args.max_tokens, stop_ids)
            for _ in generate_tokens(self.model, prompt_ids, limits, self.sampling, 2048):
                token_times.append(time.perf_counter())
        else:
            self.loop.run_until_complete(self.client.generate(
                prompt_ids, max_tokens=self.args.max_tokens, sampling=self.sampling, stop_ids=stop_ids,
                on_token=lambda _: token_times.append(time.perf_counter())))  # fmt: skip
        return sample(started, token_times)

    def close(self) -> None:
        if self.chain is not None:
            self.loop.run_until_complete(self.chain.close())


class LlamaCpp:
    """One greedy stream through llama-cpp-python, timed per token as the others are."""

    def __init__(self, path: Path, threads: int):
        import llama_cpp
        import numpy as np

        self.llama_cpp, self.np = llama_cpp, np
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, logits_all=False, verbose=False)
        self.vocab_size = self.llm.n_vocab()

    def _next(self) -> int:
        logits = self.np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1),
                                            shape=(self.vocab_size,)).copy()
        for token, bias in NO_EOS.items():
            logits[token] += bias
        return int(logits.argmax())

    def generate(self, prompt_ids: list[int], max_tokens: int) -> list[float]:
        """The perf_counter time of each token (CLOCK_MONOTONIC: comparable across processes)."""
        self.llm.reset()
        self.llm.eval(prompt_ids)
        token, token_times = self._next(), [time.perf_counter()]
        while len(token_times) < max_tokens:
            self.llm.eval([token])
            token = self._next()
            token_times.append(time.perf_counter())
        return token_times


class LlamaCppProcess:
    """LlamaCpp in a child process of its own: this one shortened libgomp's spin for the
    co-located stages, and llama.cpp's OpenMP threads would then sleep between its ops
    (it decodes ~3x slower with a passive wait policy)."""

    def __init__(self, path: Path, threads: int):
        env = {key: value for key, value in os.environ.items() if key != "GOMP_SPINCOUNT"}
        self.process = subprocess.Popen([sys.executable, __file__, "--llama-cpp-worker", str(path), str(threads)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the llama.cpp worker exited with {self.process.wait()}")

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Sample:
        started = time.perf_counter()
        self.process.stdin.write(json.dumps([prompt_ids, max_tokens]) + "\n")
        self.process.stdin.flush()
        return sample(started, json.loads(self.process.stdout.readline()))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def llama_cpp_worker(path: str, threads: int) -> None:
    engine = LlamaCpp(Path(path), threads)
    print("ready", flush=True)
    for line in sys.stdin:
        prompt_ids, max_tokens = json.loads(line)
        print(json.dumps(engine.generate(prompt_ids, max_tokens)), flush=True)


class LlamaCppServer:
    """llama-cpp-python's own OpenAI server (`python -m llama_cpp.server`) on the same GGUF and
    threads: the like-for-like bar for our HTTP figures, since the client's work on the same
    cores (receiving and parsing every SSE chunk) is part of a served rate."""

    def __init__(self, path: Path, threads: int):
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {key: value for key, value in os.environ.items() if key != "GOMP_SPINCOUNT"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--n_threads", str(threads),
             "--n_threads_batch", str(threads), "--n_ctx", "2048", "--host", "127.0.0.1", "--port", str(port),
             "--verbose", "False"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {self.process.returncode}: "
                                   f"{self.process.stderr.read()[-2000:]}")  # fmt: skip
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError("llama_cpp.server did not answer within 120 s")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def load_llama_cpp_server(path: Path, threads: int | None) -> LlamaCppServer | None:
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as exc:
        print(f"llama.cpp's server skipped: {exc} (pip install -e '.[bench-llamacpp]')", flush=True)
        return None
    return LlamaCppServer(path, threads or os.cpu_count() or 1)


def load_llama_cpp(path: Path, threads: int | None) -> LlamaCppProcess | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp skipped: llama_cpp is not importable (pip install -e '.[bench-llamacpp]')", flush=True)
        return None
    return LlamaCppProcess(path, threads or os.cpu_count() or 1)


# ---- the run ------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=resolve_model, default=None,
                        help="GGUF or HF directory or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2)")
    parser.add_argument("--stages", type=int, default=2, help="stages behind the API (1 = one process)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every process (default: torch's)")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 4, 8])
    parser.add_argument("--client", choices=["light", "httpx"], default="light",
                        help="the streaming client (bench/sse_client.py: light costs less CPU on shared cores)")
    parser.add_argument("--dtype", default="auto", help="skippy serve --dtype (auto: the GGUF's quantized blocks)")
    parser.add_argument("--no-repack", dest="repack", action="store_false",
                        help="both arms without the batch-friendly weight copy (skippy serve --no-repack)")
    args = parser.parse_args()
    if args.stages > 1:  # as `skippy serve` does for the stages it starts, before torch loads
        from skippy.model.locate import bundled_model_path
        from skippy.model.threads import spin_for_co_located_stages

        spin_for_co_located_stages(args.model or bundled_model_path(), args.dtype)

    from skippy.launch.serve import model_id_for
    from skippy.model.locate import bundled_model_path
    from skippy.model.tokenizer import Tokenizer

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else bundled_model_path()
    tokenizer = Tokenizer.from_model(path)
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    body = {"model": model_id_for(path), "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": args.max_tokens, "logit_bias": {str(k): v for k, v in NO_EOS.items()}, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    loop = asyncio.new_event_loop()
    print(f"loading: skippy serve --stages {args.stages}, and the direct reference ...", flush=True)
    server = Server(args)
    direct = Direct(args, path, loop)
    llama = load_llama_cpp(path, args.threads)
    llama_server = load_llama_cpp_server(path, args.threads) if llama is not None else None
    client = make_client(args.client)
    url = server.url + "/v1/chat/completions"
    print(server.ready_line, flush=True)
    names = ["direct c=1", *[f"http c={c}" for c in args.concurrency]] + (["llama.cpp c=1"] if llama else [])
    names += ["llama.cpp http c=1"] if llama_server else []
    results: dict[str, list[list[Sample]]] = {name: [] for name in names}
    try:
        for round_index in range(args.rounds + 1):  # round 0 warms up
            runs = {"direct c=1": [direct.generate(prompt_ids, tokenizer.eog_ids)]}
            for c in args.concurrency:
                runs[f"http c={c}"] = loop.run_until_complete(http_round(client, url, body, c))
            if llama is not None:
                runs["llama.cpp c=1"] = [llama.generate(prompt_ids, args.max_tokens)]
            if llama_server is not None:
                runs["llama.cpp http c=1"] = loop.run_until_complete(
                    http_round(client, llama_server.url + "/v1/chat/completions", body, 1))
            for name, samples in runs.items():
                assert all(s.num_tokens == args.max_tokens for s in samples), (name, [s.num_tokens for s in samples])
                if round_index:
                    results[name].append(samples)
            print(f"round {round_index}{' (warm-up)' if not round_index else ''} done", flush=True)
        memory = server.memory()  # steady state: after every round, the concurrency-8 one included
    finally:
        loop.run_until_complete(client.aclose())
        direct.close()
        server.close()
        if llama is not None:
            llama.close()
        if llama_server is not None:
            llama_server.close()

    table = {}
    for name, rounds in results.items():
        ttft = median([median([s.ttft_s for s in r]) for r in rounds]) * 1e3
        decode = median([median([s.decode_tok_s for s in r]) for r in rounds])
        aggregate = median([sum(s.num_tokens for s in r) / (max(s.finished for s in r) - min(s.started for s in r))
                            for r in rounds])  # fmt: skip
        table[name] = (ttft, decode, aggregate)

    print(f"\n{path.name}, {args.stages} stage(s), {args.max_tokens} tokens per stream, "
          f"{len(prompt_ids)} prompt tokens, {os.cpu_count()} CPUs, threads {args.threads or 'default'}, "
          f"--dtype {args.dtype}{'' if args.repack else ' --no-repack'}, {args.client} client, "
          f"medians of {args.rounds} rounds")  # fmt: skip
    print(f"{'config':<18} {'TTFT ms':>9} {'decode tok/s/stream':>20} {'aggregate tok/s':>16}")
    for name, (ttft, decode, aggregate) in table.items():
        print(f"{name:<18} {ttft:>9.1f} {decode:>20.2f} {aggregate:>16.2f}")
    print(f"\nresident memory of `skippy serve --stages {args.stages} --dtype {args.dtype}` after the rounds:")
    for name, now, peak in memory:
        print(f"  {name:<16} RSS {now / 2**20:7.1f} MiB   peak {peak / 2**20:7.1f} MiB")
    print(f"  {'total':<16} RSS {sum(m[1] for m in memory) / 2**20:7.1f} MiB")
    direct_decode = table["direct c=1"][1]
    print()
    if "http c=1" in table:
        http1 = table["http c=1"]
        print(f"HTTP / direct at c=1: decode {http1[1] / direct_decode:.3f}, "
              f"aggregate {http1[2] / table['direct c=1'][2]:.3f}, TTFT {http1[0] / table['direct c=1'][0]:.3f}")
        for c in args.concurrency:
            if c != 1:
                print(f"aggregate c={c} / c=1: {table[f'http c={c}'][2] / http1[2]:.2f}x")
    # llama.cpp bare, and through its own server (both through an OpenAI server, client on the same cores)
    for name, label in (("llama.cpp c=1", "llama.cpp c=1"), ("llama.cpp http c=1", "llama.cpp http c=1 (its own server)")):
        if name not in table:
            continue
        reference = table[name]
        print(f"{label}: decode {reference[1]:.2f} tok/s, aggregate {reference[2]:.2f}")
        for c in args.concurrency:
            ours = table[f"http c={c}"]
            print(f"http c={c} / {name}: aggregate {ours[2] / reference[2]:.2f}x, "
                  f"decode per stream {ours[1] / reference[1]:.2f}x")

if __name__ == "__main__":
    if sys.argv[1:2] == ["--llama-cpp-worker"]:
        llama_cpp_worker(sys.argv[2], int(sys.argv[3]))
    else:
        main()
