"""`skippy` command line: argparse → configs → start. Nothing imports this module."""

from __future__ import annotations

import argparse
import json
import sys

from .console import configure_logging


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file or Hugging Face directory (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="weight dtype")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    parser.add_argument("--ctx-size", type=int, default=None, help="context size per session (default: the model's)")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skippy", description="Serve one language model from a chain of stages.")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for one prompt")
    generate.add_argument("prompt")
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")
    generate.add_argument("--system", default=None, help="system message for the chat template")
    generate.add_argument("--json", action="store_true", help="print one JSON line: prompt_ids, completion_ids, text")
    add_model_options(generate)
    add_sampling_options(generate)
    generate.set_defaults(run=run_generate)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API (bundled SmolLM2, 2 local stages)")
    serve.add_argument("--stages", type=int, default=2, help="local stage processes to start (1 = one process)")
    serve.add_argument("--topology", default=None, help="topology JSON: stage 0 here, other stages already running")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=9337)
    serve.add_argument("--concurrency", type=int, default=None, help="generations at once (default: the lanes)")
    serve.add_argument("--queue", type=int, default=None, help="waiting requests (default: clamp(8 x lanes, 16, 256))")
    serve.add_argument("--admission-timeout", type=float, default=60.0, help="seconds a request may wait (0 = no limit)")
    serve.add_argument("--backend-timeout", type=float, default=600.0, help="seconds without a token before 504")
    serve.add_argument("--auth-token", default=None, help="require Authorization: Bearer TOKEN on /v1/*")
    add_model_options(serve)
    serve.set_defaults(run=run_serve)
    return parser


def model_path(args: argparse.Namespace):
    from .model.locate import bundled_model_path

    return args.model or bundled_model_path()


def sampling_config(args: argparse.Namespace):
    from .protocol.sampling_config import SamplingConfig

    return SamplingConfig(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed
    )


def prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.raw:
        return tokenizer.encode(args.prompt)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def load_tokenizer(path):
    from pathlib import Path

    from .model.tokenizer import Tokenizer

    from .model.gguf_loader import open_gguf

    path = Path(path)
    return Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf(open_gguf(path))


def run_generate(args: argparse.Namespace) -> int:
    from .model.loader import load_stage
    from .runtime.local_generation import GenerationLimits, generate_tokens

    path = model_path(args)
    tokenizer = load_tokenizer(path)
    ids = prompt_ids(args, tokenizer)
    model = load_stage(path, dtype=args.dtype, device=args.device)
    limits = GenerationLimits(max_tokens=args.max_tokens, stop_ids=tokenizer.eog_ids)
    tokens = generate_tokens(model, ids, limits, sampling_config(args), args.ctx_size)
    return emit(args, tokenizer, ids, tokens)


def run_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .frontend.serve import ServeConfig, serve

    config = ServeConfig(
        model=Path(model_path(args)),
        num_stages=args.stages,
        host=args.host,
        port=args.port,
        topology=Path(args.topology) if args.topology else None,
        ctx_size=args.ctx_size,
        concurrency=args.concurrency,
        queue_size=args.queue,
        auth_token=args.auth_token,
        dtype=args.dtype,
        device=args.device,
        admission_timeout_s=args.admission_timeout,
        backend_timeout_s=args.backend_timeout,
    )
    return serve(config)


def emit(args: argparse.Namespace, tokenizer, ids: list[int], tokens) -> int:
    """Stream text to stdout, or print one JSON line with --json."""
    from .model.tokenizer import IncrementalDecoder

    if args.json:
        completion = list(tokens)
        print(json.dumps({"prompt_ids": ids, "completion_ids": completion, "text": tokenizer.decode(completion)}))
        return 0
    decoder = IncrementalDecoder(tokenizer)
    for token in tokens:
        sys.stdout.write(decoder.push(token))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"skippy: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
