"""Prefill and greedy-decode speed: our runtime against transformers and llama.cpp.

Every engine loads the same GGUF, in a process of its own, and runs the same
prompt token ids on the same number of threads. One round runs each engine once, in turn (round-robin), so
the machine's slow spells fall on all of them alike; the table shows medians
over the rounds, after one warm-up round that is not counted.

    prefill: the prompt in one forward pass, then the argmax of its last row
    decode:  --decode-tokens steps of one token each, greedy (argmax), EOS ignored

    python bench/decode.py                        # bundled SmolLM2, 5 rounds, 2 threads
    python bench/decode.py --rounds 9 --decode-tokens 64 --threads 1 --model PATH.gguf
    python bench/decode.py --model synthetic --engines "ours auto,llama.cpp" --prompt-tokens 512 --rounds 1

`--model synthetic` is bench/synthetic.py's Llama-3.2-3B-shaped Q4_K_M (1.7 GiB, far beyond
the last-level cache). Before the engines load, a probe (kernels/probe.c) reads a 2 GiB
buffer with every thread, 5 passes, and prints the machine's read bandwidth, and the decode floor it
implies: bandwidth / the bytes of the GGUF's tensors a decode step reads (every matmul weight
and the head; the embedding only when it is the tied head). The table's "floor" column is
each engine's decode rate (a median over rounds) as a share of the floor at the best pass;
"floor (median)" as a share of the floor at the passes' median, which compares a median with
a median (the best pass is a moment the engines' rounds rarely all meet).

"ours auto" is the default: the GGUF's quantized weights stay 4-bit (quant.py),
as llama.cpp runs them; "ours no-AMX" is the same with SKIPPY_AMX=0, the prompt on the
AVX512-VNNI path a CPU without AMX takes; "ours bf16" is the same with --prefill-precision bf16
(the prompt's matmuls on AMX-BF16 tiles, decode unchanged). "ours float32"/"float16" and transformers dequantize the
GGUF (float32 is our parity reference).
llama.cpp runs only when `llama_cpp` imports (pip install -e '.[bench-llamacpp]';
it compiles llama.cpp for about ten minutes).

OMP_WAIT_POLICY is not set here: see the note above the imports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion bar
# OMP_WAIT_POLICY is left to the caller. libgomp's default lets idle threads spin a
# moment before they sleep, which suits this bench (one engine runs at a time): with PASSIVE every
# matmul wakes its partner thread from sleep, and a float16 decode step ran 1.7-2x
# slower here (44 ms -> 74-92 ms). On a machine shared with other busy processes
# the spinning costs more than it saves: export OMP_WAIT_POLICY=PASSIVE there.

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from common import resolve_model  # noqa: E402
from skippy.model import qkernel  # noqa: E402
from skippy.model.gguf_file import GGUFFile  # noqa: E402
from skippy.model.llama import Segment  # noqa: E402
from skippy.model.loader import load_stage  # noqa: E402
from skippy.model.locate import bundled_model_path  # noqa: E402
from skippy.model.tokenizer import Tokenizer  # noqa: E402

# Plain prose, repeated until the prompt is long enough: a realistic token mix.
PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "made books cheap enough for merchants, students and craftsmen to own. Within fifty years "
    "presses were running in more than two hundred cities, and the number of books in Europe "
    "grew from thousands to millions. Scholars could compare editions, errors stopped multiplying "
    "with every hand copy, and ideas travelled faster than any courier. "
)

# (numerator, denominator, phase) rows of the ratio table
RATIOS = [
    ("ours auto", "llama.cpp", "decode"),
    ("ours auto", "llama.cpp", "prefill"),
    ("ours auto", "ours no-AMX", "prefill"),
    ("ours no-AMX", "llama.cpp", "prefill"),
    ("ours bf16", "llama.cpp", "prefill"),
    ("ours bf16", "ours auto", "prefill"),
    ("ours bf16", "ours auto", "decode"),
    ("ours auto", "ours float32", "decode"),
    ("ours float32", "transformers float32", "decode"),
    ("ours float32", "transformers float32", "prefill"),
    ("ours float16", "ours float32", "decode"),
    ("ours float16", "llama.cpp", "decode"),
    ("ours float16", "llama.cpp", "prefill"),
    ("ours float32", "llama.cpp", "decode"),
]


@dataclass
class Timings:
    prefill_tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the last round's greedy continuation


class OursEngine:
    def __init__(self, path: Path, dtype: str, amx: bool = True, prefill_precision: str = "exact"):
        if not amx:  # the kernels read it on their first prompt (a CPU without AMX runs this path)
            os.environ["SKIPPY_AMX"] = "0"
        self.model = load_stage(path, dtype=dtype, device="cpu", progress=False, prefill_precision=prefill_precision)

    def prefill(self, prompt: list[int]) -> int:
        self.cache = self.model.new_cache()
        hidden = self.model.forward(torch.tensor(prompt), [Segment(self.cache, 0, len(prompt))])
        return int(self.model.compute_logits(hidden[-1:]).argmax())

    def decode(self, token: int) -> int:
        # greedy as the runner takes it: the step's one kernel call picks the token as it writes
        # the logits (llama.py's step_picks), where it computes them (the float engines: argmax)
        hidden = self.model.forward(torch.tensor([token]), [Segment(self.cache, self.cache.length, 1)],
                                    greedy=[([], [])])
        picked = self.model.step_picks(hidden)
        return picked[0] if picked else int(self.model.compute_logits(hidden).argmax())


class TransformersEngine:
    """A plain loop over the KV cache, like ours: no generate() bookkeeping."""

    def __init__(self, path: Path):
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> int:
        out = self.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        self.cache = out.cache
        return int(out.logits[0, -1].argmax())

    @torch.inference_mode()
    def decode(self, token: int) -> int:
        out = self.model(torch.tensor([[token]]), cache=self.cache, use_cache=True)
        self.cache = out.cache
        return int(out.logits[0, -1].argmax())


class LlamaCppEngine:
    def __init__(self, path: Path, num_threads: int, context: int):
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=context, n_batch=512, n_threads=num_threads,
            n_threads_batch=num_threads, logits_all=False, verbose=False,
        )  # fmt: skip
        self.vocab_size = self.llm.n_vocab()

    def _argmax_last(self) -> int:
        """The greedy token from the last evaluated row's logits, read in place."""
        logits = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)  # float* into llama.cpp's buffer
        return int(np.ctypeslib.as_array(logits, shape=(self.vocab_size,)).argmax())

    def prefill(self, prompt: list[int]) -> int:
        self.llm.reset()  # n_tokens = 0: eval() then drops the old KV rows
        self.llm.eval(prompt)
        return self._argmax_last()

    def decode(self, token: int) -> int:
        self.llm.eval([token])
        return self._argmax_last()


