"""`mmserve bench ...`: the bench sub-commands' parsers and handlers, wired into the top-level parser by
mmserve/cli.py (as mmserve/demo/cli.py is). A command's options are its config's fields (bench/__init__) plus
the few every command shares (--model, --json, --quick, --plot); its bench module is imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmserve.bench import (
    DisaggBenchConfig,
    KernelsBenchConfig,
    KVCacheBenchConfig,
    LongVideoBenchConfig,
    MixConfig,
    ProfileBenchConfig,
    QuantizationBenchConfig,
    RouterBenchConfig,
    ServeBenchConfig,
    SweepConfig,
    TensorParallelBenchConfig,
    ThroughputBenchConfig,
    add_config_options,
    config_from_options,
)
from mmserve.slo_flags import add_slo_planner_flags

_JSON = "write every figure and the configuration here"
_PRESET = "(default: the qwen2-vl bench preset)"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """`bench` and its sub-commands."""
    bench = sub.add_parser("bench", help="measure speed, side by side in one run")
    b = bench.add_subparsers(dest="bench_command", required=True)
    _command(b, "throughput", "offline throughput of mmserve and transformers on the same requests",
             ThroughputBenchConfig, "checkpoint directory (default: the bench preset, generated into ~/.cache/mmserve)",
             plot="write throughput bar PNGs here, and for long-video the step timelines (needs matplotlib)")
    _command(b, "long-video", "step times while a long video joins running decodes", LongVideoBenchConfig,
             f"a Qwen2-VL checkpoint {_PRESET}", plot="write the step timeline PNG here (needs matplotlib)")
    serve = _command(b, "serve", "online serving benchmark over the WebSocket chat and/or the OpenAI SSE route",
                     ServeBenchConfig, "checkpoint for the in-process server and the prompt tokenizer " + _PRESET,
                     plot="write latency CDF PNGs here (needs matplotlib)", progress=True)
    serve.add_argument("--api-key", default=os.environ.get("MMSERVE_API_KEY"))
    g = serve.add_argument_group("--workload slo-mix (fcfs, priority and slo side by side, in-process servers)")
    add_config_options(g, MixConfig)
    g.add_argument("--sweep", action="store_true",
                   help="raise the chat rate geometrically (instead of --loads) until every policy's attainment "
                        "is below the bar; report each policy's capacity at the bar")
    add_config_options(g, SweepConfig)
    add_slo_planner_flags(g)
    profile = _command(b, "profile", "calibrate the slo policy's step-time model on the model (JSON)",
                       ProfileBenchConfig, "checkpoint directory " + _PRESET,
                       json_help="write every sample and the fit's error here")
    profile.add_argument("--out", type=Path, default=Path("step_time.json"),
                         help="the fitted model (--step-time-model)")
    tp = _command(b, "tensor-parallel", "decode step time and collective bytes per step at TP sizes side by side",
                  TensorParallelBenchConfig, "checkpoint directory (default: the qwen2 bench preset)", json_help=None,
                  progress=True)
    tp.add_argument("--out", type=Path, default=None, help="write tensor_parallel.json (and its PNG) here")
    tp.add_argument("--no-plot", action="store_true", help="no PNG (it needs matplotlib)")
    _command(b, "router", "mmserve replicas behind vllm-router: routing policies side by side on prefix families "
             "(shared image and system prompt): prefix-cache hit rate, tok/s, TTFT, how well families stick to a "
             "replica", RouterBenchConfig, "checkpoint " + _PRESET, plot="write router.png into this directory")
    _command(b, "disagg", "a colocated instance vs a prefill and a decode instance (NIXL) behind vllm-router's PD "
             "mode, on chats streaming while long image/video prompts arrive: chat TTFT and ITL, long-prompt TTFT, "
             "tok/s, KV read cost per block, greedy agreement", DisaggBenchConfig, "checkpoint " + _PRESET)
    _command(b, "kv-cache", "KV cache dtypes (auto, fp8_e4m3, fp8_e5m2) side by side at one pool memory: sequences "
             "run at once, preemptions, tok/s, greedy agreement and first-token logprob error against the first",
             KVCacheBenchConfig, "checkpoint " + _PRESET)
    _command(b, "quantization", "each quantized format (compressed-tensors fp8 / int8 / int4, AWQ, Qwen FP8) of one "
             "checkpoint on each compute path (dequantized, native) against the dense checkpoint: weight bytes, greedy "
             "agreement, logprob error, prefill and decode tok/s", QuantizationBenchConfig, "dense checkpoint " + _PRESET)
    _command(b, "kernels", "Triton paged attention vs SDPA on a GPU", KernelsBenchConfig, None,
             json_help="write the results here as JSON")  # fmt: skip


def _command(bench_sub: argparse._SubParsersAction, name: str, help: str, config: type, model_help: str | None, *,
             json_help: str | None = _JSON, plot: str | None = None,
             progress: bool = False) -> argparse.ArgumentParser:  # fmt: skip
    """A sub-command: --model (unless `model_help` is None), the config's options, then the shared ones asked
    for (each with its help); --quick where the config has a `quick()` (its docstring is the option's help)."""
    p = bench_sub.add_parser(name, help=help)
    if model_help is not None:
        p.add_argument("--model", type=Path, default=None, help=model_help)
    add_config_options(p, config)
    if json_help is not None:
        p.add_argument("--json", type=Path, default=None, help=json_help)
    if hasattr(config, "quick"):
        p.add_argument("--quick", action="store_true", help=config.quick.__doc__)
    if plot is not None:
        p.add_argument("--plot", type=Path, default=None, help=plot)
    if progress:
        p.add_argument("--no-progress", action="store_true")
    return p


def _bench_model(model: Path | None, arch: str = "qwen2_vl") -> Path:
    """The given checkpoint, or the bench preset of `arch` made once into ~/.cache/mmserve."""
    if model is not None:
        return model
    from mmserve.tiny_model import make_tiny_model

    model = Path.home() / ".cache" / "mmserve" / f"bench-{arch}"
    if not (model / "config.json").exists():
        make_tiny_model(model, arch=arch, preset="bench", seed=0)
    return model


# command -> (its config, its module, how the module's bench runs on (module, options, config), its plotter in
# mmserve.bench.plots or None)
_Run = Callable[[Any, argparse.Namespace, Any], dict]
_COMMANDS: dict[str, tuple[type, str, _Run, str | None]] = {
    "throughput": (ThroughputBenchConfig, "throughput",
                   lambda m, a, cfg: m.bench_throughput(_bench_model(a.model), cfg, progress=True), "plot_throughput"),
    "long-video": (LongVideoBenchConfig, "long_video",
                   lambda m, a, cfg: m.bench_long_video(_bench_model(a.model), cfg), "plot_long_video"),
    # With --url the checkpoint is only the one named (the prompt tokenizer; --offline needs the server's own).
    "serve": (ServeBenchConfig, "serve", lambda m, a, cfg: m.bench_serve(
        a.model if cfg.url else _bench_model(a.model), cfg, api_key=a.api_key, progress=not a.no_progress),
        "plot_serve"),
    "slo-mix": (MixConfig, "slo_mix", lambda m, a, cfg: m.bench_slo_mix(
        _bench_model(a.model), cfg, progress=not a.no_progress,
        sweep=config_from_options(SweepConfig, a) if a.sweep else None), "plot_slo_mix"),
    "profile": (ProfileBenchConfig, "profile", lambda m, a, cfg: m.bench_profile(_bench_model(a.model), a.out, cfg),
                None),
    "tensor-parallel": (TensorParallelBenchConfig, "tensor_parallel", lambda m, a, cfg: m.bench_tensor_parallel(
        _bench_model(a.model, "qwen2"), cfg, progress=not a.no_progress), "plot_tensor_parallel"),
    "router": (RouterBenchConfig, "router", lambda m, a, cfg: m.bench_router(_bench_model(a.model), cfg),
               "plot_router"),
    "disagg": (DisaggBenchConfig, "disagg", lambda m, a, cfg: m.bench_disagg(_bench_model(a.model), cfg), None),
    "kv-cache": (KVCacheBenchConfig, "kv_cache", lambda m, a, cfg: m.bench_kv_cache(_bench_model(a.model), cfg), None),
    "quantization": (QuantizationBenchConfig, "quantization",
                     lambda m, a, cfg: m.bench_quantization(_bench_model(a.model), cfg), None),
    "kernels": (KernelsBenchConfig, "kernels", lambda m, a, cfg: m.bench_kernels(cfg), None),
}  # fmt: skip


def run_bench_command(args: argparse.Namespace) -> int:
    """Run `mmserve bench <args.bench_command>`: its config from the options (--quick: `quick()`, else
    `resolved()` where the config has one; exit 2 with the reason when they do not make one), the bench, its
    report printed, --json and --plot written (tensor-parallel: both into --out)."""
    name = args.bench_command
    if name == "serve" and args.workload == "slo-mix":
        name = "slo-mix"
        if args.url:
            print("--workload slo-mix starts its own servers (one per policy); drop --url", file=sys.stderr)
            return 2
    cls, module_name, run, plotter = _COMMANDS[name]
    module = importlib.import_module(f"mmserve.bench.{module_name}")
    try:
        cfg = config_from_options(cls, args)
        cfg = cfg.quick() if getattr(args, "quick", False) else cfg.resolved() if hasattr(cfg, "resolved") else cfg
        report = run(module, args, cfg)
    except ValueError as exc:  # options that do not go together, e.g. random-mm with no media
        print(str(exc), file=sys.stderr)
        return 2
    json_path, plot_dir = getattr(args, "json", None), getattr(args, "plot", None)
    if name == "tensor-parallel" and args.out is not None:  # the PNG only where matplotlib is (it is optional)
        json_path, plot_dir = args.out / "tensor_parallel.json", None if args.no_plot else args.out
        if plot_dir is not None and importlib.util.find_spec("matplotlib") is None:
            print("no plot: matplotlib is not installed (pip install 'mmserve[bench]')")
            plot_dir = None
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
    print(module.format_report(report))
    if json_path is not None:
        print(f"wrote {json_path}")
    if plotter is not None and plot_dir is not None:
        from mmserve.bench import plots  # matplotlib is imported only when a plot is asked for

        for path in getattr(plots, plotter)(report, plot_dir):
            print(f"wrote {path}")
    return 0
