"""Decode and prefill throughput of 1, 2 and 3 local stages, and the cost of a decode hop.

    python bench/chain.py [--rounds 5] [--threads 2] [--decode-tokens 128] [--prompt-tokens 512]

The rounds interleave the configurations (1, 2, 3, 1, 2, 3, ...), so a noisy
neighbour hurts all of them alike; figures are medians over rounds. Each is
measured in a child process of its own, started for its turn and closed after it
(several runtimes alive at once would each hold an OpenMP team, which throttles them
all: skippy/model/threads.py), with the settings a user gets: one stage as `skippy
serve --stages 1` runs it (libgomp's default spin), N stages as `skippy serve
--stages N` starts them (`LocalChain`: every core per stage, since only one computes
at a time in single-stream decode, and the short co-located spin). Every
configuration runs the default quantized weights. A decode token takes N hops with
the direct return (S0 -> S1 -> ... -> S0), so the end-to-end overhead per hop is
(ms/token with N stages - ms/token with one) / N, in wall time and in CPU time
of all the chain's processes (the CPU figure holds up on a busy machine). The
wire figure is one DecodeEmbd frame and its reply over loopback, no compute.

The floor is what the machine itself charges for a process boundary: the 2-stage split's
two halves called back to back in one process, against the same halves in two processes
whose hop is nothing of ours (a blocking read of the rows, the forward, a write of the
rows or the token, over a socketpair), with the co-located spin as LocalChain sets it.
What 2 stages lose beyond that ratio is our hop's own code; what they lose down to it is
waking a thread, a second OpenMP region and cold caches, which on a 2-core VM cost
~450 us a token with no Python of ours at all.

`--wan-floor 5,20` measures only that floor, with a sleep of each one-way delay (ms) before
every hop's write, in both processes (the one-process loop sleeps both delays a token): what
this machine charges a token across a WAN with nothing of ours on it. Issue 47's WAN floor
is 1 / (back-to-back compute + 2 x delay); a bare loop's ratio to it is the most any chain
can reach here (bench/wan.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from skippy.protocol import (
    MessageKind, StageMessage, StageReply, read_message, read_reply, write_message, write_reply,
)

from common import cpu_seconds, resolve_model

GOAL_RATIO = 0.90  # issue 12: a 2-stage chain keeps >= 0.9x of one process


async def measure(client: ChainClient, pids: list[int], prompt: list[int],
                  decode_tokens: int) -> tuple[float, float, float]:
    """(prefill tokens/s, decode tokens/s, CPU ms per decode token) of one generation.

    Decode CPU is measured on a second, prefill-free run of the decode steps only:
    it counts every process of the chain, so it is what a hop costs in work, which
    other load on the machine does not change."""
    result = await client.generate(prompt, max_tokens=decode_tokens)
    timings = result.timings
    prefill = len(prompt) / timings.first_token_s if timings.first_token_s else float("nan")
    decode = timings.decode_steps / timings.decode_s
    async with client.session(prompt_token_count=8) as session:
        token = await session.prefill(prompt[:8])
        started = cpu_seconds(pids)
        for _ in range(decode_tokens):
            token = await session.decode(token)
        cpu_ms = (cpu_seconds(pids) - started) / decode_tokens * 1e3
    return prefill, decode, cpu_ms


async def wire_hop_us(num_round_trips: int = 2000, width: int = 576) -> float:
    """Half a loopback round trip of DecodeEmbd + PredictedToken, protocol code only."""
    async def echo(reader, writer):
        try:
            while await read_message(reader) is not None:
                await write_reply(writer, StageReply.token(42))
        except asyncio.CancelledError:  # the run ends: no traceback for that
            pass

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    row = np.zeros((1, width), dtype=np.float32)
    msg = StageMessage(MessageKind.DecodeEmbd, pos_start=10, token_count=1, tokens=[42],
                       current_token=42, source_stage_index=0, activation_rows=1,
                       activation_width=width, activation=row.data)
    samples = []
    for _ in range(num_round_trips):
        started = time.perf_counter()
        await write_message(writer, msg)
        await read_reply(reader)
        samples.append(time.perf_counter() - started)
    writer.close()
    server.close()
    return statistics.median(samples) / 2 * 1e6


async def measure_child(n: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """In a child process (see --child): `n` stages (1: a ChainClient holding the whole
    model), warmed up, measured, closed."""
    from skippy.model.threads import spin_for_co_located_stages

    path = Path(args.model)
    if n > 1:
        spin_for_co_located_stages(path)  # before torch loads, as `skippy serve --stages N` does
    import torch

    from skippy.driver.client import ChainClient
    from skippy.launch.local_chain import LocalChain
    from skippy.model.loader import load_stage

    torch.set_num_threads(args.threads)
    prompt = np.random.default_rng(0).integers(100, 40000, size=args.prompt_tokens).tolist()
    if n == 1:
        client, chain, pids = ChainClient(load_stage(path, device="cpu", progress=False), ctx_size=2048), None, []
        await client.start()
    else:
        chain = LocalChain(path, n, threads=args.threads, ctx_size=2048)
        client = await chain.start()
        pids = [process.pid for process in chain.processes]
    try:
        await measure(client, pids, prompt[:64], 8)  # warm-up: first-call allocations, page faults
        return await measure(client, pids, prompt, args.decode_tokens)
    finally:
        await (client.close() if chain is None else chain.close())


def floor_model(processes: int, args: argparse.Namespace) -> Path:
    """The model, with the co-located spin set first where 2 processes share the cores
    (before torch loads, as LocalChain's stages do)."""
    from skippy.model.threads import spin_for_co_located_stages

    path = Path(args.model)
    if processes == 2:
        spin_for_co_located_stages(path)
    return path


def floor_halves(path: Path) -> list[tuple[int, int]]:
    """The layer ranges of the model's 2-stage split, as LocalChain plans it."""
    from skippy.model.loader import model_args
    from skippy.protocol.configs import plan_layer_split

    model = model_args(path)
    return plan_layer_split(model.num_layers, 2, None, model.head_cost_in_layers)


def read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the floor's other process closed the socket")
        data += chunk
    return bytes(data)


def floor_child(processes: int, args: argparse.Namespace) -> float:
    """Decode tok/s of the 2-stage split's halves in one process, or in two (this one runs
    the first half and drives; a peer process, --floor-peer, runs the second)."""
    path = floor_model(processes, args)
    halves, peer = floor_halves(path), None
    if processes == 2:
        mine, theirs = socket.socketpair()
        peer = subprocess.Popen([sys.executable, __file__, "--floor-peer", str(theirs.fileno()),
                                 "--threads", str(args.threads), "--model", args.model,
                                 "--delay-ms", str(args.delay_ms)], pass_fds=[theirs.fileno()])
        theirs.close()
    import torch

    from skippy.model.llama import Segment
    from skippy.model.loader import load_stage

    torch.set_num_threads(args.threads)
    models = [load_stage(path, half, device="cpu", progress=False) for half in (halves if peer is None else halves[:1])]
    prompt = np.random.default_rng(0).integers(100, 40000, size=args.prompt_tokens).tolist()

    delay = args.delay_ms / 1e3  # a one-way trip, slept before each hop's write (never in the prompt's)

    def generate(ids: list[int], steps: int) -> float:
        caches = [model.new_cache() for model in models]
        rows, started = torch.tensor(ids), 0.0
        for step in range(steps + 1):
            if step == 1:
                started = time.perf_counter()  # decode only: the prompt's forward is step 0
            for model, cache in zip(models, caches):
                rows = model.forward(rows, [Segment(cache, cache.length, len(rows))])
            if peer is None:
                token = int(models[-1].compute_logits(rows[-1:] if step == 0 else rows).argmax())
                if step and delay:
                    time.sleep(2 * delay)
            else:
                if step and delay:
                    time.sleep(delay)
                mine.sendall(struct.pack("<i", -len(rows) if step == 0 else len(rows)) + rows.numpy().tobytes())
                (token,) = struct.unpack("<i", read_exactly(mine, 4))
            rows = torch.tensor([token])
        return steps / (time.perf_counter() - started)

    try:
        generate(prompt[:64], 8)  # warm-up: first-call allocations, page faults
        return generate(prompt, args.decode_tokens)
    finally:
        if peer is not None:
            mine.sendall(struct.pack("<i", 0))
            peer.wait()


def floor_peer(fd: int, args: argparse.Namespace) -> None:
    """The floor's second process: the split's second half, read rows -> forward -> write the token."""
    path = floor_model(2, args)
    halves = floor_halves(path)
    import torch

    from skippy.model.llama import Segment
    from skippy.model.loader import load_stage

    torch.set_num_threads(args.threads)
    model = load_stage(path, halves[1], device="cpu", progress=False)
    sock, cache = socket.socket(fileno=fd), None
    while (count := struct.unpack("<i", read_exactly(sock, 4))[0]) != 0:
        if count < 0:  # a prompt: a new session
            cache, count = model.new_cache(), -count
        rows = torch.frombuffer(bytearray(read_exactly(sock, count * model.args.hidden_size * 4)),
                                dtype=torch.float32).view(count, model.args.hidden_size)
        hidden = model.forward(rows, [Segment(cache, cache.length, count)])
        token = int(model.compute_logits(hidden[-1:] if count > 1 else hidden).argmax())
        if count == 1 and args.delay_ms:
            time.sleep(args.delay_ms / 1e3)
        sock.sendall(struct.pack("<i", token))


def measure_one(n: int | str, args: argparse.Namespace, delay_ms: float = 0.0) -> tuple[float, ...]:
    env = dict(os.environ)
    if not args.user_spin:  # each child sets its own, as serve does (none for one stage)
        env.pop("GOMP_SPINCOUNT", None)
    command = [sys.executable, __file__, "--child", str(n), "--threads", str(args.threads),
               "--decode-tokens", str(args.decode_tokens), "--prompt-tokens", str(args.prompt_tokens),
               "--model", args.model, "--delay-ms", str(delay_ms)]
    out = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def wan_floor(args: argparse.Namespace) -> None:
    """--wan-floor: per one-way delay, the bare loop's tok/s against issue 47's floor."""
    cells = {name: [] for d in args.wan_floor for name in ((1, 0.0), (1, d), (2, d))}
    for round_index in range(args.rounds):
        for processes, delay in cells:
            cells[processes, delay].append(measure_one(f"floor{processes}", args, delay)[0])
        print(f"round {round_index + 1}/{args.rounds}: " + "  ".join(
            f"{p} process{'es' * (p > 1)} {d:g} ms {v[-1]:.1f}" for (p, d), v in cells.items()), flush=True)
    tok_s = {cell: statistics.median(values) for cell, values in cells.items()}
    compute = 1 / tok_s[1, 0.0]  # back to back in one process: what the stages' probes time
    print(f"\nthe 2-stage split's halves, nothing of ours on a hop, {args.decode_tokens} decode tokens, medians of "
          f"{args.rounds} interleaved rounds; back to back in one process {compute * 1e3:.2f} ms a token")
    for d in args.wan_floor:
        floor = 1 / (compute + 2 * d / 1e3)
        one, two = tok_s[1, d], tok_s[2, d]
        print(f"{d:g} ms one way: floor 1/(compute + 2 x delay) {floor:.1f} tok/s; one process sleeping the delays "
              f"{one:.1f} ({one / floor:.2f}), two processes {two:.1f} ({two / floor:.2f} of the floor; "
              f"{1e3 / two - 2 * d:.2f} ms a token beside the delays)")


async def main(args: argparse.Namespace) -> None:
    results: dict[int, list[tuple[float, float, float]]] = {n: [] for n in (1, 2, 3)}
    floors: dict[str, list[float]] = {"floor1": [], "floor2": []}
    for round_index in range(args.rounds):
        for n in results:
            results[n].append(measure_one(n, args))
        for name in floors:
            floors[name].append(measure_one(name, args)[0])
        print(f"round {round_index + 1}/{args.rounds}: " + "  ".join(
            f"{n} stage{'s' * (n > 1)} {results[n][-1][1]:.1f} tok/s" for n in results)
            + f"  floor: 1 process {floors['floor1'][-1]:.1f}, 2 processes {floors['floor2'][-1]:.1f} tok/s",
            flush=True)
    hop_us = await wire_hop_us()

    decode = {n: statistics.median(r[1] for r in results[n]) for n in results}
    prefill = {n: statistics.median(r[0] for r in results[n]) for n in results}
    cpu = {n: statistics.median(r[2] for r in results[n]) for n in results}
    print(f"\nbundled SmolLM2-135M, torch threads {args.threads} per stage, prompt "
          f"{args.prompt_tokens} tokens (chunks of 256), {args.decode_tokens} decode tokens, "
          f"{args.rounds} interleaved rounds (medians), load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'stages':>6} {'decode tok/s':>13} {'vs 1':>6} {'ms/token':>9} {'hop (wall)':>11} "
          f"{'CPU ms/token':>13} {'hop (CPU)':>10} {'prefill tok/s':>14} {'vs 1':>6}")
    for n in sorted(decode):
        ms_per_token = 1e3 / decode[n]
        wall_hop = "" if n == 1 else f"{(ms_per_token - 1e3 / decode[1]) / n * 1e3:.0f} us"
        cpu_hop = "" if n == 1 else f"{(cpu[n] - cpu[1]) / n * 1e3:.0f} us"
        print(f"{n:>6} {decode[n]:>13.1f} {decode[n] / decode[1]:>6.2f} {ms_per_token:>9.2f} "
              f"{wall_hop:>11} {cpu[n]:>13.2f} {cpu_hop:>10} {prefill[n]:>14.1f} "
              f"{prefill[n] / prefill[1]:>6.2f}")
    print(f"wire hop (DecodeEmbd frame + reply over loopback, no compute): {hop_us:.0f} us")
    floor = {name: statistics.median(values) for name, values in floors.items()}
    print(f"floor (the 2-stage split's halves, nothing of ours on a hop): one process {floor['floor1']:.1f} "
          f"tok/s, two processes {floor['floor2']:.1f} tok/s: {floor['floor2'] / floor['floor1']:.0%}")
    ratio = decode[2] / decode[1]
    verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
    print(f"goal: 2 stages keep >= {GOAL_RATIO:.0%} of one process's decode tok/s: "
          f"{ratio:.0%} ({verdict}); this machine's floor: {floor['floor2'] / floor['floor1']:.0%}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=resolve_model, default=None,
                        help="GGUF file, or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in every stage")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--floor-peer", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)  # a floor child's one-way delay
    parser.add_argument("--wan-floor", type=lambda t: [float(x) for x in t.split(",") if x], default=None,
                        help="only the bare floor, at these one-way delays (ms), against issue 47's WAN floor")
    args = parser.parse_args()
    if args.model is None:
        from skippy.model.locate import bundled_model_path

        args.model = str(bundled_model_path())
    args.user_spin = "GOMP_SPINCOUNT" in os.environ
    if args.floor_peer >= 0:
        floor_peer(args.floor_peer, args)
    elif args.child.startswith("floor"):
        print(json.dumps([floor_child(int(args.child[len("floor"):]), args)]))
    elif args.child:
        print(json.dumps(asyncio.run(measure_child(int(args.child), args))))
    elif args.wan_floor:
        wan_floor(args)
    else:
        asyncio.run(main(args))
