"""The `mmserve` command line: `serve` (the HTTP / WebSocket server), `chat`, `make-tiny-model`, `generate`
(an offline demo), and the wiring of `bench` (mmserve/bench/cli.py) and the demo commands (mmserve/demo/cli.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mmserve.bench.cli import add_bench_parser, run_bench_command
from mmserve.config import KV_CACHE_DTYPE_NAMES, QUANT_COMPUTE_CHOICES
from mmserve.demo.cli import DEMO_COMMANDS, add_demo_parsers, run_demo_command
from mmserve.slo_flags import add_slo_planner_flags

# The committed demo model (mmserve/demo): answers questions about shapes in images and clips.
DEFAULT_MODEL = "demo"
FALLBACK_MODEL_DIR = Path("assets/models/tiny-qwen2-vl")  # served instead while no demo model is committed


def build_parser() -> argparse.ArgumentParser:
    """Every `mmserve` command's options (what `main` parses; deployment manifests are checked against it)."""
    parser = argparse.ArgumentParser(prog="mmserve", description="Serve vision-language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_serve_parser(sub)
    chat = sub.add_parser("chat", help="chat in the terminal with a running server (over its WebSocket)")
    chat.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    chat.add_argument("--api-key", default=None, help="API key (default: $MMSERVE_API_KEY)")
    chat.add_argument("--max-tokens", type=_chat_max_tokens, default=256, help="at least 1 (default: 256)")
    chat.add_argument("--temperature", type=_chat_temperature, default=0.7, help="0 to 2, as the API (default: 0.7)")

    tiny = sub.add_parser("make-tiny-model", help="write a random-weight checkpoint for tests and benchmarks")
    tiny.add_argument("out_dir", type=Path)
    tiny.add_argument(
        "--arch", default="qwen2_vl",
        choices=["qwen2_vl", "qwen2_5_vl", "qwen2", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe"],
    )  # fmt: skip
    tiny.add_argument(
        "--preset", default="tiny", choices=["tiny", "bench", "qwen2-vl-2b"],
        help="tiny: tests; bench: `mmserve bench`; qwen2-vl-2b: Qwen2-VL-2B-Instruct's shapes with random bf16 "
        "weights (qwen2_vl only; 4.4 GB (4.2 GiB) in 2 GB safetensors shards)",
    )  # fmt: skip
    tiny.add_argument("--seed", type=int, default=0)

    gen = sub.add_parser("generate", help="offline generation: chat prompts in, streamed-free text out")
    gen.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint directory, or 'demo' (the default): the demo model trained on easy-vqa shapes",
    )
    gen.add_argument("--prompt", action="append", help="a user message; repeat for a batch")
    gen.add_argument("--image", action="append", default=[], help="image file or URL shown with every prompt")
    gen.add_argument("--video", action="append", default=[], help="video file or URL shown with every prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--device", default=None)
    gen.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                     help="as serve's --dtype")  # fmt: skip
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")

    add_bench_parser(sub)
    add_demo_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "make-tiny-model":
        from mmserve.tiny_model import make_tiny_model

        try:
            path = make_tiny_model(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed)
        except ValueError as exc:  # e.g. a hub-scale preset with another arch
            parser.error(f"make-tiny-model: {exc}")
        print(f"wrote {args.arch} ({args.preset}) checkpoint to {path}")
        return 0
    if args.command == "generate":
        return _generate(args)
    if args.command in DEMO_COMMANDS:
        return run_demo_command(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "chat":
        from mmserve.chat_cli import run_chat

        return run_chat(args)
    if args.command == "bench":
        return run_bench_command(args)
    return 2


def _chat_temperature(text: str) -> float:
    """`chat --temperature`: the API's range, [0, 2], checked before connecting."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError(f"{text} is outside [0, 2]")
    return value


def _chat_max_tokens(text: str) -> int:
    """`chat --max-tokens`: a whole number of at least 1, as the API."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is less than 1")
    return value


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API and WebSocket chat")
    serve.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint directory, or 'demo' (the default): the demo model trained on easy-vqa shapes",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes sharing the port and one engine core (media decoding and JSON scale with cores)",
    )
    serve.add_argument(
        "--no-engine-process",
        action="store_true",
        help="run the engine core on a thread of the server process (debugging) instead of its own process",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("MMSERVE_API_KEY"),
        help="required as a Bearer token (env MMSERVE_API_KEY)",
    )
    serve.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("MMSERVE_DATA_DIR") or Path.home() / ".cache" / "mmserve" / "data"),
        help="where uploads are stored (env MMSERVE_DATA_DIR; default ~/.cache/mmserve/data)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model id(s) requests may name; responses echo the first (default: --model); others: 404",
    )
    serve.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        help="a chat template file used instead of the checkpoint's",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        help="how tool calls are read out of the output: hermes | qwen3_xml (default: from the chat template)",
    )
    serve.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "vllm"],
        help="auto: the checkpoint's generation_config.json sets the default temperature, top_p, top_k and "
        "repetition_penalty; vllm: OpenAI's defaults",
    )
    serve.add_argument(
        "--allowed-local-media-path", type=Path, default=None, help="chat may read files under DIR"
    )
    serve.add_argument(
        "--allowed-media-domains",
        default="",
        help="comma-separated hosts ('*.example.com' too) chat may fetch media URLs from (default: none)",
    )
    serve.add_argument("--max-image-upload-bytes", type=int, default=20 * 1000 * 1000)
    serve.add_argument("--max-video-upload-bytes", type=int, default=200 * 1000 * 1000)
    serve.add_argument(
        "--max-waiting-requests", type=int, default=1024, help="beyond this, 429 with Retry-After"
    )
    serve.add_argument(
        "--decode-workers",
        type=int,
        default=2,
        help="media decode worker processes (isolated from the server)",
    )
    serve.add_argument(
        "--decode-timeout-s",
        type=float,
        default=30.0,
        help="a media item still decoding after this fails (400)",
    )
    serve.add_argument(
        "--decode-memory-mib",
        type=int,
        default=4096,
        help="memory one media item may use in its decode worker",
    )
    serve.add_argument(
        "--max-concurrent-requests-per-key",
        type=int,
        default=None,
        help="beyond this, 429 (default: no limit)",
    )
    serve.add_argument(
        "--cors-allow-origins", default="", help="comma-separated origins allowed by CORS (default: CORS off)"
    )
    serve.add_argument("--shutdown-timeout-s", type=float, default=10.0, help="SIGTERM: drain this long")
    serve.add_argument("--device", default=None)
    serve.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX-512 BF16 or AMX), float32 on "
        "other CPUs (default: $MMSERVE_DTYPE, else auto)",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPE_NAMES),
        help="the KV cache's element type: auto (the compute dtype), fp8 / fp8_e4m3 or fp8_e5m2 (one byte per "
        "value, scaled per KV head by the checkpoint's k_scale / v_scale, else 1.0): twice the tokens of a bf16 "
        "cache in the same memory, four times an fp32 one",
    )
    serve.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="with an FP8 KV cache: each layer's per-head scales from the first step's K/V (2x headroom over "
        "their largest magnitude) instead of the checkpoint's or 1.0",
    )
    serve.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step eagerly instead of replaying decode steps from CUDA graphs",
    )
    serve.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        help="the decode batch sizes captured as CUDA graphs (default: 1 2 4 and every multiple of 8 up to "
        "--max-num-seqs, at most 512); a larger decode batch runs eagerly",
    )
    serve.add_argument(
        "--quant-compute",
        default=None,
        choices=list(QUANT_COMPUTE_CHOICES),
        help="a quantized checkpoint's compute path: dequantized (weights dequantized once at load: full memory, "
        "the fastest on the CPU), native (codes kept: int4 / int8 / fp8 kernels), or auto (native where it measures "
        "acceptable: int4, int8 x int8, fp8 GEMMs on GPUs that have them) (default: $MMSERVE_QUANT_COMPUTE, else "
        "auto)",
    )
    serve.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="bytes for the KV cache (default: 2 GiB on the CPU, 80%% of the free memory on a GPU); "
        "--num-kv-blocks overrides",
    )
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048)
    serve.add_argument("--max-num-seqs", type=int, default=128)
    serve.add_argument("--num-kv-blocks", type=int, default=None)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument(
        "--scheduler-policy", default="fcfs", choices=["fcfs", "priority", "no_chunk", "static", "slo"]
    )
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument(
        "--max-num-encoder-tokens",
        type=int,
        default=None,
        help="embedding tokens the encoder may produce per step (default: the token budget)",
    )
    serve.add_argument(
        "--no-chunk-encoder",
        action="store_true",
        help="encode each image or video whole in one step, as vLLM does (default: a video's frame groups "
        "as the prefill reaches them)",
    )
    serve.add_argument(
        "--encoder-token-cost",
        type=float,
        default=0.0,
        help="tokens of the step's token budget that each embedding token the encoder computes uses up, so "
        "steps that encode prefill less (default 0: the encoder has only its own budget)",
    )
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block (and per prefix-cache hash)")
    _add_slo_flags(serve)
    _add_parallel_flags(serve)
    _add_replica_flags(serve)
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )


