"""`skippy` command line: argparse → configs → start. Nothing imports this module."""

from __future__ import annotations

import argparse
import json
import sys

from .console import configure_logging
from .protocol import LinkConditioning


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
    add_prefill_precision(parser)


def add_prefill_precision(parser: argparse.ArgumentParser, default: str | None = "exact") -> None:
    parser.add_argument("--prefill-precision", default=default, choices=["exact", "bf16"],
                        help="prompts' matmuls: exact (default) on the integer kernels, the same bits as decoding them; "
                             "bf16 on AMX-BF16 tiles where the CPU has them (~2x faster prompts, bfloat16's "
                             "precision: a prompt's rows no longer equal the decode rows that would replay it)")


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
    serve.add_argument("--stages", dest="num_stages", type=int, default=2,
                       help="local stage processes to start (1 = one process)")
    serve.add_argument("--topology", default=None, help="topology JSON: stage 0 here, other stages already running")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=9337)
    serve.add_argument("--concurrency", type=int, default=None, help="generations at once (default: the lanes)")
    serve.add_argument("--queue", dest="queue_size", type=int, default=None,
                       help="waiting requests (default: clamp(8 x lanes, 16, 256))")
    serve.add_argument("--admission-timeout", dest="admission_timeout_s", type=float, default=60.0,
                       help="seconds a request may wait (0 = no limit)")
    serve.add_argument("--backend-timeout", dest="backend_timeout_s", type=float, default=600.0,
                       help="seconds without a token before 504")
    serve.add_argument("--auth-token", default=None, help="require Authorization: Bearer TOKEN on /v1/*")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model names clients send (the first is listed first; default: the file's name)")
    serve.add_argument("--allowed-origins", type=lambda text: [o.strip() for o in text.split(",") if o.strip()],
                       default=None, help="CORS: comma-separated browser origins allowed to call the API, or * "
                                          "(default: none; same-origin and non-browser clients need none)")
    serve.add_argument("--chain-auth-token", default=None,
                       help="the stages' transport token (with --topology; default: the plan's stage-0.json)")
    serve.add_argument("--insecure", action="store_true", default=None,
                       help="with --topology: listen off loopback without a chain token or TLS anyway; with "
                            "--ray: use a cluster without token authentication anyway (warned)")
    add_stage_wait_option(serve)
    serve.add_argument("--threads", type=int, default=None, help="torch threads in every stage (this one too)")
    serve.add_argument("--max-restarts", type=int, default=5,
                       help="restart a local stage process that dies or hangs at most this often (0 = never)")
    serve.add_argument("--recovery-timeout", dest="recovery_timeout_s", type=float, default=30.0,
                       help="seconds a request waits for a broken chain to be whole again, then replays "
                            "itself onto it (0 = fail at once)")
    serve.add_argument("--otlp-endpoint", default=None,
                       help="every stage exports spans over OTLP, e.g. http://127.0.0.1:4318 (4317 for grpc)")
    serve.add_argument("--otlp-protocol", default="http", choices=["http", "grpc"],
                       help="OTLP over HTTP/protobuf or gRPC (default http)")
    add_activation_dtype(serve)
    add_split(serve)
    serve.add_argument("--kv-cache-mem", dest="kv_cache_bytes", type=byte_size, default=1 << 30,
                       help="prefix-cache memory, all stages together (e.g. 512MiB; 0 = no prefix cache)")
    add_kv_disk_options(serve, "all stages together, split evenly")
    add_ray_options(serve)
    add_model_options(serve)
    add_speculative_options(serve)
    serve.set_defaults(run=run_serve)
    add_stage_commands(commands)
    return parser


def byte_size(text: str) -> int:
    """A size in bytes: a plain number or one with a unit (512MiB, 4GiB, 1.5GB), as pydantic's ByteSize."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"Expected a size >= 0 like 512MiB or 4GiB, got {text!r}") from None


def add_kv_disk_options(parser: argparse.ArgumentParser, budget_scope: str) -> None:
    parser.add_argument("--kv-disk-dir", default=None,
                        help="prefix-cache disk tier: entries survive restarts (a subdirectory per stage)")
    parser.add_argument("--kv-disk-budget", type=byte_size, default=None,
                        help=f"disk bytes for the prefix cache ({budget_scope}; e.g. 8GiB)")


def add_ray_options(parser: argparse.ArgumentParser) -> None:
    """`serve --ray`: the stages on a Ray cluster's nodes (pip install 'skippy[ray]'; docs/operations.md)."""
    parser.add_argument("--ray", default=None, metavar="auto|HOST:PORT",
                        help="place, start and restart stages 1..N-1 on a Ray cluster (auto: the one this node "
                             "belongs to); stage 0 and the API run here")
    parser.add_argument("--ray-placement", default="spread", choices=["spread", "pack"],
                        help="spread (default): every stage on its own node; pack: several on one node allowed")
    parser.add_argument("--ray-stage-resources", type=json_resources, default=None, metavar="JSON",
                        help='each stage\'s Ray resources, e.g. \'{"CPU": 8, "memory": 34e9}\' (default 1 CPU), or '
                             "a JSON list with one per stage (the layer split then follows their CPUs)")
    parser.add_argument("--ray-port", type=int, default=7200, help="stage i listens on this port + i (default 7200)")
    parser.add_argument("--ray-placement-timeout", dest="ray_placement_timeout_s", type=float, default=120.0,
                        help="seconds to wait for the cluster to have room for every stage (default 120)")
    parser.add_argument("--ray-no-standby", dest="ray_standby", action="store_false", default=None,
                        help="keep no warm standby process beside each stage (saves ~250 MB per stage node; "
                             "a restarted stage then starts Python afresh, ~2 s longer)")
    parser.add_argument("--weights", type=lambda text: [float(w) for w in text.split(",")], default=None,
                        help="with --ray: each stage's relative share of the layers, comma-separated")


def json_resources(text: str) -> list[dict[str, float]]:
    """--ray-stage-resources: one JSON object of resources, or a list of them."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"Expected JSON like {{\"CPU\": 4}}, got {text!r} ({error})") from None
    return value if isinstance(value, list) else [value]


def add_speculative_options(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding: stage 0 proposes tokens and the chain verifies several per trip."""
    parser.add_argument("--speculative", default="off", choices=["off", "ngram-suffix", "ngram-simple", "draft"],
                        help="proposer for speculative decoding (greedy output does not change); default off")
    parser.add_argument("--draft-model", default=None, help="GGUF or HF directory: the draft proposer's model")
    parser.add_argument("--speculative-min-window", type=int, default=1, help="fewest drafts per verify window")
    parser.add_argument("--speculative-max-window", type=int, default=8, help="most drafts per verify window")
    parser.add_argument("--speculative-pipeline-depth", type=int, default=1, help="verify windows in flight")


def add_chain_options(parser: argparse.ArgumentParser) -> None:
    """`generate` on a chain: --stages N starts local stage processes, --topology uses running ones."""
    parser.add_argument("--stages", dest="num_stages", type=int, default=1,
                        help="local stages (separate processes); 1 = one process")
    parser.add_argument("--topology", default=None, help="topology JSON of running stages (stage 0 runs here)")
    parser.add_argument("--auth-token", dest="chain_auth_token", default=None,
                        help="the chain's transport token (with --topology)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every stage process")
    add_activation_dtype(parser)
    add_split(parser)
    add_stage_wait_option(parser)


def add_stage_wait_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage-wait", dest="stage_wait_s", type=float, default=None,
                        help="with --topology or --ray: seconds to wait for the other stages to be up (still fetching "
                             "or loading their layers) before failing (default 3600; 0 = fail at once)")


