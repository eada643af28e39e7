"""`mmserve bench serve --workload slo-mix --quick` and `mmserve bench profile --quick` on the tiny model,
plus the pure pieces of slo-mix (request mix, SLO rule, per-class figures, table)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mmserve.bench.metrics import RequestTiming, meets_slos
from mmserve.bench.slo_mix import BATCH, INTERACTIVE, QUICK_MIX, MixConfig, build_mix, phase_metrics
from mmserve.cli import main
from mmserve.scheduler.step_time import FEATURES, StepFeatures, StepTimeModel


def test_slo_mix_quick(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    out = tmp_path / "mix.json"
    argv = ["bench", "serve", "--workload", "slo-mix", "--quick", "--no-progress"]
    argv += ["--plot", str(tmp_path / "plots")]
    assert main([*argv, "--model", str(tiny_model_dir("qwen2_vl")), "--json", str(out)]) == 0
    assert (tmp_path / "plots" / "slo_mix.png").stat().st_size > 0
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["fcfs", "priority", "slo"]
    kinds = report["phases"]["2"]
    assert {"long-text", "multi-image", "video"} <= set(kinds)
    for by_load in report["results"].values():
        m = by_load["2"]
        assert not m["errors"]
        assert m[BATCH]["completed"] == m[BATCH]["requests"] == QUICK_MIX.num_batch
        assert m[INTERACTIVE]["failed"] == 0 and m[INTERACTIVE]["completed"] == m[INTERACTIVE]["requests"]
        # Quick mode's targets are generous: every chat that completed met them.
        assert m[INTERACTIVE]["slo_attainment"] == 1.0
        assert m[BATCH]["throughput_tok_s"] > 0


def test_profile_quick(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    out = tmp_path / "step_time.json"
    report = tmp_path / "profile.json"
    argv = ["bench", "profile", "--quick", "--model", str(tiny_model_dir("qwen2_vl"))]
    assert main([*argv, "--out", str(out), "--json", str(report)]) == 0
    model = StepTimeModel.load(out)  # what `--step-time-model` / the slo policy load
    assert set(model.coefficients) == set(FEATURES)
    samples = json.loads(report.read_text())["samples"]
    assert len(samples) >= len(FEATURES)
    kinds = {s["kind"] for s in samples}
    assert {"prefill", "decode", "image", "video"} <= kinds
    assert any(s["features"]["encoder_tokens"] > 0 for s in samples)
    assert all(s["seconds"] > 0 for s in samples)


def test_mix_is_the_same_for_every_policy_and_seeded() -> None:
    cfg = MixConfig(loads=(4.0,), duration_s=3.0, num_batch=3, batch_input_len=(20, 30), video_frames=4,
                    image_size=56, video_size=56)  # fmt: skip
    a, b = build_mix(cfg, 4.0, 7, None), build_mix(cfg, 4.0, 7, None)
    assert a == b
    assert [r.kind for r in a[:3]] == ["long-text", "multi-image", "video"]
    assert all(r.service_class == BATCH and r.at_s == 0.0 for r in a[:3])
    chats = a[3:]
    assert chats and all(r.service_class == INTERACTIVE for r in chats)
    assert all(0 < x.at_s < y.at_s < cfg.duration_s for x, y in itertools.pairwise(chats))
    assert a[0].body()["service_tier"] == "flex" and a[0].body()["priority"] == 1
    assert chats[0].body()["service_tier"] == "default" and chats[0].body()["priority"] == 0


def test_meets_and_phase_metrics() -> None:
    cfg = MixConfig(ttft_ms=100.0, tbt_ms=10.0)
    fast = RequestTiming(0.0, (0.05, 0.059, 0.068), 0.068, 10, 3)  # TTFT 50 ms, TPOT 9 ms
    slow_first = RequestTiming(0.0, (0.2, 0.21), 0.21, 10, 2)  # TTFT 200 ms
    jerky = RequestTiming(0.0, (0.05, 0.1), 0.1, 10, 2)  # TPOT 50 ms
    failed = RequestTiming(0.0, (), 0.1, 0, 0, False, "boom")
    slos = {"ttft": 100.0, "tpot": 10.0}  # how phase_metrics judges chats under this cfg
    assert meets_slos(fast, slos) and not meets_slos(slow_first, slos) and not meets_slos(jerky, slos)
    assert not meets_slos(failed, slos)
    chat = build_mix(MixConfig(num_batch=0, duration_s=50.0), 1.0, 0, None)[0]
    job = build_mix(MixConfig(num_batch=1, duration_s=0.1, batch_input_len=(5, 5)), 1.0, 0, None)[0]
    pairs = [
        (chat, fast),
        (chat, slow_first),
        (chat, jerky),
        (chat, failed),
        (job, RequestTiming(0, (1.0,), 2.0, 90, 10)),
    ]
    m = phase_metrics(pairs, 2.0, cfg)
    assert m[INTERACTIVE]["slo_attainment"] == pytest.approx(0.25)
    assert m[INTERACTIVE]["goodput_rps"] == pytest.approx(0.5)
    assert m[INTERACTIVE]["failed"] == 1
    assert m[BATCH]["throughput_tok_s"] == pytest.approx(50.0)  # (90 + 10) tokens / 2 s


def test_bad_mix_config() -> None:
    with pytest.raises(ValueError, match="loads"):
        MixConfig(loads=(0.0,))
    with pytest.raises(ValueError, match="policies"):
        MixConfig(policies=("lifo",))
    assert main(["bench", "serve", "--workload", "slo-mix", "--loads", "1,-2", "--no-progress"]) == 2


def test_fit_relative_recovers_coefficients_and_stays_non_negative() -> None:
    truth = {
        "intercept": 0.03,
        "new_tokens": 0.002,
        "context_tokens": 0.0,
        "num_seqs": 0.004,
        "encoder_tokens": 5e-4,
    }
    true_model = StepTimeModel(truth)
    shapes = [
        StepFeatures(n, c, s, e)
        for n in (1, 16, 64, 512)
        for c in (n, 4 * n)
        for s in (1, 8)
        for e in (0, 64)
    ]
    fitted = StepTimeModel.fit([(f, true_model.predict(f)) for f in shapes])
    for name, value in truth.items():
        assert fitted.coefficients[name] == pytest.approx(value, abs=1e-9)
    # A feature that only makes steps *faster* in the data gets 0, not a negative coefficient.
    skewed = [(f, true_model.predict(f) * (0.5 if f.context_tokens > f.new_tokens else 1.0)) for f in shapes]
    assert all(v >= 0.0 for v in StepTimeModel.fit(skewed).coefficients.values())
