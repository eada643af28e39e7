"""PNG plots of bench reports (the JSON dicts of throughput.py / serve.py / long_video.py / slo_mix.py / router.py /
tensor_parallel.py): throughput bars with ratios, latency CDFs, step-composition timelines, policy and TP bars.
matplotlib is optional and imported only here, lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or pip install 'mmserve[bench]')") from None
    return plt


def _figure(out_dir: Path, nrows: int, ncols: int, figsize: tuple[float, float], **kwargs: Any) -> tuple[Any, Any]:
    """A new figure and its axes (matplotlib's `subplots`), `out_dir` made."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return _pyplot().subplots(nrows, ncols, figsize=figsize, **kwargs)


def _save(fig: Any, path: Path, dpi: int = 100) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return path


def plot_throughput(report: dict, out_dir: Path) -> list[Path]:
    """Output tokens/s per system, each bar labelled with its ratio to hf-static (or to the first
    system) and its efficiency against the roofline bound, which is drawn as a line."""
    systems = list(report["systems"].values())
    names = [r["system"] for r in systems]
    rates = [r["output_tokens_per_s"] for r in systems]
    base_name = "hf-static" if "hf-static" in report["systems"] else names[0]
    base = report["systems"][base_name]["output_tokens_per_s"]
    fig, ax = _figure(out_dir, 1, 1, (1.4 * len(names) + 2.5, 3.6))
    ax.bar_label(ax.bar(names, rates, color="#4c72b0"), fontsize=8,
                 labels=[f"{r['output_tokens_per_s'] / base:.2f}x\n{r['efficiency']:.0%} of bound" for r in systems])  # fmt: skip
    ax.axhline(report["output_tokens_per_s_bound"], color="#c44e52", ls="--", lw=1, label="roofline bound")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput, {report['config'].get('workload', 'random')} (ratios vs {base_name})", fontsize=9)
    ax.margins(y=0.25)
    ax.legend(fontsize=8, loc="upper right")
    path = _save(fig, out_dir / f"throughput-{report['config'].get('workload', 'random')}.png")
    # long-video: how chunked and unchunked mmserve composed their steps as the videos arrived.
    runs = [(f"{name}: text ITL p99 {r['itl_p99_ms']:.1f} ms" if r.get("itl_p99_ms") is not None else name,
             r["timeline"]) for name, r in report["systems"].items()
            if name in ("mmserve", "mmserve-no-chunk") and r.get("timeline")]  # fmt: skip
    return [path, _plot_step_timelines(runs, out_dir / "throughput-long-video-steps.png")] if runs else [path]


def plot_serve(report: dict, out_dir: Path) -> list[Path]:
    """Empirical CDFs of TTFT, TPOT, ITL and e2e latency, one line per transport."""
    fig, axes = _figure(out_dir, 1, 4, (14, 3.2))
    panels = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itls_s", "ITL"), ("e2el_s", "e2e latency"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for transport, rows in report["requests"].items():
            values = [x for row in rows if row["success"] and row[key] is not None
                      for x in (row[key] if isinstance(row[key], list) else [row[key]])]  # fmt: skip
            if not values:
                continue
            x = np.sort(np.asarray(values) * 1e3)
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=transport)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[0].legend(fontsize=8)
    return [_save(fig, out_dir / f"serve-latency-cdf-{report['config']['workload']}.png")]


def plot_long_video(report: dict, out_dir: Path) -> list[Path]:
    """Step composition while the long video prefills, encoder chunking on and off: decode / prefill /
    encoder tokens per step (bars) and each step's time (line, right axis)."""
    from mmserve.bench.long_video import run_label

    runs = [(run_label(run), run["timeline"]) for run in report["runs"]]
    return [_plot_step_timelines(runs, out_dir / "long-video-steps.png")]


def _plot_step_timelines(runs: list[tuple[str, list[dict]]], path: Path) -> Path:
    """One panel per (title, timeline): decode / prefill / encoder tokens per step as stacked bars and
    the step's time as a line on the right axis."""
    fig, axes = _figure(path.parent, len(runs), 1, (9, 2.6 * len(runs)), squeeze=False)
    for ax, (title, steps) in zip(axes[:, 0], runs, strict=True):
        x = np.arange(len(steps))
        bottom = np.zeros(len(steps))
        for key, color in (("decode_tokens", "#55a868"), ("prefill_tokens", "#4c72b0"), ("encoder_tokens", "#dd8452")):
            values = np.array([s[key] for s in steps], dtype=float)
            ax.bar(x, values, bottom=bottom, color=color, label=key.replace("_", " "))
            bottom += values
        ax.set_ylabel("tokens")
        ax.set_title(title, fontsize=9)
        twin = ax.twinx()
        twin.plot(x, [s["duration_s"] * 1e3 for s in steps], color="black", marker=".", lw=1, label="step ms")
        twin.set_ylabel("step time (ms)")
        twin.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("step")
    return _save(fig, path)


