"""`mmserve bench ...`: the bench sub-commands' parsers and handlers, wired into the top-level parser by
mmserve/cli.py (as mmserve/demo/cli.py is). Each handler imports its bench module only when it runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from mmserve.bench import (
    KernelsBenchConfig,
    KVCacheBenchConfig,
    LongVideoBenchConfig,
    MixConfig,
    ProfileBenchConfig,
    RouterBenchConfig,
    ServeBenchConfig,
    SweepConfig,
    TensorParallelBenchConfig,
    ThroughputBenchConfig,
    add_config_options,
    config_from_options,
)
from mmserve.slo_flags import add_slo_planner_flags


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """`bench` and its sub-commands."""
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
    add_config_options(tput, ThroughputBenchConfig)
    tput.add_argument("--json", type=Path, default=None, help="write every figure and the configuration here")
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
    add_config_options(video, LongVideoBenchConfig)
    video.add_argument("--json", type=Path, default=None)
    video.add_argument(
        "--quick", action="store_true", help="4 decodes, a 16-frame 112x112 video, budgets 64/32: a smoke run"
    )
    video.add_argument(
        "--plot", type=Path, default=None, help="write the step timeline PNG here (needs matplotlib)"
    )

    _add_bench_serve_parser(bench_sub)
    _add_bench_profile_parser(bench_sub)
    _add_bench_tensor_parallel_parser(bench_sub)
    _add_bench_router_parser(bench_sub)
    _add_bench_kv_cache_parser(bench_sub)
    _add_bench_quantization_parser(bench_sub)
    kernels = bench_sub.add_parser("kernels", help="Triton paged attention vs SDPA on a GPU")
    add_kernels_options(kernels)


def add_kernels_options(p: argparse.ArgumentParser) -> None:
    """`bench kernels`'s options, as `python -m mmserve.bench.kernels` takes them too."""
    add_config_options(p, KernelsBenchConfig)
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")


def run_bench_command(args: argparse.Namespace) -> int:
    """Run `mmserve bench <args.bench_command>`."""
    if args.bench_command == "kernels":
        from mmserve.bench.kernels import bench_kernels

        return bench_kernels(config_from_options(KernelsBenchConfig, args), args.json)
    if args.bench_command == "profile":
        return _bench_profile(args)
    if args.bench_command == "serve":
        return _bench_serve(args)
    if args.bench_command == "tensor-parallel":
        return _bench_tensor_parallel(args)
    if args.bench_command == "router":
        return _bench_router(args)
    if args.bench_command == "kv-cache":
        return _bench_kv_cache(args)
    if args.bench_command == "quantization":
        return _bench_quantization(args)
    return _bench_long_video(args) if args.bench_command == "long-video" else _bench_throughput(args)


def _bench_model(model: Path | None) -> Path:
    """The given checkpoint, or the bench preset made once into ~/.cache/mmserve."""
    if model is not None:
        return model
    from mmserve.tiny_model import make_tiny_model

    model = Path.home() / ".cache" / "mmserve" / "bench-qwen2_vl"
    if not (model / "config.json").exists():
        make_tiny_model(model, arch="qwen2_vl", preset="bench", seed=0)
    return model


def _write_plots(report: dict, plot_dir: Path | None, plotter: str) -> None:
    """--plot: `plotter` of mmserve.bench.plots writes its PNGs of `report` under `plot_dir` (imported only
    when asked: matplotlib is optional)."""
    if plot_dir is None:
        return
    from mmserve.bench import plots

    for path in getattr(plots, plotter)(report, plot_dir):
        print(f"wrote {path}")


def _bench_long_video(args: argparse.Namespace) -> int:
    from mmserve.bench.long_video import bench_long_video, format_report

    try:
        cfg = config_from_options(LongVideoBenchConfig, args)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    report = bench_long_video(_bench_model(args.model), cfg.quick() if args.quick else cfg, args.json)
    print(format_report(report))
    _write_plots(report, args.plot, "plot_long_video")
    return 0


