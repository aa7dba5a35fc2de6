"""Time to first token with a shared ~1,000-token system prompt: cold prefill vs chain restore.

    python bench/prefix_cache.py [--stages 2] [--tails 20] [--threads 1] [--system-tokens 1000]

A 2-stage chain (stage 1 a separate process, stage 0 here), a prefix cache on each stage.
One priming request records the system prompt; then, for each of 20 different short
tails, interleaved: a *cold* request (a prompt_cache_key no request has used, so every
stage misses and prefills all of it, as a cold server would) and a *warm* one (the
default namespace: every stage restores the longest cached prefix, the tail is
prefilled). TTFT is prefill start to first token, restore included. Medians and the
ratio are printed; the goal is warm >= 5x faster than cold. Greedy outputs of each
pair are compared too (they must be equal).

`--repeat` adds a third request per tail: the same prompt once more, so the whole prompt
but its last token is cached and every stage restores it in one TryRestorePrefillDecode
(the final stage's first token comes straight back to stage 0). `--delay-ms` gives every
link that one-way delay (skippy's link knob), as between hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle stages must not spin on the cores

from skippy.launch.local_chain import LocalChain  # noqa: E402
from common import resolve_model  # noqa: E402
from skippy.model.locate import bundled_model_path  # noqa: E402
from skippy.model.tokenizer import Tokenizer  # noqa: E402
from skippy.protocol import KvCacheConfig, LinkConditioning, cache_namespace_digest  # noqa: E402

GOAL_RATIO = 5.0
WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo",
         "juniper", "kestrel", "lagoon", "meadow", "nickel", "orchid", "pewter", "quartz", "raven")
TAILS = ["What does rule {i} ask for?", "Summarise rule {i} in one line.",
         "Which checklist applies to report {i}?", "Is section {i} ever cited?"]


def system_text(num_sentences: int) -> str:
    sentences = []
    for i in range(num_sentences):
        a, b, c = (WORDS[(i * k + 3) % len(WORDS)] for k in (1, 5, 7))
        sentences.append(f"Rule {i + 1}: when the {a} report mentions {b}, answer with the {c} "
                         f"checklist and cite section {i % 9 + 1}.")
    return "You are a careful assistant for the harbor office. " + " ".join(sentences)


def system_prompt(tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    sentences = 1
    while len(tokenizer.encode(system_text(sentences + 1))) <= num_tokens:
        sentences += 1
    return tokenizer.encode(system_text(sentences))


async def main(args: argparse.Namespace) -> None:
    path = args.model or bundled_model_path()
    tokenizer = Tokenizer.from_gguf(path)
    system = system_prompt(tokenizer, args.system_tokens)
    tails = [tokenizer.encode(" Question: " + TAILS[i % len(TAILS)].format(i=i + 1))
             for i in range(args.tails)]
    kv = KvCacheConfig(max_bytes=args.cache_mib << 20)
    link = LinkConditioning(delay_ms=args.delay_ms) if args.delay_ms else None
    chain = LocalChain(path, args.stages, threads=args.threads, ctx_size=2048, kv_cache=kv,
                       link_conditioning=link)
    client = await chain.start()
    try:
        print(f"{args.stages} stages, threads {args.threads}, system prompt {len(system)} tokens, "
              f"{args.tails} tails of {min(map(len, tails))}-{max(map(len, tails))} tokens")
        prime = await client.generate(system + tokenizer.encode(" Hello."), max_tokens=1)
        print(f"priming: ttft {prime.timings.first_token_s * 1e3:.0f} ms, recorded "
              f"{prime.stats.kv_recorded_pages} entries")
        cold_s, warm_s, repeat_s, restored, mismatches = [], [], [], [], 0
        for i, tail in enumerate(tails):
            prompt = system + tail
            cold = await client.generate(prompt, max_tokens=args.max_tokens,
                                         cache_namespace=cache_namespace_digest(f"cold-{i}-{time.time()}"))
            warm = await client.generate(prompt, max_tokens=args.max_tokens)
            assert cold.timings.restored_tokens == 0, cold.timings
            cold_s.append(cold.timings.first_token_s)
            warm_s.append(warm.timings.first_token_s)
            restored.append(warm.timings.restored_tokens)
            mismatches += cold.tokens != warm.tokens
            repeat = await client.generate(prompt, max_tokens=args.max_tokens) if args.repeat else None
            print(f"tail {i + 1:2d}: prompt {len(prompt)}  cold {cold_s[-1] * 1e3:7.0f} ms   warm "
                  f"{warm_s[-1] * 1e3:6.0f} ms  ({warm.timings.restore_decision}, restored "
                  f"{restored[-1]}, prefilled {warm.timings.prefilled_tokens}, restore "
                  f"{warm.timings.restore_s * 1e3:.0f} ms)")
            if repeat is not None:
                repeat_s.append(repeat.timings.first_token_s)
                mismatches += cold.tokens != repeat.tokens
                print(f"         repeat {repeat_s[-1] * 1e3:6.0f} ms  ({repeat.timings.restore_decision}, "
                      f"prefilled {repeat.timings.prefilled_tokens})")
        cold_median, warm_median = statistics.median(cold_s), statistics.median(warm_s)
        ratio = cold_median / warm_median
        print(f"\nTTFT median: cold {cold_median * 1e3:.0f} ms, warm {warm_median * 1e3:.0f} ms, "
              f"ratio {ratio:.1f}x (goal >= {GOAL_RATIO:g}x: {'met' if ratio >= GOAL_RATIO else 'NOT met'})")
        if repeat_s:
            print(f"repeated prompt (whole prompt restored): TTFT median "
                  f"{statistics.median(repeat_s) * 1e3:.0f} ms")
        print(f"restored tokens median {statistics.median(restored):.0f} of {len(system)}; "
              f"greedy outputs differing from cold: {mismatches}")
        stats = client.runtime.prefix_cache.stats()
        print(f"stage 0 cache: {stats['num_entries']} entries, {stats['num_bytes'] / 2**20:.0f} MiB, "
              f"{stats['hits']} hits, {stats['misses']} misses, {stats['evictions']} evictions")
    finally:
        await chain.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=resolve_model, default=None,
                        help="GGUF file, or synthetic[:SHAPE[:TYPE]] (default: the bundled SmolLM2)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--tails", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per request (output check)")
    parser.add_argument("--repeat", action="store_true",
                        help="also time each prompt repeated whole (a full restore)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay on every link")
    parser.add_argument("--cache-mib", type=int, default=512, help="prefix-cache memory per stage")
    asyncio.run(main(parser.parse_args()))
