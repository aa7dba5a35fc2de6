"""A 2-stage chain over a conditioned link (stage/link.py): what delay, bandwidth and the
activation dtype cost, as ratios to plain loopback.

Every link of the chain (stage 0's lanes to stage 1 and stage 1's direct return to
stage 0) gets the same one-way delay and bandwidth cap; a token then pays two delays.
For each activation dtype (f32, f16, bf16) and link (delay 0 / 5 / 20 / 50 ms, 100 Mbit
or 1 Gbit/s) it measures decode tok/s of one stream, the aggregate of 8 concurrent
streams, and TTFT of a --prompt-tokens prompt, with a ChainClient (no HTTP). The
bandwidth is the knob's, not the kernel's (`tc tbf` shapes a real interface where
one exists; these namespaces-free runs share loopback).

    python bench/wan.py [--decode-tokens 24] [--prompt-tokens 512] [--delays 0,5,20,50]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from skippy.model.threads import spin_for_co_located_stages  # noqa: E402

spin_for_co_located_stages()  # before torch loads, as `skippy serve --stages N` does

import numpy as np  # noqa: E402

from skippy.launch.local_chain import LocalChain  # noqa: E402
from skippy.model.locate import bundled_model_path  # noqa: E402
from skippy.protocol import LinkConditioning  # noqa: E402


async def measure(args, dtype: str, link: LinkConditioning | None) -> tuple[float, float, float]:
    """(decode tok/s of one stream, aggregate tok/s of 8, TTFT s of the long prompt)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, size=32).tolist() for _ in range(8)]
    long_prompt = rng.integers(100, 40000, size=args.prompt_tokens).tolist()
    async with LocalChain(bundled_model_path(), 2, ctx_size=2048, activation_dtype=dtype, concurrency=8,
                          lane_count=8, link_conditioning=link) as client:
        await client.generate(prompts[0], max_tokens=4)  # warm-up
        one = await client.generate(prompts[0], max_tokens=args.decode_tokens)
        started = time.perf_counter()
        many = await asyncio.gather(*(client.generate(p, max_tokens=args.decode_tokens) for p in prompts))
        aggregate = sum(len(r.tokens) for r in many) / (time.perf_counter() - started)
        ttft = (await client.generate(long_prompt, max_tokens=1)).timings.first_token_s
    return one.timings.decode_steps / one.timings.decode_s, aggregate, ttft


async def main(args: argparse.Namespace) -> None:
    links = [("loopback", None)] + [
        (f"{delay} ms, {mbps / 1000:g} Gbit" if mbps >= 1000 else f"{delay} ms, {mbps:g} Mbit",
         LinkConditioning(delay_ms=delay, mbps=mbps))
        for delay in args.delays for mbps in (100.0, 1000.0)]
    print(f"2 stages, {args.decode_tokens} decode tokens, 8 streams for the aggregate, TTFT of "
          f"{args.prompt_tokens} prompt tokens; one run each (the link's delays dwarf the noise); "
          f"ratios to loopback with the same dtype", flush=True)
    header = f"{'link':<18}" + "".join(f"{d + ' ' + what:>16}" for d in args.dtypes
                                       for what in ("decode", "aggregate", "TTFT"))
    rows = []
    for dtype in args.dtypes:
        base = None
        for name, link in links:
            decode, aggregate, ttft = await measure(args, dtype, link)
            base = base or (decode, aggregate, ttft)
            rows.append((dtype, name, decode, aggregate, ttft, base))
            print(f"  {dtype} {name}: {decode:.1f} tok/s, 8 streams {aggregate:.1f} tok/s, TTFT {ttft * 1e3:.0f} ms",
                  flush=True)
    print("\n" + header)
    for name, _ in links:
        cells = []
        for dtype in args.dtypes:
            _, _, decode, aggregate, ttft, base = next(r for r in rows if r[0] == dtype and r[1] == name)
            cells += [f"{decode / base[0]:.2f}x", f"{aggregate / base[1]:.2f}x", f"{ttft / base[2]:.2f}x"]
        print(f"{name:<18}" + "".join(f"{cell:>16}" for cell in cells))
    print("(decode and aggregate: higher is better; TTFT: the ratio of times, lower is better)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--delays", type=lambda t: [float(x) for x in t.split(",")], default=[0, 5, 20, 50])
    parser.add_argument("--dtypes", type=lambda t: t.split(","), default=["f32", "f16", "bf16"])
    asyncio.run(main(parser.parse_args()))
