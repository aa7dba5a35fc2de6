"""`skippy` command line: argparse → configs → start. Nothing imports this module."""

from __future__ import annotations

import argparse
import json
import sys

from .console import configure_logging


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file or Hugging Face directory (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="weights: auto (default) keeps them as the file stores them, GGUF 4- to 8-bit types "
                             "quantized; a float dtype dequantizes every weight to it")
    parser.add_argument("--quantize", dest="dtype", choices=["int4", "int8"],
                        help="a Hugging Face checkpoint's matmul weights as 4- or 8-bit codes per group of 32 "
                             "(GGUF files keep their own quantization)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    parser.add_argument("--ctx-size", type=int, default=None, help="context size per session (default: the model's)")
    parser.add_argument("--no-repack", dest="repack", action="store_false",
                        help="do not keep a second, batch-friendly copy of float32 CPU weights (halves their "
                             "memory; batched decode, prefill and verify windows run slower)")


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
    add_chain_options(generate)
    add_speculative_options(generate)

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
    serve.add_argument("--chain-auth-token", default=None, help="the stages' transport token (with --topology)")
    serve.add_argument("--threads", type=int, default=None, help="torch threads in every stage (this one too)")
    serve.add_argument("--max-restarts", type=int, default=5,
                       help="restart a local stage process that dies or hangs at most this often (0 = never)")
    serve.add_argument("--recovery-timeout", type=float, default=30.0,
                       help="seconds a request waits for a broken chain to be whole again, then replays "
                            "itself onto it (0 = fail at once)")
    serve.add_argument("--otlp-endpoint", default=None,
                       help="every stage exports spans over OTLP/HTTP, e.g. http://127.0.0.1:4318")
    serve.add_argument("--activation-dtype", default="f32", choices=["f32", "f16", "bf16"])
    serve.add_argument("--kv-cache-mem", type=byte_size, default=1 << 30,
                       help="prefix-cache memory, all stages together (e.g. 512MiB; 0 = no prefix cache)")
    add_kv_disk_options(serve, "all stages together, split evenly")
    add_model_options(serve)
    add_speculative_options(serve)
    serve.set_defaults(run=run_serve)
    add_stage_commands(commands)
    return parser


def byte_size(text: str) -> int:
    """A size in bytes: a plain number or one with an IEC suffix (KiB, MiB, GiB, TiB)."""
    units = {"TIB": 1 << 40, "GIB": 1 << 30, "MIB": 1 << 20, "KIB": 1 << 10, "B": 1}
    value = text.strip().upper()
    for suffix, scale in units.items():
        if value.endswith(suffix):
            value, multiplier = value[: -len(suffix)].strip(), scale
            break
    else:
        multiplier = 1
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"Expected a size like 512MiB or 4GiB, got {text!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"Expected a size >= 0, got {text!r}")
    return int(number * multiplier)


def add_kv_disk_options(parser: argparse.ArgumentParser, budget_scope: str) -> None:
    parser.add_argument("--kv-disk-dir", default=None,
                        help="prefix-cache disk tier: entries survive restarts (a subdirectory per stage)")
    parser.add_argument("--kv-disk-budget", type=byte_size, default=None,
                        help=f"disk bytes for the prefix cache ({budget_scope}; e.g. 8GiB)")


def add_speculative_options(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding: stage 0 proposes tokens and the chain verifies several per trip."""
    parser.add_argument("--speculative", default="off", choices=["off", "ngram-suffix", "ngram-simple", "draft"],
                        help="proposer for speculative decoding (greedy output does not change); default off")
    parser.add_argument("--draft-model", default=None, help="GGUF or HF directory: the draft proposer's model")
    parser.add_argument("--speculative-min-window", type=int, default=1, help="fewest drafts per verify window")
    parser.add_argument("--speculative-max-window", type=int, default=8, help="most drafts per verify window")
    parser.add_argument("--speculative-pipeline-depth", type=int, default=1, help="verify windows in flight")


def speculative_settings(args: argparse.Namespace):
    from .runtime.speculation import SpeculativeSettings

    if args.speculative == "draft" and not args.draft_model:
        raise ValueError("Expected --draft-model PATH with --speculative draft")
    return SpeculativeSettings(args.speculative, args.speculative_min_window, args.speculative_max_window,
                               args.speculative_pipeline_depth)  # fmt: skip


def load_draft_model(args: argparse.Namespace):
    from .model.loader import load_stage

    if not args.draft_model:
        return None
    return load_stage(args.draft_model, dtype=args.dtype, device=args.device, progress=False)


def add_chain_options(parser: argparse.ArgumentParser) -> None:
    """`generate` on a chain: --stages N starts local stage processes, --topology uses running ones."""
    parser.add_argument("--stages", type=int, default=1, help="local stages (separate processes); 1 = one process")
    parser.add_argument("--topology", default=None, help="topology JSON of running stages (stage 0 runs here)")
    parser.add_argument("--auth-token", default=None, help="the chain's transport token (with --topology)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every stage process")
    parser.add_argument("--activation-dtype", default="f32", choices=["f32", "f16", "bf16"])


def add_stage_commands(commands) -> None:
    stage = commands.add_parser("stage", help="run one stage of a chain (binary TCP server)")
    stage.add_argument("--config", required=True, help="stage config JSON (see `skippy plan`)")
    stage.add_argument("--topology", default=None, help="topology JSON (for the direct prediction return)")
    stage.add_argument("--threads", type=int, default=None, help="torch threads")
    stage.add_argument("--otlp-endpoint", default=None, help="export spans over OTLP/HTTP, e.g. http://127.0.0.1:4318")
    stage.add_argument("--max-inflight", type=int, default=None, help="async forwarder depth (overrides the config)")
    stage.add_argument("--reply-credit-limit", type=int, default=None, help="deferred ACKs before a credit wait")
    stage.add_argument("--no-repack", action="store_true",
                       help="no batch-friendly copy of float32 CPU weights (overrides the config)")
    add_kv_disk_options(stage, "this stage; overrides the config")
    stage.set_defaults(run=run_stage)

    plan = commands.add_parser("plan", help="split the layers over hosts; write stage configs and topology")
    plan.add_argument("--model", help="GGUF file or Hugging Face directory (default: the bundled SmolLM2)")
    plan.add_argument("--stages", type=int, required=True)
    plan.add_argument("--hosts", required=True, help="host:port per stage, comma-separated; stage 0 first")
    plan.add_argument("--weights", default=None, help="relative share per stage, comma-separated")
    plan.add_argument("--out", default=".", help="directory for topology.json and stage-N.json")
    plan.add_argument("--auth-token", default=None)
    plan.add_argument("--ctx-size", type=int, default=2048)
    plan.add_argument("--lane-count", type=int, default=4)
    plan.add_argument("--activation-dtype", default="f32", choices=["f32", "f16", "bf16"])
    plan.set_defaults(run=run_plan)


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
    return tokenizer.encode_chat(messages, add_generation_prompt=True)


def run_generate(args: argparse.Namespace) -> int:
    from .model.threads import spin_for_co_located_stages

    if args.stages > 1 and not args.topology:
        spin_for_co_located_stages()  # before torch loads
    from .model.tokenizer import Tokenizer

    path = model_path(args)
    tokenizer = Tokenizer.from_model(path)
    ids = prompt_ids(args, tokenizer)
    return emit(args, tokenizer, ids, chain_tokens(args, path, ids, tokenizer, speculative_settings(args)))


def run_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .model.threads import spin_for_co_located_stages

    if args.stages > 1 and not args.topology:
        spin_for_co_located_stages()  # before torch loads
    from .launch.serve import ServeConfig, serve

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
        chain_auth_token=args.chain_auth_token,
        dtype=args.dtype,
        device=args.device,
        repack=args.repack,
        activation_dtype=args.activation_dtype,
        threads=args.threads,
        otlp_endpoint=args.otlp_endpoint,
        max_restarts=args.max_restarts,
        recovery_timeout_s=args.recovery_timeout,
        admission_timeout_s=args.admission_timeout,
        backend_timeout_s=args.backend_timeout,
        log_level=args.log_level,
        kv_cache_bytes=args.kv_cache_mem,
        kv_disk_dir=Path(args.kv_disk_dir) if args.kv_disk_dir else None,
        **({"kv_disk_budget": args.kv_disk_budget} if args.kv_disk_budget is not None else {}),
        speculative=args.speculative,
        draft_model=Path(args.draft_model) if args.draft_model else None,
        speculative_min_window=args.speculative_min_window,
        speculative_max_window=args.speculative_max_window,
        speculative_pipeline_depth=args.speculative_pipeline_depth,
    )
    return serve(config)


def chain_tokens(args: argparse.Namespace, path, ids: list[int], tokenizer, speculative):
    from .launch.local_chain import generate_on_chain
    from .protocol import Topology

    options = {"activation_dtype": args.activation_dtype, "dtype": args.dtype, "device": args.device,
               "repack": args.repack,
               "ctx_size": args.ctx_size or 2048, "speculative": speculative,
               "draft_model": load_draft_model(args)}
    topology = Topology.load(args.topology) if args.topology else None
    if topology is None and args.stages > 1:
        options.update(threads=args.threads, log_level=args.log_level)
    elif topology is None:  # the whole model here: every core, as `skippy serve --stages 1`
        import os

        import torch

        torch.set_num_threads(args.threads or os.cpu_count() or 1)
    return generate_on_chain(ids, path, num_stages=args.stages, topology=topology, auth_token=args.auth_token,
                             chain_options=options, max_tokens=args.max_tokens, sampling=sampling_config(args),
                             stop_ids=tokenizer.eog_ids)


def run_stage(args: argparse.Namespace) -> int:
    import asyncio

    from .protocol import Topology
    from .stage.process import serve_stage

    config = stage_config(args)
    topology = Topology.load(args.topology) if args.topology else None
    asyncio.run(serve_stage(config, topology))
    return 0


def stage_config(args: argparse.Namespace):
    """`skippy stage`'s config file with the command line's overrides applied."""
    from pathlib import Path

    from .protocol import StageConfig

    config = StageConfig.load(args.config)
    overrides = {"max_inflight": args.max_inflight, "reply_credit_limit": args.reply_credit_limit,
                 "repack_weights": False if args.no_repack else None, "threads": args.threads,
                 "otlp_endpoint": args.otlp_endpoint}
    overrides = {key: value for key, value in overrides.items() if value is not None}
    kv_overrides = {"disk_budget_bytes": args.kv_disk_budget}
    if args.kv_disk_dir is not None:  # this stage's own subdirectory, as `skippy serve` does
        kv_overrides["disk_dir"] = str(Path(args.kv_disk_dir).resolve() / f"stage-{config.stage_index}")
    kv_overrides = {key: value for key, value in kv_overrides.items() if value is not None}
    if kv_overrides:
        overrides["kv_cache"] = {**config.kv_cache.model_dump(), **kv_overrides}
    if overrides:
        config = StageConfig.model_validate({**config.model_dump(), **overrides})
    return config


def run_plan(args: argparse.Namespace) -> int:
    from .launch.local_chain import plan_chain, write_plan

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if len(hosts) != args.stages:
        raise ValueError(f"Expected {args.stages} host:port entries in --hosts, got {len(hosts)}")
    weights = [float(w) for w in args.weights.split(",")] if args.weights else None
    topology, configs = plan_chain(model_path(args), hosts, weights=weights, auth_token=args.auth_token,
                                   ctx_size=args.ctx_size, lane_count=args.lane_count,
                                   activation_dtype=args.activation_dtype)
    for written in write_plan(topology, configs, args.out):
        print(written)
    for stage in topology.stages:
        print(f"{stage.stage_id}: layers [{stage.layer_start}, {stage.layer_end}) @ {stage.endpoint}")
    return 0


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
        print(f"skippy: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: Exception) -> str:
    """A config's validation errors as `field: what is wrong`, without pydantic's banner."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg'].removeprefix('Value error, ')}"
                     for e in errors())


if __name__ == "__main__":
    sys.exit(main())