def plot_slo_mix(report: dict, out_dir: Path) -> list[Path]:
    """slo-mix: interactive SLO attainment, chat goodput and batch throughput against chat load, one
    line per policy (one small PNG, three panels)."""
    fig, axes = _figure(out_dir, 1, 3, (10.5, 3.0))
    panels = (
        ("chat SLO attainment (%)", lambda m: 100 * (m["interactive"]["slo_attainment"] or 0.0)),
        ("chat goodput (req/s)", lambda m: m["interactive"]["goodput_rps"]),
        ("batch throughput (tok/s)", lambda m: m["batch"]["throughput_tok_s"]),
    )
    for ax, (title, value) in zip(axes, panels, strict=True):
        for policy, by_load in report["results"].items():
            loads = sorted(by_load, key=float)
            ax.plot([float(x) for x in loads], [value(by_load[x]) for x in loads], marker="o", label=policy)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("chat arrivals (req/s)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 105)
    sweep = report.get("sweep")
    if sweep is not None:  # geometric rates; the bar and each policy's capacity on the attainment panel
        for ax in axes:
            ax.set_xscale("log")
        axes[0].axhline(100 * sweep["attainment_bar"], color="grey", lw=0.8, ls=":")
        colors = {line.get_label(): line.get_color() for line in axes[0].get_lines()}
        for policy, entry in sweep["policies"].items():
            if entry["capacity_bound"] == "interpolated":
                axes[0].axvline(entry["capacity_rps"], color=colors[policy], lw=0.8, ls="--")
    axes[0].legend(fontsize=7)
    return [_save(fig, out_dir / "slo_mix.png", 80)]


def plot_router(report: dict, out_dir: Path) -> list[Path]:
    """One row of bars per media kind: output tok/s, prefix-cache hit rate, median TTFT, per policy."""
    results = report["results"]
    panels = (("output_throughput", "output tok/s"), ("server_prefix_cache_hit_rate", "prefix-cache hit rate"),
              ("median_ttft_ms", "TTFT median (ms)"), ("family_stickiness", "family stickiness"))  # fmt: skip
    fig, axes = _figure(out_dir, len(results), len(panels), (14, 3.2 * len(results)), squeeze=False)
    for row, (media, by_policy) in enumerate(results.items()):
        names = list(by_policy)
        for ax, (key, title) in zip(axes[row], panels, strict=True):
            ax.bar(names, [by_policy[n][key] or 0.0 for n in names], color=["#888", "#4a7", "#47a"][: len(names)])
            ax.set_title(f"{title} ({'image + system prompt' if media == 'image' else 'system prompt'})", fontsize=9)
            ax.tick_params(axis="x", labelsize=8)
    cfg = report["config"]
    fig.suptitle(f"{cfg['num_replicas']} mmserve replicas behind vllm-router, {cfg['num_families']} prefix families, "
                 f"{cfg['concurrency']} in flight")  # fmt: skip
    return [_save(fig, out_dir / "router.png", 110)]


def plot_tensor_parallel(report: dict, out_dir: Path) -> list[Path]:
    """Median decode step time (p90 as the bar's top) against concurrency, one line per TP size, and
    the ratio to the base size."""
    concurrency = report["config"]["concurrency"]
    fig, (ax, rax) = _figure(out_dir, 1, 2, (9, 3.4))
    for tp, by_c in report["results"].items():
        med = [by_c[str(c)]["median_step_s"] * 1e3 for c in concurrency]
        p90 = [by_c[str(c)]["p90_step_s"] * 1e3 for c in concurrency]
        ax.errorbar(concurrency, med, yerr=[np.zeros(len(med)), np.subtract(p90, med)], marker="o",
                    capsize=3, label=f"TP={tp}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrency, [str(c) for c in concurrency])
    ax.set_xlabel("concurrent decoding requests")
    ax.set_ylabel("decode step (ms): median, bar to p90")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    base = report["base_tensor_parallel_size"]
    num_ratios = len(report["step_time_ratio_to_base"])
    width = 0.8 / max(1, num_ratios)
    for i, (tp, by_c) in enumerate(report["step_time_ratio_to_base"].items()):
        x = np.arange(len(concurrency)) + (i - (num_ratios - 1) / 2) * width  # centred on each tick
        bars = rax.bar(x, [by_c[str(c)] for c in concurrency], width, label=f"TP={tp} / TP={base}")
        rax.bar_label(bars, labels=[f"{by_c[str(c)]:.2f}x" for c in concurrency], fontsize=8)
    rax.axhline(1.0, color="black", lw=1, ls="--")
    rax.set_xticks(np.arange(len(concurrency)), [str(c) for c in concurrency])
    rax.set_xlabel("concurrent decoding requests")
    rax.set_ylabel("median step time ratio")
    rax.margins(y=0.2)
    rax.legend(fontsize=8)
    fig.suptitle(f"decode step time by tensor-parallel size ({report['machine']['cpu_model']})", fontsize=9)
    return [_save(fig, out_dir / "tensor_parallel.png")]