def _bench_throughput(args: argparse.Namespace) -> int:
    from mmserve.bench.throughput import bench_throughput, format_report

    try:
        cfg = config_from_options(ThroughputBenchConfig, args)
        report = bench_throughput(_bench_model(args.model), cfg.quick() if args.quick else cfg, args.json, True)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(format_report(report))
    _write_plots(report, args.plot, "plot_throughput")
    return 0


def _add_bench_serve_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "serve", help="online serving benchmark over the WebSocket chat and/or the OpenAI SSE route"
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint for the in-process server and the prompt tokenizer (default: the bench preset)",
    )
    p.add_argument("--api-key", default=os.environ.get("MMSERVE_API_KEY"))
    add_config_options(p, ServeBenchConfig)
    p.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write every figure and the configuration here")
    p.add_argument("--plot", type=Path, default=None, help="write latency CDF PNGs here (needs matplotlib)")
    _add_slo_mix_flags(p)


def _add_slo_mix_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--workload slo-mix (fcfs, priority and slo side by side, in-process servers)")
    add_config_options(g, MixConfig)
    g.add_argument("--sweep", action="store_true",
                   help="raise the chat rate geometrically (instead of --loads) until every policy's attainment "
                        "is below the bar; report each policy's capacity at the bar")  # fmt: skip
    add_config_options(g, SweepConfig)
    add_slo_planner_flags(g)


def _add_bench_profile_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("profile", help="calibrate the slo policy's step-time model on the model (JSON)")
    p.add_argument(
        "--model", type=Path, default=None, help="checkpoint directory (default: the bench preset)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("step_time.json"), help="the fitted model (--step-time-model)"
    )
    p.add_argument("--json", type=Path, default=None, help="write every sample and the fit's error here")
    add_config_options(p, ProfileBenchConfig)
    p.add_argument("--quick", action="store_true", help="a few small shapes: a smoke run")


def _add_bench_tensor_parallel_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "tensor-parallel", help="decode step time and collective bytes per step at TP sizes side by side"
    )
    p.add_argument(
        "--model", type=Path, default=None, help="checkpoint directory (default: the qwen2 bench preset)"
    )
    add_config_options(p, TensorParallelBenchConfig)
    p.add_argument("--out", type=Path, default=None, help="write tensor_parallel.json (and its PNG) here")
    p.add_argument("--no-plot", action="store_true", help="no PNG (it needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")


def _add_bench_router_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "router",
        help="mmserve replicas behind vllm-router: routing policies side by side on prefix families (shared "
        "image and system prompt): prefix-cache hit rate, tok/s, TTFT, how well families stick to a replica",
    )
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the qwen2-vl bench preset)")
    add_config_options(p, RouterBenchConfig)
    p.add_argument("--json", type=Path, default=None, help="write every figure and the configuration here")
    p.add_argument("--plot", type=Path, default=None, help="write router.png into this directory")


def _bench_router(args: argparse.Namespace) -> int:
    from mmserve.bench.router import bench_router, format_report, plot_router

    report = _run_config_bench(RouterBenchConfig, args, bench_router, format_report)
    if report is None:
        return 2
    if args.plot is not None:
        for path in plot_router(report, args.plot):
            print(f"wrote {path}")
    return 0


def _add_bench_kv_cache_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "kv-cache",
        help="KV cache dtypes (auto, fp8_e4m3, fp8_e5m2) side by side at one pool memory: sequences run at once, "
        "preemptions, tok/s, greedy agreement and first-token logprob error against the first",
    )
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the qwen2-vl bench preset)")
    add_config_options(p, KVCacheBenchConfig)
    p.add_argument("--json", type=Path, default=None, help="write every figure and the configuration here")


def _bench_kv_cache(args: argparse.Namespace) -> int:
    from mmserve.bench.kv_cache import bench_kv_cache, format_report

    return 0 if _run_config_bench(KVCacheBenchConfig, args, bench_kv_cache, format_report) is not None else 2