def add_split(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--split", default=None, choices=["equal", "auto"],
                        help="--stages N: layers by weight bytes (equal, default), or by what each stage measures "
                             "of its forward and link (auto: measure, then start again on that split; a restart after "
                             "a stage's death applies /v1/stages' split advice, restarting every stage on it)")


def add_activation_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--activation-dtype", default=None, choices=["auto", "f32", "f16", "bf16", "q8"],
                        help="what rows cross the links between stages as: auto (default) per link and frame, the "
                             "widest the link's measured bandwidth moves in 5%% of the rows' compute (f32 on a fast "
                             "link, then f16, then q8); q8 = 8 bits with a scale per 32 values (llama.cpp's Q8_0)")


def add_stage_commands(commands) -> None:
    stage = commands.add_parser("stage", help="run one stage of a chain (binary TCP server)")
    stage.add_argument("--config", required=True, help="stage config JSON (see `skippy plan`)")
    stage.add_argument("--topology", default=None, help="topology JSON (for the direct prediction return)")
    stage.add_argument("--threads", type=int, default=None, help="torch threads")
    stage.add_argument("--model", dest="model_path", default=None,
                       help="this host's copy of the model (default: the config's model_path); it must be the file "
                            "the chain was planned for. With no file there, the stage fetches its layers from a "
                            "holder (stage 0) into --model-cache once")
    stage.add_argument("--model-cache", default=None, metavar="DIR",
                       help="where this stage keeps the slice of the model it fetched "
                            "(default: ~/.cache/skippy/models/<fingerprint>/)")
    stage.add_argument("--fetch-from", dest="model_sources", default=None, metavar="HOST:PORT[,HOST:PORT]",
                       type=lambda text: [e.strip() for e in text.split(",") if e.strip()],
                       help="stages holding the model file to fetch this stage's layers from, in order "
                            "(default: stage 0's endpoint in --topology)")
    stage.add_argument("--otlp-endpoint", default=None, help="export spans over OTLP, e.g. http://127.0.0.1:4318")
    stage.add_argument("--otlp-protocol", default=None, choices=["http", "grpc"],
                       help="OTLP over HTTP/protobuf or gRPC (overrides the config; default http)")
    stage.add_argument("--insecure", action="store_true", default=None,
                       help="listen off loopback without an auth token or TLS anyway (warned at every start)")
    stage.add_argument("--max-inflight", type=int, default=None, help="async forwarder depth (overrides the config)")
    stage.add_argument("--reply-credit-limit", type=int, default=None, help="deferred ACKs before a credit wait")
    stage.add_argument("--no-repack", dest="repack_weights", action="store_false", default=None,
                       help="no batch-friendly copy of float32 CPU weights (overrides the config)")
    add_prefill_precision(stage, default=None)  # None: the config's
    add_kv_disk_options(stage, "this stage; overrides the config")
    for field in LinkConditioning.model_fields:  # --downstream-wire-delay-ms, -jitter-ms, -mbps, ...
        stage.add_argument(f"--downstream-wire-{field.replace('_', '-')}", dest=f"wire_{field}", default=None,
                           type=int if field == "seed" else float,
                           help="a test knob: what a WAN does to the frames this stage sends (docs/operations.md)")
    stage.set_defaults(run=run_stage)

    plan = commands.add_parser("plan", help="split the layers over hosts; write stage configs and topology")
    plan.add_argument("--model", help="GGUF file or Hugging Face directory (default: the bundled SmolLM2)")
    plan.add_argument("--stages", type=int, default=None, help="stages (one per --hosts entry)")
    plan.add_argument("--hosts", default=None, help="host:port per stage, comma-separated; stage 0 first")
    plan.add_argument("--auto", action="store_true",
                      help="split by what a running chain's stages measured (with --from): the layer ranges that "
                           "decode one stream fastest within each host's memory, over fewer hosts when that is "
                           "faster; prints the predicted tok/s")
    plan.add_argument("--from", dest="from_url", default=None,
                      help="with --auto: the running `skippy serve` whose /v1/stages reports its stages' measurements")
    plan.add_argument("--api-key", default=None, help="with --from: the server's bearer token")
    plan.add_argument("--all-hosts", action="store_true", help="with --auto: use every host even when fewer are faster")
    plan.add_argument("--weights", default=None, help="relative share per stage, comma-separated")
    plan.add_argument("--standby", action="append", default=[], metavar="N=HOST:PORT[,HOST:PORT]",
                      help="standby stages for stage N's layers (repeatable): requests fail over to them "
                           "when stage N is lost")
    plan.add_argument("--out", default=".", help="directory for topology.json and stage-N.json")
    plan.add_argument("--auth-token", default=None, help="the chain's token (default: a fresh random one)")
    plan.add_argument("--tls", action="store_true", help="TLS certificates even if every host is loopback "
                                                           "(they are written whenever one is not)")
    plan.add_argument("--ctx-size", type=int, default=2048)
    plan.add_argument("--lane-count", type=int, default=4)
    add_activation_dtype(plan)
    add_prefill_precision(plan)
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
    import asyncio

    from .model.threads import spin_for_co_located_stages

    if args.num_stages > 1 and not args.topology:
        spin_for_co_located_stages(model_path(args), args.dtype)  # before torch loads
    from .launch.serve import generate_once
    from .model.tokenizer import IncrementalDecoder, Tokenizer

    tokenizer = Tokenizer.from_model(model_path(args))
    ids = prompt_ids(args, tokenizer)
    decoder = IncrementalDecoder(tokenizer)

    def show(token: int) -> None:  # text as it arrives, unless one JSON line is asked for
        if not args.json:
            sys.stdout.write(decoder.push(token))
            sys.stdout.flush()

    # one request: one lane, no prefix cache, a 2048-token context unless asked
    config = serve_config(args, ctx_size=args.ctx_size or 2048, concurrency=1, kv_cache_bytes=0)
    result = asyncio.run(generate_once(config, ids, on_token=show, max_tokens=args.max_tokens,
                                       sampling=sampling_config(args), stop_ids=tokenizer.eog_ids))
    if args.json:
        print(json.dumps({"prompt_ids": ids, "completion_ids": result.tokens, "text": tokenizer.decode(result.tokens)}))
    else:
        sys.stdout.write(decoder.flush() + "\n")
    return 0