def _add_replica_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas (behind a router such as vllm-router)")
    g.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help='publish KV cache events in vLLM\'s format (its --kv-events-config), e.g. \'{"enable_kv_cache_events": '
        'true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'',
    )
    g.add_argument(
        "--kv-transfer-config",
        default=None,
        metavar="JSON",
        help='prefill/decode disaggregation over NIXL in vLLM\'s protocol (its --kv-transfer-config), e.g. '
        '\'{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"side_channel_port": '
        '5600}}\'; requests then take vLLM\'s kv_transfer_params (vllm-router --vllm-pd-disaggregation drives them)',
    )
    g.add_argument(
        "--ec-transfer-config",
        default=None,
        metavar="JSON",
        help='encoder disaggregation over a shared directory in vLLM\'s protocol (its --ec-transfer-config), e.g. '
        '\'{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer", "ec_connector_extra_config": '
        '{"shared_storage_path": "/shared/ec"}}\': an ec_producer (encoder instance) stores every image and video '
        'group it encodes there; an ec_consumer (prefill instance) loads them instead of encoding',
    )
    g.add_argument(
        "--vllm-metric-names",
        action="store_true",
        help="also export the scheduler gauges under vLLM's names (vllm:num_requests_waiting, "
        "vllm:kv_cache_usage_perc...) for gateway scorers and autoscalers that read them",
    )


