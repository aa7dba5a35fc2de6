"""A fuzz of a live chain's final stage with hostile protocol-v5 frames (issue 43).

    python bench/fuzz_stage.py                  # 10,000 frames (a few minutes on 2 cores)
    python bench/fuzz_stage.py --frames 300     # tests/test_stage_fuzz.py's short run

A real chain (`skippy plan` for 2 stages on loopback, `skippy stage` for the final stage,
`skippy serve --topology` for stage 0 and the API) is fuzzed through the final stage's port,
with the chain's token, on one fresh connection per case: mutated frames (bit flips,
truncations, lengths past the limits, kinds out of order, unknown sessions, windows of stopped
sessions) and well-formed frames a peer may send and the API never does (non-finite rows, ±inf
and out-of-vocabulary biases, out-of-vocabulary history with penalties and under prompt
logprobs, session ids given a new request, the largest decode_step, grammars that do not
compile or leave nothing to sample, counts past the stage's bounds). Meanwhile a user streams
seeded sampled completions through the API, and a peer keeps sending rows with infinities, so
both share the final stage's waves.

It checks, and exits 1 unless all hold: the stage is alive and answers; every reply decodes and
no connection is left owing one (the stage answers or closes within the timeout); the API is
healthy and answers as before; the user's completions equal its run alone, with no lane of
stage 0 broken or replayed; the stage's sessions and connections and stage 0's return streams
are back to their counts before; the stage logged every close as one WARNING line, nothing at
ERROR, no traceback; and decode_step = 2^31 - 1 is served with the stage's peak RSS within 5%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from stage_peer import K, Peer, ReplyOwed, Request, established, expect

from skippy.protocol import ActivationDtype, ProtocolError, SamplingConfig, StageMessage, encode_message
from skippy.protocol.constants import MESSAGE_HEADER_FIELDS, GrammarKind, ReplyKind, header_offset
from skippy.protocol.sampling_config import GrammarSpec

WIDTH = 576        # SmolLM2-135M's hidden size: the rows stage 0 sends the final stage
CTX, LANES = 1024, 64
READ_TIMEOUT_S = 30.0
USER = dict(temperature=0.7, seed=7, max_tokens=16, logit_bias={"0": -100, "2": -100})  # never stops early
# header fields whose values bound what the reader allocates or checks, and values past the limits
LENGTH_FIELDS = [("activation_bytes", "Q"), ("token_count", "i"), ("token_sideband_count", "i"),
                 ("position_sideband_count", "i"), ("activation_rows", "i"), ("activation_width", "i"),
                 ("sampling_bytes", "I"), ("metadata_bytes", "I"), ("pos_start", "i"), ("seq_id", "i"),
                 ("prompt_token_count", "i"), ("decode_step", "i")]
EXTREMES = {"Q": [1 << 40, (1 << 64) - 1], "i": [-1, -(1 << 31), (1 << 31) - 1, 1 << 24],
            "I": [1 << 24, (1 << 32) - 1]}


# -- the chain ------------------------------------------------------------------------------
@dataclass
class Chain:
    workdir: Path
    stage: subprocess.Popen
    serve: subprocess.Popen
    url: str            # the API, http://host:port
    endpoint: str       # the final stage's
    token: str
    return_port: int    # stage 0's listener: the final stage's return streams end there

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def wait_for_line(process: subprocess.Popen, pattern: str, what: str, timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    for line in process.stdout:
        if re.search(pattern, line):
            return line
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"{what} exited or timed out before it was ready (code {process.poll()})")


def start_chain(workdir: Path) -> Chain:
    """2 stages of the bundled model on loopback, the final one a process of its own."""
    cli = [sys.executable, "-m", "skippy.cli"]
    ports = free_ports(2)
    subprocess.run([*cli, "plan", "--stages", "2", "--hosts", ",".join(f"127.0.0.1:{p}" for p in ports),
                    "--out", str(workdir), "--ctx-size", str(CTX), "--lane-count", str(LANES)],
                   check=True, stdout=subprocess.DEVNULL)
    config = json.loads((workdir / "stage-1.json").read_text())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stage = subprocess.Popen([*cli, "--log-level", "INFO", "stage", "--config", str(workdir / "stage-1.json"),
                              "--topology", str(workdir / "topology.json")], stdout=subprocess.PIPE,
                             stderr=open(workdir / "stage.log", "w"), text=True, env=env)
    serve = None
    try:
        wait_for_line(stage, "skippy: stage ready:", "the final stage")
        serve = subprocess.Popen([*cli, "--log-level", "INFO", "serve", "--port", "0", "--topology",
                                  str(workdir / "topology.json")], stdout=subprocess.PIPE,
                                 stderr=open(workdir / "serve.log", "w"), text=True, env=env)
        url = re.search(r"ready: (http://\S+)/v1 ", wait_for_line(serve, r"skippy: ready: ", "skippy serve")).group(1)
    except BaseException:
        for process in (stage, serve):
            if process is not None:
                process.kill()
        raise
    return Chain(workdir, stage, serve, url, f"127.0.0.1:{ports[1]}", config["auth_token"], ports[0])


def stop_chain(chain: Chain) -> None:
    for process in (chain.serve, chain.stage):
        process.terminate()
    for process in (chain.serve, chain.stage):
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident set (VmHWM), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


# -- the frames -----------------------------------------------------------------------------
def rows(n: int, seed: int, dtype=np.float32, value: float | None = None) -> memoryview:
    data = np.random.default_rng(seed).standard_normal((n, WIDTH), dtype=np.float32)
    if value is not None:
        data[n - 1, seed % WIDTH] = value
    if dtype == "bf16":
        return (data.view(np.uint32) >> 16).astype(np.uint16).data
    return data.astype(dtype).data


def patched(frame: bytes, offset: int, fmt: str, value: int) -> bytes:
    return frame[:offset] + struct.pack("<" + fmt, value) + frame[offset + struct.calcsize(fmt):]


def header(frame: bytes, name: str, value: int) -> bytes:
    spec = next(f for f in MESSAGE_HEADER_FIELDS if f.name == name)
    return patched(frame, header_offset(MESSAGE_HEADER_FIELDS, name), spec.fmt, value)


def valid_frames(session_id: int, rng: np.random.Generator, sampling: SamplingConfig) -> list[StageMessage]:
    """One frame of every kind a stage executes, for `session_id`, in the order a well-behaved
    stage 0 would send them."""
    n = int(rng.integers(1, 4))
    ids = dict(request_id=session_id, session_id=session_id)
    return [
        StageMessage(K.ConfigureGeneration, sampling=sampling, prompt_token_count=n + 1, **ids),
        StageMessage(K.PrefillEmbd, pos_start=0, token_count=n, tokens=list(range(1, n + 1)), activation_rows=n,
                     activation_width=WIDTH, activation=rows(n, n), **ids),
        StageMessage(K.PrefillFinalEmbd, pos_start=n, token_count=1, tokens=[5], activation_rows=1,
                     activation_width=WIDTH, activation=rows(1, 1), prompt_token_count=n + 1, **ids),
        StageMessage(K.DecodeEmbd, pos_start=n + 1, token_count=1, tokens=[6], current_token=6, decode_step=1,
                     activation_rows=1, activation_width=WIDTH, activation=rows(1, 2), **ids),
        StageMessage(K.VerifyWindow, pos_start=n + 2, token_count=2, tokens=[7, 8], current_token=7, seq_id=4,
                     activation_rows=2, activation_width=WIDTH, activation=rows(2, 3), **ids),
        StageMessage(K.RetireVerifyWindow, pos_start=n + 2, token_count=1, **ids),
        StageMessage(K.DiscardStaleWindows, tokens=[4, 5], **ids),
        StageMessage(K.TrimSession, token_count=n, **ids),
        StageMessage(K.TryRestorePrefill, token_count=n, tokens=list(range(1, n + 1)), **ids),
        StageMessage(K.GetStageStatus),
        StageMessage(K.Stop, **ids),
    ]


HOT = SamplingConfig(temperature=0.7, seed=3)
SAMPLINGS = [  # sampling blocks a peer may send and the API never does; each decodes
    HOT,
    SamplingConfig(temperature=0.9, top_p=0.8, logit_bias={77: math.inf}),
    SamplingConfig(temperature=0.9, logit_bias={5: -math.inf, 6: math.inf, 7: math.inf}),
    SamplingConfig(temperature=0.7, logit_bias={1_000_000: 1.0}),
    SamplingConfig(temperature=0.7, repetition_penalty=1.3, frequency_penalty=2.0, penalty_last_n=-1),
    SamplingConfig(logprobs=20, prompt_logprobs=True),
    SamplingConfig(temperature=0.7, seed=1, grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, '{"enum": ["a"]}'),
                   logit_bias={18: -math.inf}),  # the grammar allows token 18 alone; the bias bans it
    SamplingConfig(grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, "{not json")),
    SamplingConfig(grammar=GrammarSpec(GrammarKind.LARK, "start: ")),
    SamplingConfig(grammar=GrammarSpec(GrammarKind.JSON_OBJECT)),
    SamplingConfig(temperature=1e-300, top_k=1 << 30, min_p=1.0, presence_penalty=-1e300),
]
CLASSES = ("bit_flip", "truncation", "length_past_limit", "out_of_order", "unknown_session", "stale_window",
           "hostile_sampling", "non_finite_rows", "out_of_vocabulary", "new_request", "decode_step",
           "past_bounds")


def case(index: int) -> tuple[str, list[bytes]]:
    """(class, the frames of one connection) for fuzz case `index`."""
    rng = np.random.default_rng(index)
    session_id = 1000 + index
    kind = CLASSES[index % len(CLASSES)]
    sampling = SAMPLINGS[int(rng.integers(len(SAMPLINGS)))] if kind == "hostile_sampling" else HOT
    messages = valid_frames(session_id, rng, sampling)
    frames = [encode_message(m) for m in messages]
    configure, body = frames[0], frames[1:]
    pick = lambda items: items[int(rng.integers(len(items)))]  # noqa: E731
    if kind == "bit_flip":
        frame = bytearray(pick(frames))
        for _ in range(int(rng.integers(1, 5))):
            frame[int(rng.integers(len(frame)))] ^= 1 << int(rng.integers(8))
        return kind, [configure, bytes(frame)]
    if kind == "truncation":
        frame = pick(frames)
        return kind, [configure, frame[:int(rng.integers(1, len(frame)))]]
    if kind == "length_past_limit":
        name, fmt = pick(LENGTH_FIELDS)
        return kind, [configure, header(pick(body), name, pick(EXTREMES[fmt]))]
    if kind == "out_of_order":
        order = rng.permutation(len(frames))
        return kind, [frames[i] for i in order[:int(rng.integers(1, len(frames) + 1))]]
    if kind == "unknown_session":
        other = [encode_message(m) for m in valid_frames(session_id + 500_000, rng, HOT)[1:]]
        return kind, [configure, pick(other)]
    if kind == "stale_window":
        return kind, [configure, frames[2], frames[-1], pick([frames[4], frames[3], frames[5]])]
    if kind == "hostile_sampling":  # the whole request under a sampling block the API refuses
        return kind, frames[:4] + [pick([frames[4], frames[7]]), frames[-1]]
    if kind == "non_finite_rows":
        dtype, code = pick([(np.float32, ActivationDtype.f32), (np.float16, ActivationDtype.f16),
                            ("bf16", ActivationDtype.bf16)])
        value = pick([math.inf, -math.inf, math.nan])
        decode = dataclasses.replace(messages[3], activation=rows(1, index, dtype, value), activation_dtype=code)
        return kind, frames[:3] + [encode_message(decode)]
    if kind == "out_of_vocabulary":
        bad = pick([49_152, 1_000_000, 2**31 - 1, -5])
        chosen = pick(["decode", "prompt"])
        if chosen == "decode":
            decode = dataclasses.replace(messages[3], tokens=[bad], current_token=bad)
            return kind, frames[:3] + [encode_message(decode)]
        configure = dataclasses.replace(messages[0], sampling=pick(SAMPLINGS[4:6]))  # penalties, prompt logprobs
        return kind, [encode_message(configure), encode_message(dataclasses.replace(messages[2], tokens=[bad]))]
    if kind == "new_request":  # the session id given another request, with or without a configure
        again = [encode_message(dataclasses.replace(m, request_id=session_id + 1)) for m in messages]
        return kind, frames[:3] + pick([again[:1], again[:3], again[2:3], again[:1] + [frames[-1]]])
    if kind == "decode_step":
        return kind, [header(configure, "decode_step", pick([2**31 - 1, -1, 2**27])), frames[2], frames[-1]]
    # past_bounds: windows too wide or too many, discards spammed, prompt past the context
    n = int(rng.integers(3))
    if n == 0:
        wide = dataclasses.replace(messages[4], token_count=66, tokens=[7] * 66, activation_rows=66,
                                   activation=rows(66, 9))
        return kind, frames[:3] + [encode_message(wide)]
    if n == 1:
        discards = [encode_message(dataclasses.replace(messages[6], tokens=[w, w])) for w in range(130)]
        return kind, frames[:3] + discards + [frames[4]]
    return kind, [header(configure, "prompt_token_count", CTX + 1), frames[2]]


# -- running it -----------------------------------------------------------------------------
@dataclass
class Tally:
    classes: Counter = field(default_factory=Counter)
    frames: int = 0
    replies: Counter = field(default_factory=Counter)
    closed_early: int = 0   # connections the stage closed before our half-close read ended
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_case(chain: Chain, index: int, tally: Tally) -> None:
    kind, frames = case(index)
    try:
        with Peer(chain.endpoint, chain.token, timeout_s=READ_TIMEOUT_S) as peer:
            sent = sum(peer.send(frame) for frame in frames)
            replies = peer.replies_until_close()
    except (ReplyOwed, AssertionError, ProtocolError) as error:  # owed, cut off, or malformed (FrameError)
        with tally.lock:
            tally.failures.append(f"case {index} ({kind}): {type(error).__name__}: {error}")
        return
    with tally.lock:
        tally.classes[kind] += 1
        tally.frames += len(frames)
        tally.closed_early += sent < len(frames)
        tally.replies.update(reply.kind.name for reply in replies)


def spam_infinities(chain: Chain, stop: threading.Event, counts: Counter) -> None:
    """A peer sending decode rows with infinities at temperature 0.7, for as long as the user streams."""
    index = 0
    while not stop.is_set():
        request = Request(900_000 + index, WIDTH, HOT)
        with Peer(chain.endpoint, chain.token, timeout_s=READ_TIMEOUT_S) as peer:
            peer.send(request.configure())
            expect(peer.reply(), ReplyKind.Ack)
            peer.send(request.prompt())   # its token goes to stage 0's listener, which drops it
            peer.send(dataclasses.replace(request.decode(0, 5), activation=rows(1, index, value=math.inf)))
            counts["closed" if peer.replies_until_close() == [] else "answered"] += 1
        index += 1


def chat(url: str, **fields) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}], **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def user_stream(chain: Chain, alone: str, stop: threading.Event, results: list) -> None:
    """The user beside the fuzz: seeded sampled completions through the API, each compared to its run alone."""
    while not stop.is_set():
        results.append(chat(chain.url, **USER)["choices"][0]["message"]["content"] == alone)


def status(chain: Chain):
    with Peer(chain.endpoint, chain.token) as peer:
        return peer.status()


def counts_now(chain: Chain) -> dict:
    report = status(chain)
    return {"sessions": report.active_sessions, "connections": report.metrics.gauges["connections"],
            "return_streams": established(chain.return_port)}


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def settle(chain: Chain, before: dict, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while (now := counts_now(chain)) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


def decode_step_probe(chain: Chain) -> dict:
    """ConfigureGeneration with decode_step = 2^31 - 1 and a sampled prompt: served, and the
    stage's peak RSS stays where it was."""
    pid = chain.stage.pid
    before = peak_rss_kib(pid)
    request = Request(777, WIDTH, SamplingConfig(temperature=1.0, seed=5))
    with Peer(chain.endpoint, chain.token) as peer:
        started = time.perf_counter()
        peer.send(header(encode_message(request.configure()), "decode_step", 2**31 - 1))
        expect(peer.reply(), ReplyKind.Ack)
        configure_s = time.perf_counter() - started
        peer.send(request.prompt(), request.stop())
        expect(peer.reply(), ReplyKind.Ack)  # the token went to stage 0; Stop's ACK follows it
    after = peak_rss_kib(pid)
    return {"peak_rss_before_kib": before, "peak_rss_after_kib": after, "ratio": after / before,
            "configure_s": configure_s}