def serve_config(args: argparse.Namespace, **overrides):
    """The ServeConfig of `serve`'s (or `generate`'s) options, which are named as its fields;
    an option left out takes the field's default."""
    from .launch.serve import ServeConfig

    given = {name: value for name, value in vars(args).items()
             if name in ServeConfig.model_fields and value is not None}
    return ServeConfig(**{**given, "model": model_path(args), **overrides})


def run_serve(args: argparse.Namespace) -> int:
    from .model.threads import spin_for_co_located_stages

    if args.num_stages > 1 and not args.topology and not args.ray:
        spin_for_co_located_stages(model_path(args), args.dtype)  # before torch loads
    from .launch.serve import serve

    return serve(serve_config(args, ray=ray_settings(args)))


def ray_settings(args: argparse.Namespace):
    """serve's --ray options, or None without --ray: --ray is RaySettings' address, and each
    --ray-X option its field X (by name, as serve_config's, so none is lost)."""
    if args.ray is None:
        return None
    from .launch.ray_chain import RaySettings

    given = {name.removeprefix("ray_"): value for name, value in vars(args).items()
             if name.startswith("ray_") and name.removeprefix("ray_") in RaySettings.model_fields
             and value is not None}
    return RaySettings(address=args.ray, **given)


def run_stage(args: argparse.Namespace) -> int:
    import asyncio

    from .model.threads import set_spin_count
    from .protocol import Topology

    config = stage_config(args)
    set_spin_count(config.omp_spin_count)  # before torch loads
    from .stage.process import serve_stage

    topology = Topology.load(args.topology) if args.topology else None
    asyncio.run(serve_stage(config, topology, reload=lambda: stage_config(args)))
    return 0