def _add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tensor parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks (processes) one model is split over: gloo on the CPU, NCCL on CUDA")  # fmt: skip
    g.add_argument("--distributed-timeout-s", type=float, default=300.0,
                   help="a collective waiting longer for a rank fails and the engine stops (a hung rank)")  # fmt: skip
    g.add_argument("--mm-encoder-tp-mode", default="data", choices=["data", "weights"],
                   help="the vision tower over the ranks: replicated, each rank encoding part of the step's "
                   "media (data), or sharded like the decoder (weights)")  # fmt: skip
    g.add_argument("--tensor-parallel-local-ranks", type=int, default=None,
                   help="ranks started on this node (default: all); the others join from other nodes "
                   "with `python -m mmserve.engine.rank_worker` and torchrun's variables")  # fmt: skip
    g.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   help="address of this node's rendezvous store (default: $MASTER_ADDR or loopback)")  # fmt: skip
    g.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", "0")),
                   help="its port (default: $MASTER_PORT, else any free port)")  # fmt: skip


def parallel_engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {
        "tensor_parallel_size": args.tensor_parallel_size,
        "distributed_timeout_s": args.distributed_timeout_s,
        "tensor_parallel_local_ranks": args.tensor_parallel_local_ranks,
        "mm_encoder_tp_mode": args.mm_encoder_tp_mode,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
    }


def _add_slo_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of the `slo` scheduler policy (service_tier / slo on requests pick class and targets)."""
    g = parser.add_argument_group("Step planning (--max-step-ms: every policy) and SLO scheduling (--scheduler-policy slo)")
    g.add_argument("--interactive-ttft-ms", type=float, default=1000.0,
                   help="default time-to-first-token target of interactive requests (0: none)")  # fmt: skip
    g.add_argument("--interactive-tbt-ms", type=float, default=100.0,
                   help="default time-between-tokens target of interactive requests (0: none)")  # fmt: skip
    g.add_argument("--slo-admission", "--admission-control", dest="admission_control", default="off",
                   choices=["off", "downgrade", "reject"],
                   help="a chat predicted to miss its TTFT: run it as batch, or refuse it with 429 and "
                        "Retry-After (the predicted drain time of the work ahead)")  # fmt: skip
    g.add_argument("--max-batch-decode-skips", type=int, default=4,
                   help="a batch decode waits at most this many steps in a row")  # fmt: skip
    add_slo_planner_flags(g)


def _slo_engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The EngineArgs of _add_slo_flags; a target of 0 means none."""
    return {
        "interactive_ttft_ms": args.interactive_ttft_ms or None,
        "interactive_tbt_ms": args.interactive_tbt_ms or None,
        "admission_control": args.admission_control,
        "step_time_model": args.step_time_model,
        "max_step_ms": args.max_step_ms or None,
        "max_batch_decode_skips": args.max_batch_decode_skips,
        "batch_min_share": args.batch_min_share,
        "step_time_headroom": args.step_time_headroom,
        "tbt_slack_ms": args.tbt_slack_ms,
    }