def run(num_frames: int, workers: int, workdir: Path, progress=print) -> dict:
    """Start a chain, fuzz it, stop it; the report, with `failures` (empty when every check held)."""
    chain = start_chain(workdir)
    try:
        return fuzz(chain, num_frames, workers, progress)
    finally:
        stop_chain(chain)


def fuzz(chain: Chain, num_frames: int, workers: int, progress=print) -> dict:
    greedy = chat(chain.url, max_tokens=12, temperature=0)["choices"][0]["message"]["content"]
    alone = chat(chain.url, **USER)["choices"][0]["message"]["content"]  # the user's run alone
    stage_log_start = len(chain.log("stage"))
    serve_log_start = len(chain.log("serve"))
    recoveries = metric(chain.url, "skippy_chain_recoveries_total")
    before = counts_now(chain)
    batches_before = status(chain).metrics.histograms["batch_steps"].counts
    probe = decode_step_probe(chain)

    tally, stop, spam, user = Tally(), threading.Event(), Counter(), []
    side = [threading.Thread(target=spam_infinities, args=(chain, stop, spam), daemon=True),
            threading.Thread(target=user_stream, args=(chain, alone, stop, user), daemon=True)]
    for thread in side:
        thread.start()
    started, index, reported = time.monotonic(), 0, 0
    with ThreadPoolExecutor(workers) as pool:
        while tally.frames < num_frames and not tally.failures:
            batch = list(range(index, index + 4 * workers))
            index += len(batch)
            list(pool.map(lambda i: run_case(chain, i, tally), batch))
            if tally.frames - reported >= 1000:
                reported = tally.frames
                progress(f"  {tally.frames} frames, {sum(tally.classes.values())} connections, "
                         f"{time.monotonic() - started:.0f} s")
    while len(user) < 2 and not tally.failures:  # the user saw the fuzz through at least twice
        time.sleep(0.2)
    stop.set()
    for thread in side:
        thread.join(180)
    elapsed = time.monotonic() - started

    failures = list(tally.failures)
    if chain.stage.poll() is not None:
        failures.append(f"the final stage exited with {chain.stage.returncode}")
    after = settle(chain, before)
    if after != before:
        failures.append(f"counts before {before}, after {after}")
    if httpx.get(f"{chain.url}/readyz", timeout=30).status_code != 200:
        failures.append("/readyz is not 200")
    if chat(chain.url, max_tokens=12, temperature=0)["choices"][0]["message"]["content"] != greedy:
        failures.append("the API's greedy answer changed")
    if not user or not all(user):
        failures.append(f"the user's completions beside the fuzz: {user.count(True)} of {len(user)} as alone")
    if metric(chain.url, "skippy_chain_recoveries_total") != recoveries:
        failures.append("stage 0 replayed a generation (a lane broke)")
    if spam["closed"] == 0 or spam["answered"]:
        failures.append(f"the rows with infinities: {dict(spam)} (each must be refused)")
    stage_log = chain.log("stage")[stage_log_start:]
    serve_log = chain.log("serve")[serve_log_start:]
    closes = [line for line in stage_log.splitlines() if "closing connection" in line]
    if any("level=WARNING" not in line for line in closes):
        failures.append(f"a close not logged as a WARNING: {next(l for l in closes if 'level=WARNING' not in l)}")
    for name, text in (("stage", stage_log), ("serve", serve_log)):
        if "Traceback" in text or "level=ERROR" in text:
            failures.append(f"the {name} log holds an ERROR or a traceback")
    if "replaced" in serve_log:
        failures.append("a lane of stage 0 was replaced")
    if probe["ratio"] > 1.05:
        failures.append(f"decode_step 2^31-1 raised the stage's peak RSS {probe['ratio']:.3f}x")
    batches_after = status(chain).metrics.histograms["batch_steps"].counts
    shared = sum(batches_after[1:]) - sum(batches_before[1:])
    reasons = Counter(re.sub(r"\d+", "N", line.split("closing connection ", 1)[1].split(": ", 1)[1])[:80]
                      for line in closes)
    return {"frames": tally.frames, "connections": sum(tally.classes.values()), "classes": dict(tally.classes),
            "replies": dict(tally.replies), "closed_before_all_frames_sent": tally.closed_early,
            "stage_closes_logged": len(closes), "close_reasons": dict(reasons.most_common(12)),
            "counts_before": before, "counts_after": after, "user_completions": len(user),
            "infinity_rows": dict(spam), "forwards_with_2_or_more_steps": shared,
            "decode_step_probe": probe, "seconds": round(elapsed, 1), "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="skippy-fuzz-") as workdir:
        report = run(args.frames, args.workers, Path(workdir))
    print(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