def stage_config(args: argparse.Namespace):
    """`skippy stage`'s config file with the command line's overrides (named as its fields)."""
    from pathlib import Path

    from .protocol import LinkConditioning, StageConfig

    config = StageConfig.load(args.config)
    given = {name: value for name, value in vars(args).items()
             if name in StageConfig.model_fields and value is not None}
    if args.model_path is not None and not Path(args.model_path).exists():  # a typo, not a wish to fetch
        raise ValueError(f"--model {args.model_path}: no such file. Fix: leave --model out to fetch this stage's "
                         f"layers from a holder of the file (docs/operations.md).")
    if config.tls is not None:  # its files sit beside the config (the plan's tls/)
        given["tls"] = config.tls.resolved(Path(args.config).parent)
    wire = {field: getattr(args, f"wire_{field}") for field in LinkConditioning.model_fields}
    if wire := {field: value for field, value in wire.items() if value is not None}:
        given["link_conditioning"] = wire
    kv = {"disk_budget_bytes": args.kv_disk_budget, "disk_dir": args.kv_disk_dir and str(  # its own subdirectory
        Path(args.kv_disk_dir).resolve() / f"stage-{config.stage_index}")}
    if kv := {key: value for key, value in kv.items() if value is not None}:
        given["kv_cache"] = {**config.kv_cache.model_dump(), **kv}
    return StageConfig.model_validate({**config.model_dump(), **given})


