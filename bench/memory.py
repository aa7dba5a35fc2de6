"""Resident memory: `skippy serve` (each stage) against llama.cpp's one process, same GGUF.

Starts `skippy serve --stages N` as a user would, sends 8 concurrent chat requests
(64 tokens each) and reads every process's resident set (VmRSS) and its peak
(VmHWM, loading included) from /proc; then runs llama.cpp (llama-cpp-python) in a
fresh process on the same GGUF for the same 64 tokens and reads the same figures.

    python bench/memory.py                    # bundled SmolLM2, --stages 1 and 2, --dtype auto
    python bench/memory.py --stages 1 --dtype float32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
from common import resident, resolve_model, start_serve

MIB = 2**20
LLAMA_CPP = """
import json, sys
from pathlib import Path
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=2, verbose=False)
llm.create_chat_completion([{"role": "user", "content": "Write a long story about a dragon."}], max_tokens=64)
status = dict(l.split(":", 1) for l in Path("/proc/self/status").read_text().splitlines() if ":" in l)
print(json.dumps({k: int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}))
"""


async def eight_requests(url: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "temperature": 0, "max_tokens": 64}
    async with httpx.AsyncClient(timeout=600) as client:
        responses = await asyncio.gather(*[client.post(url + "/v1/chat/completions", json=body) for _ in range(8)])
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]


def measure_serve(stages: int, dtype: str, model: str | None) -> list[tuple[str, int, int]]:
    process, url, _ = start_serve(["--stages", str(stages), "--dtype", dtype, "--concurrency", "8"]
                                  + (["--model", model] if model else []))
    try:
        model_id = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(eight_requests(url, model_id))
        serve = psutil.Process(process.pid)
        named = [("stage 0 (serve)", serve.pid)] + [(f"stage {i + 1}", c.pid) for i, c in enumerate(serve.children())]
        return [(name, *resident(pid)) for name, pid in named]
    finally:
        process.terminate()
        process.wait(timeout=60)


def measure_llama_cpp(path: Path) -> tuple[int, int] | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    out = subprocess.run([sys.executable, "-c", LLAMA_CPP, str(path)], capture_output=True, text=True, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    return figures["VmRSS"], figures["VmHWM"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=resolve_model, default=None)
    parser.add_argument("--stages", type=lambda s: [int(n) for n in s.split(",")], default=[1, 2])
    parser.add_argument("--dtype", default="auto")
    options = parser.parse_args()
    from skippy.model.locate import bundled_model_path

    path = Path(options.model) if options.model else bundled_model_path()
    llama = measure_llama_cpp(path)
    print(f"{path.name} ({path.stat().st_size / MIB:.1f} MiB on disk)")
    if llama:
        print(f"llama.cpp, one process: RSS {llama[0] / MIB:.1f} MiB, peak {llama[1] / MIB:.1f} MiB")
    else:
        print("llama.cpp skipped: llama_cpp is not importable (pip install -e '.[bench-llamacpp]')")
    for stages in options.stages:
        figures = measure_serve(stages, options.dtype, options.model)
        total = sum(f[1] for f in figures)
        print(f"skippy serve --stages {stages} --dtype {options.dtype}, after 8 concurrent requests:")
        for name, now, peak in figures:
            print(f"  {name:<16} RSS {now / MIB:7.1f} MiB  peak {peak / MIB:7.1f} MiB ({peak / now:.2f}x RSS)")
        ratio = f" = {total / llama[0]:.2f}x llama.cpp" if llama else ""
        print(f"  {'all stages':<16} RSS {total / MIB:7.1f} MiB{ratio}")


if __name__ == "__main__":
    main()
