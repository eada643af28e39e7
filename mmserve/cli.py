"""The `mmserve` command line: `serve` (the HTTP / WebSocket server), `chat`, `make-tiny-model`, `generate`
(an offline demo) and `bench`; `chat` joins as it is built."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mmserve.bench import SYSTEMS, WORKLOADS
from mmserve.demo.cli import DEMO_COMMANDS, add_demo_parsers, run_demo_command

# The committed demo model (mmserve/demo): answers questions about shapes in images and clips.
DEFAULT_MODEL = "demo"
FALLBACK_MODEL_DIR = Path("assets/models/tiny-qwen2-vl")  # served instead while no demo model is committed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmserve", description="Serve vision-language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_serve_parser(sub)
    chat = sub.add_parser("chat", help="chat in the terminal with a running server (over its WebSocket)")
    chat.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    chat.add_argument("--api-key", default=None, help="API key (default: $MMSERVE_API_KEY)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)

    tiny = sub.add_parser("make-tiny-model", help="write a random-weight checkpoint for tests and benchmarks")
    tiny.add_argument("out_dir", type=Path)
    tiny.add_argument("--arch", default="qwen2_vl", choices=["qwen2_vl", "qwen2_5_vl", "qwen2"])
    tiny.add_argument("--preset", default="tiny", choices=["tiny", "bench"])
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
    gen.add_argument("--dtype", default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")

    bench = sub.add_parser("bench", help="measure speed, side by side in one run")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tput = bench_sub.add_parser(
        "throughput", help="offline throughput of mmserve and transformers on the same requests"
    )
    tput.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint directory (default: the bench preset, generated into ~/.cache/mmserve)",
    )
    tput.add_argument("--systems", default="mmserve,hf-static", help="comma-separated: " + ",".join(SYSTEMS))
    tput.add_argument("--num-prompts", type=int, default=64)
    tput.add_argument("--input-len", default="16-128", help="MIN-MAX prompt tokens")
    tput.add_argument("--output-len", default="16-256", help="MIN-MAX output tokens")
    tput.add_argument("--max-num-seqs", type=int, default=64)
    tput.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="default 2048; long-video: 512"
    )
    tput.add_argument(
        "--max-num-encoder-tokens",
        type=int,
        default=None,
        help="encoder budget per step (default: the token budget; long-video: 128)",
    )
    tput.add_argument("--hf-batch-size", type=int, default=16)
    tput.add_argument("--seed", type=int, default=0)
    tput.add_argument("--json", type=Path, default=None, help="write every figure and the configuration here")
    tput.add_argument("--workload", default="random", choices=list(WORKLOADS))
    tput.add_argument("--num-images", type=int, default=1, help="random-mm: images per prompt")
    tput.add_argument("--image-size", type=int, default=64, help="random-mm: image side in pixels")
    tput.add_argument(
        "--num-frames",
        type=int,
        default=None,
        help="random-mm: frames of one video per prompt (default 0: none); long-video: frames per video (64)",
    )
    tput.add_argument(
        "--video-size", type=int, default=None, help="frame side in pixels (random-mm 112, long-video 224)"
    )
    tput.add_argument("--num-videos", type=int, default=2, help="long-video: video requests arriving")
    tput.add_argument(
        "--video-interval-steps",
        type=int,
        default=8,
        help="long-video: engine steps between video arrivals (the first comes 4 steps after the text "
        "prompts could have prefilled)",
    )
    tput.add_argument("--prefix-len", type=int, default=512, help="prefix: shared prefix tokens")
    tput.add_argument(
        "--quick",
        action="store_true",
        help="16 short requests (long-video: 8 decodes, two 16-frame 112x112 videos, budgets 64/32): a smoke run",
    )
    tput.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write throughput bar PNGs here, and for long-video the step timelines (needs matplotlib)",
    )

    video = bench_sub.add_parser("long-video", help="step times while a long video joins running decodes")
    video.add_argument(
        "--model", type=Path, default=None, help="a Qwen2-VL checkpoint (default: the bench preset)"
    )
    video.add_argument("--num-decodes", type=int, default=16)
    video.add_argument("--num-frames", type=int, default=64)
    video.add_argument("--frame-size", type=int, default=224)
    video.add_argument("--max-num-batched-tokens", type=int, default=512)
    video.add_argument("--max-num-encoder-tokens", type=int, default=128)
    video.add_argument("--json", type=Path, default=None)
    video.add_argument(
        "--quick", action="store_true", help="4 decodes, a 16-frame 112x112 video, budgets 64/32: a smoke run"
    )
    video.add_argument(
        "--plot", type=Path, default=None, help="write the step timeline PNG here (needs matplotlib)"
    )

    _add_bench_serve_parser(bench_sub)
    _add_bench_profile_parser(bench_sub)
    add_demo_parsers(sub)

    bench_sub.add_parser(
        "kernels",
        help="Triton paged attention vs SDPA on a GPU (python -m mmserve.bench.kernels)",
        add_help=False,
    )

    args, rest = parser.parse_known_args(argv)
    if rest and not (args.command == "bench" and args.bench_command == "kernels"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "make-tiny-model":
        from mmserve.tiny_model import make_tiny_model

        path = make_tiny_model(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed)
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
        if args.bench_command == "kernels":
            from mmserve.bench.kernels import main as bench_kernels

            return bench_kernels(rest)
        if args.bench_command == "profile":
            return _bench_profile(args)
        if args.bench_command == "serve":
            return _bench_serve(args)
        return _bench_long_video(args) if args.bench_command == "long-video" else _bench_throughput(args)
    return 2


def _parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def _bench_model(model: Path | None) -> Path:
    """The given checkpoint, or the bench preset made once into ~/.cache/mmserve."""
    if model is not None:
        return model
    from mmserve.tiny_model import make_tiny_model

    model = Path.home() / ".cache" / "mmserve" / "bench-qwen2_vl"
    if not (model / "config.json").exists():
        make_tiny_model(model, arch="qwen2_vl", preset="bench", seed=0)
    return model


def _bench_long_video(args: argparse.Namespace) -> int:
    from mmserve.bench.long_video import bench_long_video, format_report

    if args.quick:
        args.num_decodes, args.num_frames, args.frame_size = 4, 16, 112
        args.max_num_batched_tokens, args.max_num_encoder_tokens = 64, 32
    report = bench_long_video(
        _bench_model(args.model), args.num_decodes, args.num_frames, args.frame_size,
        args.max_num_batched_tokens, args.max_num_encoder_tokens, args.json,
    )  # fmt: skip
    print(format_report(report))
    if args.plot is not None:
        from mmserve.bench.plots import plot_long_video

        for path in plot_long_video(report, args.plot):
            print(f"wrote {path}")
    return 0


def _bench_throughput(args: argparse.Namespace) -> int:
    from mmserve.bench.throughput import bench_throughput, format_report

    model = _bench_model(args.model)
    num_prompts, input_len, output_len = (
        args.num_prompts,
        _parse_range(args.input_len),
        _parse_range(args.output_len),
    )
    prefix_len, num_videos = args.prefix_len, args.num_videos
    long_video = args.workload == "long-video"
    # Per-workload defaults: long-video has long videos under a small budget, so chunking shows.
    num_frames = args.num_frames if args.num_frames is not None else 64 if long_video else 0
    video_size = args.video_size or (224 if long_video else 112)
    budget = args.max_num_batched_tokens or (512 if long_video else 2048)
    encoder_budget = args.max_num_encoder_tokens or (128 if long_video else None)
    if args.quick:
        num_prompts, input_len, output_len, prefix_len = 16, (8, 32), (4, 32), min(prefix_len, 128)
        if long_video:
            num_prompts, num_videos, num_frames, video_size = 8, min(num_videos, 2), 16, 112
            output_len, budget, encoder_budget = (2, 8), 64, 32  # outputs then cover the videos, no more
    try:
        report = bench_throughput(
            model,
            args.systems.split(","),
            num_prompts,
            input_len,
            output_len,
            args.max_num_seqs,
            budget,
            args.hf_batch_size,
            args.seed,
            args.json,
            workload_name=args.workload,
            num_images=args.num_images,
            image_size=args.image_size,
            prefix_len=prefix_len,
            progress=True,
            num_frames=num_frames,
            video_size=video_size,
            num_videos=num_videos,
            video_interval_steps=args.video_interval_steps,
            max_num_encoder_tokens=encoder_budget,
        )
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(format_report(report))
    if args.plot is not None:
        from mmserve.bench.plots import plot_throughput

        for path in plot_throughput(report, args.plot):
            print(f"wrote {path}")
    return 0


def _add_bench_serve_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "serve", help="online serving benchmark over the WebSocket chat and/or the OpenAI SSE route"
    )
    p.add_argument("--url", default=None, help="a running server; default: start one in-process on --model")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint for the in-process server and the prompt tokenizer (default: the bench preset)",
    )
    p.add_argument("--api-key", default=os.environ.get("MMSERVE_API_KEY"))
    p.add_argument("--transport", default="ws", help="ws, http or ws,http (the same requests over each)")
    p.add_argument(
        "--workload",
        default="random",
        choices=["random", "random-mm", "prefix", "slo-mix"],
        help="prefix: every prompt starts with the same --num-images images and --prefix-len tokens of "
        "text; request 0 is sent alone and the rest wait for its first token (or its end), so it is a "
        "cold miss and the others hit the caches; TTFT of the first and of the repeats are reported "
        "apart (each transport gets a prefix of its own)",
    )
    p.add_argument(
        "--media-source",
        default="data-url",
        choices=["data-url", "upload"],
        help="random-mm, prefix: how images and videos travel (upload: each distinct one once, before timing)",
    )
    p.add_argument("--prefix-len", type=int, default=512, help="prefix: shared prefix tokens (approximate)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="16-128", help="MIN-MAX prompt tokens (approximate)")
    p.add_argument("--output-len", default="16-256", help="MIN-MAX output tokens (ignore_eos)")
    p.add_argument(
        "--num-images",
        type=int,
        default=None,
        help="images per prompt: random-mm, random ones (default 1); prefix, the same ones in front of "
        "every prompt (default 0)",
    )
    p.add_argument("--image-size", type=int, default=64, help="random-mm, prefix: image side in pixels")
    p.add_argument(
        "--num-frames", type=int, default=0, help="random-mm: frames of one mp4 video per prompt (0: none)"
    )
    p.add_argument("--video-size", type=int, default=112, help="random-mm: video frame side in pixels")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (default: all at once)"
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="closed loop: at most N in flight")
    p.add_argument(
        "--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000"
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="in-process server only")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="in-process server only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write every figure and the configuration here")
    p.add_argument("--plot", type=Path, default=None, help="write latency CDF PNGs here (needs matplotlib)")
    _add_slo_mix_flags(p)


def _add_slo_mix_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--workload slo-mix (fcfs, priority and slo side by side, in-process servers)")
    g.add_argument("--loads", default="0.5,1,2", help="comma-separated chat arrival rates (req/s)")
    g.add_argument("--duration-s", type=float, default=20.0, help="seconds of chats per load")
    g.add_argument("--num-batch", type=int, default=6, help="batch jobs per load (text, multi-image, video)")
    g.add_argument("--policies", default="fcfs,priority,slo")
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="interactive TTFT target")
    g.add_argument("--slo-tbt-ms", type=float, default=100.0, help="interactive TBT target (judged on TPOT)")
    _add_slo_planner_flags(g)


def _add_bench_profile_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("profile", help="calibrate the slo policy's step-time model on the model (JSON)")
    p.add_argument(
        "--model", type=Path, default=None, help="checkpoint directory (default: the bench preset)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("step_time.json"), help="the fitted model (--step-time-model)"
    )
    p.add_argument("--json", type=Path, default=None, help="write every sample and the fit's error here")
    p.add_argument("--device", default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="largest step of the sweep")
    p.add_argument("--quick", action="store_true", help="a few small shapes: a smoke run")


def _bench_profile(args: argparse.Namespace) -> int:
    import dataclasses

    from mmserve.bench.profile import QUICK_PROFILE, ProfileConfig, bench_profile, format_profile

    cfg = QUICK_PROFILE if args.quick else ProfileConfig(max_num_batched_tokens=args.max_num_batched_tokens)
    if not args.quick:
        cfg = dataclasses.replace(cfg, chunked_len=max(cfg.chunked_len, 2 * args.max_num_batched_tokens))
    report = bench_profile(_bench_model(args.model), args.out, cfg, args.json, args.device)
    print(format_profile(report))
    print(f"wrote {report['out']} (serve with --scheduler-policy slo --step-time-model {report['out']})")
    return 0


def _bench_slo_mix(args: argparse.Namespace) -> int:
    from mmserve.bench.slo_mix import QUICK_MIX, MixConfig, bench_slo_mix, format_slo_mix

    if args.url:
        print("--workload slo-mix starts its own servers (one per policy); drop --url", file=sys.stderr)
        return 2
    try:
        cfg = QUICK_MIX if args.quick else MixConfig(
            loads=tuple(float(x) for x in args.loads.split(",") if x.strip()), duration_s=args.duration_s,
            num_batch=args.num_batch, ttft_ms=args.slo_ttft_ms, tbt_ms=args.slo_tbt_ms,
            policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            step_time_model=args.step_time_model, step_time_headroom=args.step_time_headroom, seed=args.seed,
            tbt_slack_ms=args.tbt_slack_ms, batch_min_share=args.batch_min_share,
        )  # fmt: skip
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    report = bench_slo_mix(_bench_model(args.model), cfg, args.json, progress=not args.no_progress)
    print(format_slo_mix(report))
    if args.plot is not None:
        from mmserve.bench.plots import plot_slo_mix

        for path in plot_slo_mix(report, args.plot):
            print(f"wrote {path}")
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    if args.workload == "slo-mix":
        return _bench_slo_mix(args)
    from mmserve.bench.metrics import parse_goodput
    from mmserve.bench.serve import QUICK, TRANSPORTS, bench_serve, format_report

    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    if not transports or set(transports) - set(TRANSPORTS):
        print(f"--transport: choose from {', '.join(TRANSPORTS)}", file=sys.stderr)
        return 2
    try:
        slos = parse_goodput(args.goodput)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    num_prompts, input_len, output_len = (
        args.num_prompts,
        _parse_range(args.input_len),
        _parse_range(args.output_len),
    )
    if args.quick:
        num_prompts, input_len, output_len = QUICK["num_prompts"], QUICK["input_len"], QUICK["output_len"]
    model = args.model if args.url else _bench_model(args.model)
    try:
        report = bench_serve(
            model=model,
            url=args.url,
            transports=transports,
            workload=args.workload,
            num_prompts=num_prompts,
            input_len=input_len,
            output_len=output_len,
            num_images=args.num_images,
            image_size=args.image_size,
            prefix_len=min(args.prefix_len, 128) if args.quick else args.prefix_len,
            media_source=args.media_source,
            num_frames=args.num_frames,
            video_size=args.video_size,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            goodput_slos=slos or None,
            api_key=args.api_key,
            seed=args.seed,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            json_path=args.json,
            progress=not args.no_progress,
        )
    except ValueError as exc:  # bad workload options (e.g. random-mm with no media)
        print(str(exc), file=sys.stderr)
        return 2
    print(format_report(report))
    if args.plot is not None:
        from mmserve.bench.plots import plot_serve

        for path in plot_serve(report, args.plot):
            print(f"wrote {path}")
    return 0


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
        "--served-model-name", default=None, help="the model id clients see (default: --model)"
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
    serve.add_argument("--dtype", default=None)
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048)
    serve.add_argument("--max-num-seqs", type=int, default=128)
    serve.add_argument("--num-kv-blocks", type=int, default=None)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument(
        "--scheduler-policy", default="fcfs", choices=["fcfs", "priority", "no_chunk", "static", "slo"]
    )
    serve.add_argument("--no-prefix-caching", action="store_true")
    _add_slo_flags(serve)
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )


def _add_slo_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of the `slo` scheduler policy (service_tier / slo on requests pick class and targets)."""
    g = parser.add_argument_group("SLO scheduling (--scheduler-policy slo)")
    g.add_argument("--interactive-ttft-ms", type=float, default=1000.0,
                   help="default time-to-first-token target of interactive requests (0: none)")  # fmt: skip
    g.add_argument("--interactive-tbt-ms", type=float, default=100.0,
                   help="default time-between-tokens target of interactive requests (0: none)")  # fmt: skip
    g.add_argument("--admission-control", default="off", choices=["off", "downgrade", "reject"],
                   help="a chat whose TTFT cannot be met: run it as batch, or refuse it with 429")  # fmt: skip
    g.add_argument("--max-batch-decode-skips", type=int, default=4,
                   help="a batch decode waits at most this many steps in a row")  # fmt: skip
    _add_slo_planner_flags(g)