def run_plan(args: argparse.Namespace) -> int:
    import secrets

    from .launch.local_chain import plan_chain, write_plan
    from .protocol import is_loopback, parse_endpoint

    activation_dtype = args.activation_dtype or "auto"
    ranges = None
    if args.auto:
        hosts, ranges = measured_plan(args, activation_dtype)
    elif args.hosts is None or args.stages is None:
        raise ValueError("Expected --stages N and --hosts (or --auto --from URL)")
    else:
        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        if len(hosts) != args.stages:
            raise ValueError(f"Expected {args.stages} host:port entries in --hosts, got {len(hosts)}")
    weights = [float(w) for w in args.weights.split(",")] if args.weights else None
    standbys: dict[int, list[str]] = {}
    for entry in args.standby:
        index, sep, endpoints = entry.partition("=")
        if not sep or not index.strip().isdigit():
            raise ValueError(f"Expected --standby N=HOST:PORT[,HOST:PORT], got {entry!r}")
        standbys.setdefault(int(index), []).extend(e.strip() for e in endpoints.split(",") if e.strip())
    topology, configs = plan_chain(model_path(args), hosts, weights=weights, ranges=ranges, standbys=standbys,
                                   auth_token=args.auth_token or secrets.token_urlsafe(32),
                                   ctx_size=args.ctx_size, lane_count=args.lane_count,
                                   activation_dtype=activation_dtype, prefill_precision=args.prefill_precision)
    off_loopback = not all(is_loopback(parse_endpoint(e)[0]) for s in topology.stages for e in s.endpoints)
    for written in write_plan(topology, configs, args.out, tls=args.tls or off_loopback):
        print(written)
    for stage in topology.stages:
        spares = f" (standbys: {', '.join(stage.standby_endpoints)})" if stage.standby_endpoints else ""
        print(f"{stage.stage_id}: layers [{stage.layer_start}, {stage.layer_end}) @ {stage.endpoint}{spares}")
    return 0


def measured_plan(args: argparse.Namespace, activation_dtype: str) -> tuple[list[str], list[tuple[int, int]]]:
    """`plan --auto`: (endpoints, layer ranges) from the measurements a running chain reports
    at --from's /v1/stages; the plan and its predictions are printed."""
    import httpx

    from .launch.measured_split import chain_inputs, model_cost, reports_of_listing
    from .launch.planner import plan_split, predict

    if not args.from_url:
        raise ValueError("Expected --from URL (a running `skippy serve`) with --auto")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    stages = httpx.get(args.from_url.rstrip("/") + "/v1/stages", headers=headers, timeout=30).raise_for_status().json()
    reports, token_cpu = reports_of_listing(stages["data"])
    model = model_cost(model_path(args), ctx_size=args.ctx_size, lane_count=args.lane_count,
                       activation_dtype=activation_dtype)
    hosts, links = chain_inputs(reports, model, token_cpu)
    plan = plan_split(model, hosts, links, use_all_hosts=args.all_hosts)
    now = predict(model, hosts, links, [(r.layer_start, r.layer_end) for r in reports])
    print(f"measured plan (the running split predicts {now.tok_s:.1f} tok/s one stream, "
          f"{now.batch_tok_s:.1f} at 8 streams):\n" + plan.describe([h.name for h in hosts]))
    return [hosts[h].name for h in plan.hosts], list(plan.ranges)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError, RuntimeError) as exc:  # a bad file, a taken port, a refused chain
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
