"""Time to first token of a long prompt through the OpenAI API: `skippy serve` with exact
prompts, the same with `--prefill-precision bf16`, and llama-cpp-python's own server.

Every server runs at once on the same GGUF and threads; each round sends one request to
each, in turn. A request is a /v1/completions of --prompt-tokens tokens (about: the
printing-press prose repeated) and max_tokens 1, so its time is the prompt's prefill and
one token. Every request starts with another number, so no server restores a prefix
(ours run with no prefix cache besides). The table shows medians after one warm-up round.

    python bench/long_prompt.py --model synthetic --stages 2 --rounds 3
    python bench/long_prompt.py --stages 1 --prompt-tokens 1024
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
from common import PRINTING_PRESS, resolve_model, start_serve
from startup import LlamaCppServer

from skippy.model.locate import bundled_model_path


def prompt_of(tokens: int, round_index: int) -> str:
    """About `tokens` tokens of prose (~1.17 tokens a word), its first word another each round."""
    words = " ".join(PRINTING_PRESS).split()
    body = (words * (tokens // len(words) + 1))[: int(tokens / 1.17)]
    return f"{round_index * 7919 + 1}. " + " ".join(body)


def completion(url: str, prompt: str) -> tuple[float, int]:
    """(seconds, prompt tokens as the server counted them)"""
    model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
    started = time.perf_counter()
    response = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                         "temperature": 0}, timeout=600)
    took = time.perf_counter() - started
    response.raise_for_status()
    return took, response.json()["usage"]["prompt_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file, or synthetic[:SHAPE[:TYPE]] (default: bundled)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    options = parser.parse_args()
    model = resolve_model(options.model) or str(bundled_model_path())
    common = ["--model", str(model), "--stages", str(options.stages), "--threads", str(options.threads),
              "--ctx-size", "4096", "--kv-cache-mem", "0"]
    servers: dict[str, tuple] = {}
    try:
        for name, extra in (("ours exact", []), ("ours bf16", ["--prefill-precision", "bf16"])):
            process, url, _ = start_serve([*common, *extra])
            servers[name] = (process, url)
        try:
            import llama_cpp.server.app  # noqa: F401

            servers["llama.cpp server"] = LlamaCppServer(model, options.threads).start()
        except ImportError as exc:
            print(f"llama.cpp's server skipped: {exc} (pip install -e '.[bench-llamacpp]')")
        seconds: dict[str, list[float]] = {name: [] for name in servers}
        counted: dict[str, int] = {}
        for round_index in range(options.rounds + 1):
            prompt = prompt_of(options.prompt_tokens, round_index)
            for name, (_, url) in servers.items():
                took, counted[name] = completion(url, prompt)
                if round_index:  # the first round warms every server up
                    seconds[name].append(took)
        print(f"{model}: ~{options.prompt_tokens}-token prompts, {options.stages} stage(s) for ours, "
              f"{options.threads} threads, medians of {options.rounds}")
        base = statistics.median(seconds.get("llama.cpp server") or [float("nan")])
        print(f"{'server':<18} {'tokens':>7} {'TTFT s':>8} {'prompt tok/s':>13} {'llama.cpp / it':>15}")
        for name, samples in seconds.items():
            median = statistics.median(samples)
            print(f"{name:<18} {counted[name]:7d} {median:8.2f} {counted[name] / median:13.0f} {base / median:14.2f}x")
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)


if __name__ == "__main__":
    main()