def _add_slo_planner_flags(g: argparse._ArgumentGroup) -> None:
    """How the `slo` policy plans steps: shared by `serve` and `bench serve --workload slo-mix`."""
    g.add_argument("--step-time-model", default=None,
                   help="step-time model JSON written by `mmserve bench profile`")  # fmt: skip
    g.add_argument("--batch-min-share", type=float, default=0.1,
                   help="share of each step kept for batch work when there is some")  # fmt: skip
    g.add_argument("--step-time-headroom", type=float, default=0.1,
                   help="steps are planned to (1 - this) x the tightest interactive TBT target")  # fmt: skip
    g.add_argument("--tbt-slack-ms", type=float, default=0.0,
                   help="a stream ahead of its TBT pace may lend up to this much of its lead to one step "
                        "(TPOT is a mean); 0: every step fits the TBT target")  # fmt: skip


def _slo_engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The EngineArgs of _add_slo_flags; a target of 0 means none."""
    return {
        "interactive_ttft_ms": args.interactive_ttft_ms or None,
        "interactive_tbt_ms": args.interactive_tbt_ms or None,
        "admission_control": args.admission_control,
        "step_time_model": args.step_time_model,
        "max_batch_decode_skips": args.max_batch_decode_skips,
        "batch_min_share": args.batch_min_share,
        "step_time_headroom": args.step_time_headroom,
        "tbt_slack_ms": args.tbt_slack_ms,
    }


def _serve(args: argparse.Namespace) -> int:
    from mmserve.api.server import run_server
    from mmserve.api.settings import ServerSettings
    from mmserve.config import EngineArgs
    from mmserve.encoders.media import MediaLimits

    args.model = _model_or_fallback(args.model)
    media_limits = MediaLimits(
        decode_workers=args.decode_workers,
        decode_timeout_s=args.decode_timeout_s,
        decode_memory_mib=args.decode_memory_mib,
    )
    engine_args = EngineArgs(
        str(args.model),
        device=args.device,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        scheduler_policy=args.scheduler_policy,
        enable_prefix_caching=not args.no_prefix_caching,
        **_slo_engine_kwargs(args),
    )
    settings = ServerSettings(
        api_key=args.api_key or None,
        data_dir=args.data_dir,
        served_model_name=args.served_model_name,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(d.strip() for d in args.allowed_media_domains.split(",") if d.strip()),
        max_image_upload_bytes=args.max_image_upload_bytes,
        max_video_upload_bytes=args.max_video_upload_bytes,
        max_concurrent_requests_per_key=args.max_concurrent_requests_per_key,
        cors_allow_origins=tuple(o.strip() for o in args.cors_allow_origins.split(",") if o.strip()),
        shutdown_timeout_s=args.shutdown_timeout_s,
    )
    return run_server(
        engine_args,
        settings,
        host=args.host,
        port=args.port,
        max_waiting_requests=args.max_waiting_requests,
        log_level=args.log_level,
        media_limits=media_limits,
    )


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