def _run_config_bench(cls: type, args: argparse.Namespace, bench: Any, format_report: Any) -> dict | None:
    """A bench whose options are `cls`'s fields: runs `bench(model, config)`, prints its report and writes
    --json; None (after saying why) when the options do not make a valid config."""
    try:
        cfg = config_from_options(cls, args)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return None
    report = bench(_bench_model(args.model), cfg)
    print(format_report(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return report


def _add_bench_quantization_parser(bench_sub: argparse._SubParsersAction) -> None:
    from mmserve.bench.quantization import QuantizationBenchConfig

    p = bench_sub.add_parser(
        "quantization",
        help="each quantized format (compressed-tensors fp8 / int8 / int4, AWQ, Qwen FP8) of one checkpoint on each "
        "compute path (dequantized, native) against the dense checkpoint: weight bytes, greedy agreement, "
        "logprob error, prefill and decode tok/s",
    )
    p.add_argument("--model", type=Path, default=None, help="dense checkpoint (default: the qwen2-vl bench preset)")
    add_config_options(p, QuantizationBenchConfig)
    p.add_argument("--json", type=Path, default=None, help="write every figure and the configuration here")


def _bench_quantization(args: argparse.Namespace) -> int:
    from mmserve.bench.quantization import QuantizationBenchConfig, bench_quantization, format_report

    return 0 if _run_config_bench(QuantizationBenchConfig, args, bench_quantization, format_report) is not None else 2


def _bench_tensor_parallel(args: argparse.Namespace) -> int:
    import importlib.util

    from mmserve.bench.tensor_parallel import (
        bench_tensor_parallel,
        default_model,
        format_report,
        plot_tensor_parallel,
    )

    try:
        cfg = config_from_options(TensorParallelBenchConfig, args)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    try:
        report = bench_tensor_parallel(
            args.model or default_model(), cfg, args.out, progress=not args.no_progress
        )
    except ValueError as exc:  # e.g. a TP size the checkpoint's heads do not split over
        print(str(exc), file=sys.stderr)
        return 2
    print(format_report(report))
    if args.out is not None:
        print(f"wrote {args.out / 'tensor_parallel.json'}")
        if args.no_plot:
            pass
        elif importlib.util.find_spec("matplotlib") is None:
            print("no plot: matplotlib is not installed (pip install 'mmserve[bench]')")
        else:
            for path in plot_tensor_parallel(report, args.out):
                print(f"wrote {path}")
    return 0


def _bench_profile(args: argparse.Namespace) -> int:
    from mmserve.bench.profile import bench_profile, format_profile

    try:
        cfg = config_from_options(ProfileBenchConfig, args)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    report = bench_profile(_bench_model(args.model), args.out, cfg.quick() if args.quick else cfg.resolved(), args.json)
    print(format_profile(report))
    print(f"wrote {report['out']} (serve with --scheduler-policy slo --step-time-model {report['out']})")
    return 0


def _bench_slo_mix(args: argparse.Namespace) -> int:
    from mmserve.bench.slo_mix import bench_slo_mix, format_slo_mix

    if args.url:
        print("--workload slo-mix starts its own servers (one per policy); drop --url", file=sys.stderr)
        return 2
    try:
        cfg = config_from_options(MixConfig, args)
        sweep = config_from_options(SweepConfig, args) if args.sweep else None
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    cfg = cfg.quick() if args.quick else cfg
    report = bench_slo_mix(_bench_model(args.model), cfg, args.json, progress=not args.no_progress, sweep=sweep)
    print(format_slo_mix(report))
    _write_plots(report, args.plot, "plot_slo_mix")
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    if args.workload == "slo-mix":
        return _bench_slo_mix(args)
    from mmserve.bench.serve import bench_serve, format_report

    try:
        cfg = config_from_options(ServeBenchConfig, args)
        cfg = cfg.quick() if args.quick else cfg
        # With --url the checkpoint is only the one named (the prompt tokenizer; --offline needs the server's
        # own); without, the bench preset serves.
        model = args.model if cfg.url else _bench_model(args.model)
        report = bench_serve(model, cfg, api_key=args.api_key, json_path=args.json, progress=not args.no_progress)
    except ValueError as exc:  # bad options (e.g. random-mm with no media)
        print(str(exc), file=sys.stderr)
        return 2
    print(format_report(report))
    _write_plots(report, args.plot, "plot_serve")
    return 0