def prompt_ids(path: Path, num_tokens: int) -> list[int]:
    tokenizer = Tokenizer.from_gguf(path)
    ids = tokenizer.encode(PROMPT_TEXT)
    while len(ids) < num_tokens:
        ids += tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    return ids[:num_tokens]


def run_once(engine, prompt: list[int], num_decode: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode seconds, greedy tokens) of one prefill and num_decode steps."""
    started = time.perf_counter()
    tokens = [engine.prefill(prompt)]
    prefilled = time.perf_counter()
    for _ in range(num_decode):
        tokens.append(engine.decode(tokens[-1]))
    return prefilled - started, time.perf_counter() - prefilled, tokens


ENGINES = {
    "ours auto": ("Loading ours auto (quantized)", lambda path, options: OursEngine(path, "auto")),
    "ours no-AMX": ("Loading ours auto, AMX off", lambda path, options: OursEngine(path, "auto", amx=False)),
    "ours bf16": ("Loading ours auto, prompts in bfloat16", lambda path, options: OursEngine(
        path, "auto", prefill_precision="bf16")),
    "ours float32": ("Loading ours float32", lambda path, options: OursEngine(path, "float32")),
    "ours float16": ("Loading ours float16", lambda path, options: OursEngine(path, "float16")),
    "transformers float32": ("Loading transformers float32 (converts the GGUF, ~30 s)",
                             lambda path, options: TransformersEngine(path)),
    "llama.cpp": ("Loading llama.cpp", lambda path, options: LlamaCppEngine(
        path, options.threads, options.prompt_tokens + options.decode_tokens + 16)),
}


class EngineProcess:
    """One engine in a child process of its own. Two OpenMP runtimes in one process
    (torch's libgomp and llama.cpp's own) fight over the cores: llama.cpp inside the
    torch process decoded at about half its own speed on an AVX2 EPYC (51 vs 95-112
    tok/s). Apart, each engine has its process and thread pool to itself, as it has when
    a user runs it."""

    def __init__(self, name: str, options):
        argv = [sys.executable, __file__, "--worker", name, "--model", options.model, "--threads",
                str(options.threads), "--prompt-tokens", str(options.prompt_tokens),
                "--decode-tokens", str(options.decode_tokens)]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {name} worker exited with {self.process.wait()} while loading")

    def run(self, prompt: list[int], num_decode: int) -> tuple[float, float, list[int]]:
        self.process.stdin.write(json.dumps([prompt, num_decode]) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"an engine worker exited with {self.process.wait()}")
        return tuple(json.loads(line))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def worker(options) -> None:
    """--worker NAME: load that engine, then time one run per line of stdin."""
    torch.set_num_threads(options.threads)
    engine = ENGINES[options.worker][1](Path(options.model), options)
    print("ready", flush=True)
    for line in sys.stdin:
        prompt, num_decode = json.loads(line)
        print(json.dumps(run_once(engine, prompt, num_decode)), flush=True)


PROBE_BYTES = 2 << 30  # > 4x this machine's 480 MiB L3


def read_bandwidths() -> list[float]:
    """The machine's read bandwidth in bytes/s with this process's threads, 5 passes, on 2 MiB
    pages as the weights are (weight_arena.py), before any engine holds memory."""
    from skippy.model.weight_arena import WeightArena

    buffer = WeightArena(PROBE_BYTES).empty((PROBE_BYTES,), torch.uint8)
    buffer.fill_(1)  # fault every page in before timing
    return qkernel.read_bandwidths(buffer)


def decode_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors one decode step reads: every matrix but the embedding, whose
    one row a step reads, unless the head is the embedding (tied), which a step reads whole."""
    tensors = GGUFFile(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight" or tied)


def load_engines(options, console: Console) -> dict[str, EngineProcess]:
    names = options.engines
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if "llama.cpp" in names:
            console.print(escape("llama.cpp skipped: llama_cpp is not importable (pip install -e '.[bench-llamacpp]')"))
            names = [n for n in names if n != "llama.cpp"]
    engines = {}
    for name in names:
        with console.status(ENGINES[name][0]):
            engines[name] = EngineProcess(name, options)
    return engines


def results_table(options, results: dict[str, Timings], floor: float, median_floor: float) -> Table:
    reference = results["ours float32" if "ours float32" in results else next(iter(results))].tokens
    table = Table(title=f"medians of {options.rounds} rounds, {options.threads} threads")
    for column in ("engine", "prefill tok/s", "decode tok/s", "decode ms/token", "decode min..max", "floor",
                   "floor (median)", "same tokens"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    for name, t in results.items():
        decode = statistics.median(t.decode_tok_s)
        same = next((i for i, (a, b) in enumerate(zip(t.tokens, reference)) if a != b), len(reference))
        table.add_row(
            name,
            f"{statistics.median(t.prefill_tok_s):.0f}",
            f"{decode:.1f}",
            f"{1000 / decode:.1f}",
            f"{min(t.decode_tok_s):.1f}..{max(t.decode_tok_s):.1f}",
            f"{decode / floor:.0%}",
            f"{decode / median_floor:.0%}",
            f"{same}/{len(reference)}",
        )
    return table


def ratio_table(results: dict[str, Timings]) -> Table:
    table = Table(title="ratios of medians")
    for column in ("ratio", "phase", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for numerator, denominator, phase in RATIOS:
        if numerator in results and denominator in results:
            field_name = f"{phase}_tok_s"
            value = statistics.median(getattr(results[numerator], field_name)) / statistics.median(
                getattr(results[denominator], field_name)
            )
            table.add_row(f"{numerator} / {denominator}", phase, f"{value:.2f}x")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file, or synthetic[:SHAPE[:TYPE]] (bench/synthetic.py; default: "
                                        "the bundled SmolLM2-135M Q4_1)")
    parser.add_argument("--engines", type=lambda s: s.split(","), default=list(ENGINES),
                        help=f"comma-separated, of: {', '.join(ENGINES)} (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (after one warm-up)")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=list(ENGINES), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if unknown := set(options.engines) - set(ENGINES):
        raise SystemExit(f"Expected engines among {list(ENGINES)}, got {sorted(unknown)}")
    options.model = resolve_model(options.model) or str(bundled_model_path())
    path = Path(options.model)
    if path.suffix != ".gguf" or not path.is_file():
        raise SystemExit(f"Expected a .gguf file for --model, got {options.model}")
    if options.worker:
        return worker(options)

    torch.set_num_threads(options.threads)
    console = Console(width=None if sys.stdout.isatty() else 110)  # rich wraps at 80 in a pipe
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "unset (libgomp default)")
    console.print(
        f"model: {path}  threads: {options.threads}  OMP_WAIT_POLICY={wait_policy}  "
        f"torch {torch.__version__}"
    )
    passes, per_token = read_bandwidths(), decode_bytes(path)
    bandwidth, median_bandwidth = max(passes), statistics.median(passes)
    floor, median_floor = bandwidth / per_token, median_bandwidth / per_token
    console.print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s best of {len(passes)} passes, median "
                  f"{median_bandwidth / 1e9:.1f} ({options.threads} threads, probe); a decode step reads "
                  f"{per_token / 1e9:.3f} GB of the file's tensors: floor {floor:.1f} tok/s (at the median "
                  f"{median_floor:.1f})")
    prompt = prompt_ids(path, options.prompt_tokens)
    engines = load_engines(options, console)
    results = {name: Timings() for name in engines}

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("warm-up", total=(options.rounds + 1) * len(engines))
        for round_index in range(options.rounds + 1):
            for name, engine in engines.items():
                label = "warm-up" if round_index == 0 else f"round {round_index}/{options.rounds}"
                progress.update(task, description=f"{label}: {name}")
                prefill_s, decode_s, tokens = engine.run(prompt, options.decode_tokens)
                if round_index:
                    results[name].prefill_tok_s.append(len(prompt) / prefill_s)
                    results[name].decode_tok_s.append(options.decode_tokens / decode_s)
                    results[name].tokens = tokens
                progress.advance(task)
    for engine in engines.values():
        engine.close()

    console.print(
        f"prompt: {len(prompt)} tokens; decode: {options.decode_tokens} tokens, greedy; "
        f"'same tokens': leading tokens equal to ours float32's (prefill's token included)"
    )
    console.print(results_table(options, results, floor, median_floor))
    console.print(ratio_table(results))


if __name__ == "__main__":
    main()
