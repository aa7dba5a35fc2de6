"""Accuracy of our weight formats against transformers float32 and llama.cpp on one GGUF.

Two figures per engine, both against references nobody here wrote:

    agreement:  transformers float32 greedily continues 5 chat prompts by --tokens
                tokens; every engine then reads those same sequences (teacher-forced)
                and we count how often its argmax equals transformers' next token.
    perplexity: exp(mean negative log-likelihood) over a fixed text of --ppl-tokens
                tokens (the docstrings of a few standard-library modules, so the
                text is the same on every machine with this Python).

    python bench/accuracy.py                       # bundled SmolLM2 Q4_1
    python bench/accuracy.py --tokens 64 --ppl-tokens 1024 --model PATH.gguf

"ours auto, prefill bf16" is the default weights with `--prefill-precision bf16`: every chunk
of a sequence (CHUNK rows) on the bfloat16 prompt path.

The wire dtypes (`--activation-dtype`: f32, f16, q8) are scored on the model cut into
--stages stages, each boundary's rows through the runner's own conversion; f32 there is the
one-process model bit for bit, so f16 and q8 against it are what the wire alone costs.

llama.cpp runs only when `llama_cpp` imports (pip install -e '.[bench-llamacpp]').
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from common import resolve_model  # noqa: E402
from skippy.model.llama import Segment  # noqa: E402
from skippy.model.loader import load_stage, model_args  # noqa: E402
from skippy.model.locate import bundled_model_path  # noqa: E402
from skippy.model.tokenizer import Tokenizer  # noqa: E402
from skippy.protocol import ActivationDtype, plan_layer_split  # noqa: E402
from skippy.runtime.runner import rows_to_tensor, tensor_to_rows  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in one sentence why the sky is blue.",
    "Tell me a short story about a lighthouse keeper.",
    "List three colours of the rainbow.",
]
CHUNK = 512  # rows per forward when scoring long text


TEXT_MODULES = ("argparse", "json", "logging", "subprocess", "unittest", "string", "textwrap", "csv", "heapq")


def perplexity_text() -> str:
    return "\n\n".join(inspect.getdoc(importlib.import_module(name)) for name in TEXT_MODULES)


class Ours:
    def __init__(self, path: Path, dtype: str, prefill_precision: str = "exact"):
        self.model = load_stage(path, dtype=dtype, device="cpu", progress=False, prefill_precision=prefill_precision)

    def logits(self, ids: list[int]) -> torch.Tensor:
        """float32 [len(ids), vocab]: the next-token logits after every position."""
        cache, rows = self.model.new_cache(len(ids)), []
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            hidden = self.model.forward(torch.tensor(chunk), [Segment(cache, start, len(chunk))])
            rows.append(self.model.compute_logits(hidden))
        return torch.cat(rows)


class Staged:
    """Ours (weights as stored) cut into stages at the equal-bytes split, every boundary's rows
    sent through the wire codec (the runner's own conversion): what `--activation-dtype`
    costs a chain."""

    def __init__(self, path: Path, wire: str, num_stages: int):
        args = model_args(path)
        ranges = plan_layer_split(args.num_layers, num_stages, None, args.head_cost_in_layers)
        self.stages = [load_stage(path, r, dtype="auto", device="cpu", progress=False) for r in ranges]
        self.wire = ActivationDtype[wire]

    def logits(self, ids: list[int]) -> torch.Tensor:
        caches, rows = [stage.new_cache(len(ids)) for stage in self.stages], []
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            x = torch.tensor(chunk)
            for i, (stage, cache) in enumerate(zip(self.stages, caches)):
                if i:  # what crosses the link: the rows in the wire dtype, and back to float32
                    x = rows_to_tensor(tensor_to_rows(x, self.wire).copy(), self.wire)
                x = stage.forward(x, [Segment(cache, start, len(chunk))])
            rows.append(self.stages[-1].compute_logits(x))
        return torch.cat(rows)


class Transformers:
    def __init__(self, path: Path):
        import transformers

        transformers.logging.set_verbosity_error()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids])).logits[0].float()

    @torch.inference_mode()
    def greedy(self, ids: list[int], num_tokens: int) -> list[int]:
        out = self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        tokens = [int(out.logits[0, -1].argmax())]
        while len(tokens) < num_tokens:
            out = self.model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        return tokens


class LlamaCpp:
    def __init__(self, path: Path, context: int, threads: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=context, n_batch=CHUNK, n_threads=threads,
                                   n_threads_batch=threads, logits_all=True, verbose=False)

    def logits(self, ids: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(ids)
        return torch.from_numpy(np.array(self.llm.scores[: len(ids)], dtype=np.float32))


def agreement(engine, sequences: list[tuple[list[int], list[int]]]) -> float:
    matches = total = 0
    for prompt, continuation in sequences:
        logits = engine.logits(prompt + continuation[:-1])
        predicted = logits[len(prompt) - 1 :].argmax(-1)
        matches += int((predicted == torch.tensor(continuation)).sum())
        total += len(continuation)
    return matches / total


def perplexity(engine, ids: list[int]) -> float:
    logits = engine.logits(ids[:-1])
    nll = torch.nn.functional.cross_entropy(logits.double(), torch.tensor(ids[1:]))
    return float(nll.exp())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=resolve_model,
                        help="GGUF file or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2-135M Q4_1)")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens per prompt")
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--wire", type=lambda t: t.split(","), default=["f32", "f16", "q8"],
                        help="activation dtypes between stages to score (comma-separated; none: '')")
    parser.add_argument("--stages", type=int, default=2, help="stages the wire dtypes are scored over")
    options = parser.parse_args()
    path = Path(options.model or bundled_model_path())
    torch.set_num_threads(options.threads)
    console = Console(width=None if sys.stdout.isatty() else 110)
    tokenizer = Tokenizer.from_gguf(path)
    text_ids = tokenizer.encode(perplexity_text())[: options.ppl_tokens]
    if len(text_ids) < options.ppl_tokens:
        raise SystemExit(f"the text has only {len(text_ids)} tokens; ask for fewer with --ppl-tokens")

    with console.status("transformers float32: loading (converts the GGUF, ~30 s) and continuing the prompts"):
        reference = Transformers(path)
        prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        sequences = [(p, reference.greedy(p, options.tokens)) for p in prompts]

    engines = {"transformers float32": lambda: reference}
    for dtype in ("float32", "auto", "bfloat16"):
        engines[f"ours {dtype}"] = lambda dtype=dtype: Ours(path, dtype)
    # --prefill-precision bf16: every chunk of 64 rows or more on AMX-BF16 tiles (where the CPU has them)
    engines["ours auto, prefill bf16"] = lambda: Ours(path, "auto", prefill_precision="bf16")
    for wire in filter(None, options.wire):
        engines[f"ours auto, {options.stages} stages, {wire} wire"] = (
            lambda wire=wire: Staged(path, wire, options.stages))
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        console.print("llama.cpp skipped: llama_cpp is not importable (pip install -e '.[bench-llamacpp]')")
    else:
        engines["llama.cpp"] = lambda: LlamaCpp(path, options.ppl_tokens + 16, options.threads)

    table = Table(title=f"{path.name}: {len(PROMPTS)} prompts x {options.tokens} tokens teacher-forced; "
                        f"perplexity over {len(text_ids)} tokens")
    for column in ("engine", "argmax agreement", "perplexity", "vs transformers f32"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    base, scores = None, {}
    for name, make in engines.items():
        with console.status(f"{name}: scoring"):
            engine = make()
            agree, ppl = scores[name] = agreement(engine, sequences), perplexity(engine, text_ids)
            del engine
        base = base or ppl
        table.add_row(name, f"{agree:.2%}", f"{ppl:.3f}", f"{ppl / base - 1:+.2%}")
        console.print(f"{name}: agreement {agree:.2%}, perplexity {ppl:.3f}")
    console.print(table)
    wire = {name.rsplit(" ", 2)[-2]: score for name, score in scores.items() if name.endswith(" wire")}
    if "f16" in wire and "q8" in wire:
        (f16_agree, f16_ppl), (q8_agree, q8_ppl) = wire["f16"], wire["q8"]
        console.print(f"q8 wire against f16 wire: argmax agreement {100 * (q8_agree - f16_agree):+.2f} points, "
                      f"perplexity {q8_ppl / f16_ppl - 1:+.3%}")


if __name__ == "__main__":
    main()
