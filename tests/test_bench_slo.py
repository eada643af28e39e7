"""`mmserve bench serve --workload slo-mix --quick` and `mmserve bench profile --quick` on the tiny model,
plus the pure pieces of slo-mix (request mix, SLO rule, per-class figures, table)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from mmserve.bench.metrics import RequestTiming, meets_slos
from mmserve.bench.slo_mix import (
    BATCH,
    INTERACTIVE,
    QUICK_MIX,
    Calibration,
    MixConfig,
    SweepConfig,
    build_mix,
    capacity_at,
    format_sweep,
    load_ladder,
    phase_metrics,
    sweep_summary,
)
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
    m = phase_metrics(pairs, 2.0, replace(cfg, duration_s=0.5))
    assert m[INTERACTIVE]["slo_attainment"] == pytest.approx(0.25)
    # Per second of the chats' arrival window (0.5 s), not of the phase's 2 s that the batch job's tail sets.
    assert m[INTERACTIVE]["goodput_rps"] == pytest.approx(2.0)
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


def test_slo_mix_sweep_quick(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """--sweep calibrates targets and the first rate on the machine, runs the ladder and states capacities."""
    out = tmp_path / "sweep.json"
    argv = ["bench", "serve", "--workload", "slo-mix", "--quick", "--no-progress", "--sweep"]
    argv += ["--sweep-max-loads", "2", "--policies", "fcfs,slo", "--slo-admission", "reject"]
    argv += ["--plot", str(tmp_path / "plots")]
    assert main([*argv, "--model", str(tiny_model_dir("qwen2_vl")), "--json", str(out)]) == 0
    assert (tmp_path / "plots" / "slo_mix.png").stat().st_size > 0
    report = json.loads(out.read_text())
    sweep = report["sweep"]
    cal = sweep["calibration"]
    assert cal["ttft_s"] > 0 and cal["tpot_s"] > 0 and cal["burst_rps"] > 0
    # The targets the servers ran with are the calibrated ones, not quick mode's fixed 60 s.
    ttft_ms, tbt_ms = Calibration(**cal).targets()
    assert (report["config"]["ttft_ms"], report["config"]["tbt_ms"]) == (ttft_ms, tbt_ms)
    assert report["config"]["num_batch"] == Calibration(**cal).num_batch(QUICK_MIX.duration_s)
    assert report["config"]["admission_control"] == "reject"
    loads = sweep["loads"]
    assert 1 <= len(loads) <= 2 and Calibration(**cal).start_load() in loads  # then up or down by 1.5x
    if len(loads) == 2:
        assert loads[1] == pytest.approx(1.5 * loads[0], rel=0.01)
    assert set(sweep["policies"]) == {"fcfs", "slo"}
    for policy, entry in sweep["policies"].items():
        assert entry["capacity_bound"] in ("below", "interpolated", "at least")
        assert set(entry["goodput_vs_fcfs"]) == set(report["results"][policy])
        for load in report["results"][policy]:
            m = report["results"][policy][load]
            assert m[BATCH]["completed"] == m[BATCH]["requests"]  # rejections only ever hit chats
    assert all(r in (1.0, None) for r in sweep["policies"]["fcfs"]["goodput_vs_fcfs"].values())  # None: 0 / 0


def test_sweep_ladder_goes_up_until_all_miss_or_down_until_one_meets() -> None:
    def run(start: float, meets_below: float, max_loads: int = 8) -> list[float]:
        met: list[bool] = []
        loads = []
        for load in load_ladder(MixConfig(), SweepConfig(start_load=start, max_loads=max_loads), start, met):
            loads.append(load)
            met.append(load < meets_below)  # some policy meets the bar below this rate
        return loads

    assert run(1.0, 3.0) == [1.0, 1.5, 2.25, 3.38]  # up until every policy missed
    assert run(4.0, 2.0) == [4.0, 2.67, 1.78]  # none met at the start: down until one did
    assert run(1.0, 100.0, max_loads=3) == [1.0, 1.5, 2.25]

    def run_sparse(start: float, first_chat_at: float) -> list[float]:  # no chat below `first_chat_at`
        met: list[bool | None] = []
        loads = []
        for load in load_ladder(MixConfig(), SweepConfig(start_load=start, max_loads=8), start, met):
            loads.append(load)
            met.append(None if load < first_chat_at else False)  # every policy missed where chats came
        return loads

    # Down from a rate every policy missed: a rate where no chat came shows nothing and ends the ladder
    # (it used to count as met and bracket a capacity that was never measured).
    assert run_sparse(4.0, 3.0) == [4.0, 2.67]
    assert run_sparse(0.5, 0.6) == [0.5, 0.75]  # none at the start: up, to where chats arrive (and all miss)
    assert list(load_ladder(MixConfig(loads=(0.5, 2.0)), None, 0.5, [])) == [0.5, 2.0]


def test_capacity_is_interpolated_in_log_rate() -> None:
    # Attainment 1.0 at 2/s, 0.8 at 8/s: the 0.9 crossing is halfway in log rate, at 4/s.
    assert capacity_at([1.0, 2.0, 8.0], [1.0, 1.0, 0.8], 0.9) == (pytest.approx(4.0), "interpolated")
    assert capacity_at([1.0, 2.0], [0.5, 0.95], 0.9) == (1.0, "below")  # the first rate missed already
    assert capacity_at([1.0, 2.0], [0.95, None], 0.9) == (1.0, "at least")  # no chat at 2/s: it shows nothing
    assert capacity_at([1.0, 2.0, 4.0], [None, 0.5, 0.4], 0.9) == (2.0, "below")
    assert capacity_at([1.0, 2.0], [None, None], 0.9) == (None, "unmeasured")
    # A later recovery does not move the first crossing.
    assert capacity_at([1.0, 2.0, 4.0], [0.9, 0.6, 0.95], 0.9)[0] == pytest.approx(1.0)


def test_sweep_summary_against_fcfs() -> None:
    def phase(attainment: float, goodput: float, batch: float) -> dict:
        return {INTERACTIVE: {"slo_attainment": attainment, "goodput_rps": goodput},
                BATCH: {"throughput_tok_s": batch}}  # fmt: skip

    results = {
        "fcfs": {"1": phase(0.95, 1.0, 100.0), "2": phase(0.85, 1.6, 100.0), "4": phase(0.3, 1.2, 100.0)},
        "slo": {"1": phase(1.0, 1.0, 90.0), "2": phase(0.95, 1.9, 85.0), "4": phase(0.7, 2.8, 80.0)},
    }
    summary = sweep_summary(results, SweepConfig(start_load=1.0), None)
    fcfs, slo = summary["policies"]["fcfs"], summary["policies"]["slo"]
    assert summary["loads"] == [1.0, 2.0, 4.0]
    assert fcfs["capacity_bound"] == slo["capacity_bound"] == "interpolated"
    assert fcfs["capacity_rps"] == pytest.approx(2 ** 0.5)  # 0.95 -> 0.85: halfway from 1 to 2 in log rate
    assert slo["capacity_rps"] == pytest.approx(2 * 2 ** 0.2)  # 0.95 -> 0.7 crosses 0.9 a fifth of the way
    assert slo["capacity_vs_fcfs"] == pytest.approx(2 * 2**0.2 / 2**0.5)
    assert slo["goodput_vs_fcfs"] == {"1": 1.0, "2": pytest.approx(1.9 / 1.6), "4": pytest.approx(2.8 / 1.2)}
    assert slo["capacity_load"] == 2.0 and slo["batch_throughput_vs_fcfs_at_capacity"] == pytest.approx(0.85)
    table = format_sweep(summary)
    assert ["slo", "2.3", "1.62", "1.00", "0.85"] in [line.split() for line in table.splitlines()]
    with pytest.raises(ValueError, match="factor"):
        SweepConfig(factor=1.0)
