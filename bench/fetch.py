"""A stage with no model file fetches its slice from a holder (stage/fetch.py, stage/holder.py):
how fast across a link capped by the kernel, what serving it costs the holder's own decode,
and how long a stage takes to start from its cached slice against a full local file.

* Start-up (loopback): `skippy stage` for stage 1's layers, from the whole file (`--model`)
  and from its cached slice (no file: the slice in `--model-cache`), rounds interleaved, the
  time from spawn to its ready line. The page cache is warm for both after the first round.
* Transfer and decode (root: `ip`/`tc`, three network namespaces as tests/netns_support.py
  makes them, mutual TLS from a plan): host a runs stage 0 (this script again, `--holder`,
  a ChainClient whose return listener holds the file), host b stage 1 with its own copy,
  host c a standby of stage 1 with none, which fetches stage 1's slice from stage 0 into an
  empty cache, again and again. `tc tbf` caps what host a sends at --cap-mbps. In each
  round stage 0 decodes --decode-tokens alone and while c fetches (order alternating), and
  every fetch's rate is its tensor bytes over the whole fetch (manifest included).

The model: --model, else a synthetic llama GGUF (random Q8_0 blocks, the bundled SmolLM2's
tokenizer; ~700 MB, past the 480 MiB L3 cache), written once to --synthetic.

    python bench/fetch.py [--rounds 3] [--cap-mbps 100] [--decode-tokens 32] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CLI = [sys.executable, "-m", "skippy.cli"]
TOKEN = "bench-fetch-token"
PORT = 7200
HERE = str(Path(__file__).resolve())


def synthetic_gguf(path: Path, *, layers: int = 20, hidden: int = 1536, ffn: int = 4096, heads: int = 12,
                   kv_heads: int = 4) -> Path:
    """A llama-shaped GGUF of random Q8_0 blocks (every scale 0.01) with SmolLM2's tokenizer:
    it loads and decodes at a real model's speed, and says nothing."""
    import gguf

    from skippy.model.gguf_file import GGUFFile
    from skippy.model.locate import bundled_model_path

    if path.exists():
        return path
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    bundled = bundled_model_path()
    fields, types = GGUFFile(bundled).fields, gguf.GGUFReader(str(bundled)).fields
    vocab = len(fields["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(str(path.with_suffix(".tmp")), "llama")
    writer.add_name("synthetic llama (random Q8_0)")
    for key, add in ((writer.add_block_count, layers), (writer.add_context_length, 4096),
                     (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, ffn),
                     (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                     (writer.add_rope_dimension_count, head_dim), (writer.add_layer_norm_rms_eps, 1e-5),
                     (writer.add_rope_freq_base, 10000.0), (writer.add_vocab_size, vocab)):
        key(add)
    for key, value in fields.items():
        if key.startswith("tokenizer."):
            kinds = types[key].types
            writer.add_key_value(key, value, kinds[0], sub_type=kinds[1] if len(kinds) > 1 else None)

    def q8_0(rows: int, cols: int) -> np.ndarray:
        blocks = np.frombuffer(rng.bytes(rows * cols // 32 * 34), dtype=np.uint8).reshape(rows, cols // 32, 34).copy()
        blocks[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        return blocks.reshape(rows, cols // 32 * 34)

    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", q8_0(vocab, hidden), raw_dtype=q8)
    for i in range(layers):
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            writer.add_tensor(f"blk.{i}.{name}.weight", q8_0(rows, cols), raw_dtype=q8)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output.weight", q8_0(vocab, hidden), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".tmp").replace(path)
    return path


def write_slice_locally(model: Path, start: int, end: int, cache: Path) -> Path:
    """Stage [start, end)'s slice as a fetch writes it, the bytes read from `model` itself."""
    from skippy.model.partial_slice import PartialSlice
    from skippy.model.slice import plan_slice, slice_file_name
    from skippy.model.source import SourceModel

    source = SourceModel.open(model)
    layout = plan_slice(source.header, source.size, source.fingerprint, source.digests, start, end)
    partial = PartialSlice(cache / slice_file_name(start, end), layout)
    with source.path.open("rb") as handle:
        for position, first in partial.missing():
            tensor = layout.tensors[position]
            handle.seek(source.index.data_start + source.index.tensors[tensor.source_index].offset + first)
            partial.write(position, first, handle.read(tensor.n_bytes - first))
    return partial.finish()


def startup(model: Path, rounds: int, out: Path) -> dict:
    """Seconds from spawn to the ready line: stage 1 from the whole file and from its cached slice."""
    from skippy.launch.local_chain import free_ports, plan_chain

    topology, configs = plan_chain(model, [f"127.0.0.1:{port}" for port in free_ports(2)], auth_token=TOKEN)
    config = configs[1].model_copy(update={"bind_addr": "127.0.0.1:0", "downstream": None})
    whole, sliced, cache = out / "stage-1-file.json", out / "stage-1-slice.json", out / "slice-cache"
    config.save(whole)
    config.model_copy(update={"model_path": str(out / "no-such.gguf"), "model_cache": str(cache)}).save(sliced)
    write_slice_locally(model, config.layer_start, config.layer_end, cache)

    def ready_after(config_path: Path) -> float:
        started = time.perf_counter()
        process = subprocess.Popen([*CLI, "stage", "--config", str(config_path), "--threads", "1"],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            for line in process.stdout:
                if "stage ready" in line:
                    return time.perf_counter() - started
            raise SystemExit(f"stage from {config_path} exited with {process.wait()}")
        finally:
            process.terminate()
            process.wait(timeout=60)

    times = {"file": [], "slice": []}
    ready_after(whole), ready_after(sliced)  # warm-up: the page cache holds both from here on
    for r in range(rounds):
        for kind in (("file", "slice") if r % 2 == 0 else ("slice", "file")):
            times[kind].append(ready_after(whole if kind == "file" else sliced))
    return {kind: statistics.median(values) for kind, values in times.items()} | {"all": times}


# --- across namespaces -------------------------------------------------------------------------

async def as_fetcher(plan: Path, cache: Path) -> None:
    """--fetcher: stage 1's standby with no model file fetches its slice; one JSON line."""
    from skippy.model.gguf_file import GGUFIndex
    from skippy.model.slice import slice_file_name
    from skippy.protocol import StageConfig, Topology
    from skippy.stage.fetch import SliceFetch

    topology = Topology.load(plan / "topology.json")
    config = StageConfig.load(plan / "stage-1-standby-1.json")
    config = config.model_copy(update={"tls": config.tls.resolved(plan)})
    target = cache / slice_file_name(config.layer_start, config.layer_end)
    started = time.perf_counter()
    await SliceFetch(config, target, [topology.driver_endpoint]).run()
    seconds = time.perf_counter() - started
    with target.open("rb") as handle:
        header = GGUFIndex.parse(handle.read(64 << 20), keep=lambda key: False).data_start
    print(json.dumps({"bytes": target.stat().st_size - header, "seconds": seconds}), flush=True)


async def as_holder(args) -> None:
    """--holder: stage 0 (holding the file) decodes alone and while host c fetches; JSON lines."""
    import torch

    from skippy.launch.local_chain import connect_topology
    from skippy.protocol import StageConfig, Topology

    torch.set_num_threads(1)
    plan = Path(args.holder)
    topology, stage0 = Topology.load(plan / "topology.json"), StageConfig.load(plan / "stage-0.json")
    client = await connect_topology(topology, args.model, auth_token=stage0.auth_token,
                                    tls=stage0.tls.resolved(plan), ctx_size=1024,
                                    concurrency=1, stage_wait_s=120)
    prompt = np.random.default_rng(0).integers(100, 40000, size=16).tolist()

    async def decode() -> float:
        result = await client.generate(prompt, max_tokens=args.decode_tokens)
        return result.timings.decode_steps / result.timings.decode_s

    def start_fetch(n: int) -> tuple[subprocess.Popen, Path]:
        cache = Path(tempfile.mkdtemp(prefix=f"fetch-{n}-", dir=plan))
        return subprocess.Popen(["ip", "netns", "exec", args.fetch_namespace, sys.executable, HERE, "--fetcher",
                                 str(plan), "--cache", str(cache)], stdout=subprocess.PIPE, text=True), cache

    async def fetch_done(process: subprocess.Popen) -> dict:
        out, _ = await asyncio.to_thread(process.communicate)
        if process.returncode != 0:
            raise SystemExit(f"a fetch failed ({process.returncode})")
        return json.loads(out.strip().splitlines()[-1])

    try:
        await decode()  # warm-up
        for n in range(args.fetch_only):
            process, _ = start_fetch(n)
            print(json.dumps({"fetch": await fetch_done(process)}), flush=True)
        for r in range(args.rounds):
            for kind in (("alone", "during") if r % 2 == 0 else ("during", "alone")):
                if kind == "alone":
                    print(json.dumps({"alone": await decode()}), flush=True)
                    continue
                process, cache = start_fetch(100 + r)
                while not any(p.stat().st_size for p in cache.glob("*.progress")):  # its first chunk is in
                    await asyncio.sleep(0.05)
                rate = await decode()
                overlapped = process.poll() is None
                print(json.dumps({"during": rate, "overlapped": overlapped, "fetch": await fetch_done(process)}),
                      flush=True)
    finally:
        await client.close()


def across_namespaces(model: Path, args, out: Path) -> dict:
    from netns_support import cap_bandwidth, namespace_hosts, run_in, start_in
    from skippy.launch.local_chain import plan_chain, write_plan

    with namespace_hosts(3) as (a, b, c):
        topology, configs = plan_chain(model, [f"{a.address}:{PORT}", f"{b.address}:{PORT}"], auth_token=TOKEN,
                                       standbys={1: [f"{c.address}:{PORT}"]})
        plan = out / "plan"
        write_plan(topology, configs, plan, tls=True)
        stage1 = start_in(b.namespace, *CLI, "stage", "--config", str(plan / "stage-1.json"), "--topology",
                          str(plan / "topology.json"), "--model", str(model), "--threads", "1",
                          log_path=out / "stage-1.log")
        holder = [sys.executable, HERE, "--holder", str(plan), "--model", str(model), "--fetch-namespace",
                  c.namespace, "--decode-tokens", str(args.decode_tokens)]
        try:
            lines = {}
            for cap, extra in ((None, ["--fetch-only", "1", "--rounds", "0"]),
                               (args.cap_mbps, ["--rounds", str(args.rounds)])):
                cap_bandwidth(a, cap)
                done = run_in(a.namespace, *holder, *extra, timeout=1800)
                if done.returncode != 0:
                    raise SystemExit(f"the holder failed:\n{done.stderr[-3000:]}")
                lines[cap] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        finally:
            stage1.terminate()
            stage1.wait(timeout=60)
    uncapped, capped = lines[None], lines[args.cap_mbps]
    fetches = [line["fetch"] for line in capped if "fetch" in line]
    return {"uncapped_MBps": uncapped[0]["fetch"]["bytes"] / uncapped[0]["fetch"]["seconds"] / 1e6,
            "capped_MBps": [f["bytes"] / f["seconds"] / 1e6 for f in fetches],
            "alone": [line["alone"] for line in capped if "alone" in line],
            "during": [line["during"] for line in capped if "during" in line],
            "overlapped": all(line["overlapped"] for line in capped if "during" in line),
            "share_bytes": fetches[0]["bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the synthetic one)")
    parser.add_argument("--synthetic", type=Path, default=Path(tempfile.gettempdir()) / "skippy-bench-synthetic.gguf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap-mbps", type=float, default=100.0)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--skip", choices=["startup", "netns"], default=None)
    parser.add_argument("--holder", default=None, help=argparse.SUPPRESS)  # the modes this script runs itself in
    parser.add_argument("--fetcher", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fetch-namespace", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fetch-only", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fetcher:
        return asyncio.run(as_fetcher(Path(args.fetcher), args.cache))
    if args.holder:
        return asyncio.run(as_holder(args))
    model = args.model or synthetic_gguf(args.synthetic)
    print(f"model: {model} ({model.stat().st_size / 2**20:.0f} MiB)")
    with tempfile.TemporaryDirectory(prefix="skippy-bench-fetch-") as directory:
        out = Path(directory)
        os.chmod(out, 0o755)
        if args.skip != "startup":
            started = startup(model, args.rounds, out)
            print(f"start-up to ready, median of {args.rounds}: whole file {started['file']:.2f} s, cached slice "
                  f"{started['slice']:.2f} s, slice/file {started['slice'] / started['file']:.3f} "
                  f"(all: {started['all']})")
        if args.skip != "netns":
            result = across_namespaces(model, args, out)
            rate = statistics.median(result["capped_MBps"])
            alone, during = statistics.median(result["alone"]), statistics.median(result["during"])
            print(f"fetch of stage 1's slice ({result['share_bytes'] / 2**20:.0f} MiB of tensors), host a's sends "
                  f"capped at {args.cap_mbps:g} Mbit/s: median {rate:.2f} MB/s = {rate * 8 / args.cap_mbps:.3f} of "
                  f"the cap (each: {[round(r, 2) for r in result['capped_MBps']]}); uncapped veth: "
                  f"{result['uncapped_MBps']:.1f} MB/s")
            print(f"stage 0's decode, {args.decode_tokens} tokens, median of {args.rounds}: alone {alone:.2f} tok/s, "
                  f"while it serves the fetch {during:.2f} tok/s, during/alone {during / alone:.3f} "
                  f"(alone {[round(x, 2) for x in result['alone']]}, during {[round(x, 2) for x in result['during']]}, "
                  f"every decode inside a fetch: {result['overlapped']})")


if __name__ == "__main__":
    main()