def _serve(args: argparse.Namespace) -> int:
    from mmserve.api.server import ServeOptions, run_server
    from mmserve.api.settings import ServerSettings
    from mmserve.config import ECTransferConfig, EngineArgs, KVEventsConfig, KVTransferConfig
    from mmserve.encoders.media import MediaLimits
    from mmserve.errors import MMServeError

    args.model = _model_or_fallback(args.model)
    media_limits = MediaLimits(
        decode_workers=args.decode_workers,
        decode_timeout_s=args.decode_timeout_s,
        decode_memory_mib=args.decode_memory_mib,
    )
    try:
        engine_args = EngineArgs(
            str(args.model),
            device=args.device,
            dtype=args.dtype,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
            kv_cache_dtype=args.kv_cache_dtype,
            calculate_kv_scales=args.calculate_kv_scales,
            quant_compute=args.quant_compute,
            enforce_eager=args.enforce_eager,
            cuda_graph_sizes=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None,
            max_model_len=args.max_model_len,
            scheduler_policy=args.scheduler_policy,
            enable_prefix_caching=not args.no_prefix_caching,
            max_num_encoder_tokens=args.max_num_encoder_tokens,
            chunk_encoder=not args.no_chunk_encoder,
            encoder_token_cost=args.encoder_token_cost,
            block_size=args.block_size,
            kv_events_config=KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None,
            kv_transfer_config=KVTransferConfig.from_json(args.kv_transfer_config) if args.kv_transfer_config else None,
            ec_transfer_config=ECTransferConfig.from_json(args.ec_transfer_config) if args.ec_transfer_config else None,
            **_slo_engine_kwargs(args),
            **parallel_engine_kwargs(args),
        )
    except MMServeError as exc:  # a bad engine option: one line, not a traceback
        print(f"mmserve: {exc}", file=sys.stderr)
        return 2
    settings = ServerSettings(
        api_key=args.api_key or None,
        data_dir=args.data_dir,
        # As vLLM: without --served-model-name the model is served under --model as given ("demo").
        served_model_name=tuple(args.served_model_name) if args.served_model_name else (str(args.model),),
        chat_template=_read_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        generation_config=args.generation_config,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(d.strip() for d in args.allowed_media_domains.split(",") if d.strip()),
        max_image_upload_bytes=args.max_image_upload_bytes,
        max_video_upload_bytes=args.max_video_upload_bytes,
        max_concurrent_requests_per_key=args.max_concurrent_requests_per_key,
        cors_allow_origins=tuple(o.strip() for o in args.cors_allow_origins.split(",") if o.strip()),
        shutdown_timeout_s=args.shutdown_timeout_s,
        vllm_metric_names=args.vllm_metric_names,
    )
    if args.api_server_count < 1:
        print("mmserve: --api-server-count must be at least 1", file=sys.stderr)
        return 2
    if args.api_server_count > 1 and args.no_engine_process:
        print("mmserve: --api-server-count needs the engine core in its own process", file=sys.stderr)
        return 2
    options = ServeOptions(
        engine_args,
        settings,
        host=args.host,
        port=args.port,
        max_waiting_requests=args.max_waiting_requests,
        log_level=args.log_level,
        media_limits=media_limits,
        engine_process=not args.no_engine_process,
    )
    return run_server(options, api_server_count=args.api_server_count)


def _read_chat_template(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SystemExit(f"mmserve: --chat-template {path}: {exc.strerror or exc}") from None


def _model_or_fallback(model: str) -> str:
    """`model`, unless it is the default "demo" and this checkout has no trained demo checkpoint: then the
    tiny random-weight model, generated on first use (its answers are noise), so `make serve` always runs."""
    from mmserve.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME

    if model != DEMO_MODEL_NAME or (DEMO_MODEL_DIR / "config.json").is_file() or Path(model).exists():
        return model
    if not (FALLBACK_MODEL_DIR / "config.json").is_file():
        from mmserve.tiny_model import make_tiny_model

        print(f"no demo model in this checkout: generating the tiny random model at {FALLBACK_MODEL_DIR} "
              "(its answers are noise; see `mmserve train-demo`)", file=sys.stderr)  # fmt: skip
        make_tiny_model(FALLBACK_MODEL_DIR)
    return str(FALLBACK_MODEL_DIR)


def _generate(args: argparse.Namespace) -> int:
    from mmserve import LLM, SamplingParams

    prompts = args.prompt or [
        "Describe a red circle on a white background.",
        "What is the capital of France?",
        "Write a haiku about paged attention.",
    ]
    llm = LLM(_model_or_fallback(args.model), device=args.device, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    media = [{"type": "image", "image": path} for path in args.image]
    media += [{"type": "video", "video": path} for path in args.video]

    def message(prompt: str) -> dict:
        content = [*media, {"type": "text", "text": prompt}] if media else prompt
        return {"role": "user", "content": content}

    start = time.perf_counter()
    outputs = llm.chat([[message(p)] for p in prompts], params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs, strict=True):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": out.text,
                        "finish_reason": out.finish_reason,
                        "num_tokens": len(out.token_ids),
                        "num_prompt_tokens": len(out.prompt_token_ids),
                    }
                )
            )
        else:
            print(f"> {prompt}\n{out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]\n")
    num_tokens = sum(len(o.token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f}s ({num_tokens / elapsed:.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
