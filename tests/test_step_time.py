"""The step-time model: least-squares calibration, JSON round trip, online correction, and the
engine feedback path through Scheduler.record_step_time. Pure Python, no device."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.scheduler.output import ScheduledRequest, SchedulerOutput
from mmserve.scheduler.scheduler import Scheduler
from mmserve.scheduler.step_time import FEATURES, StepFeatures, StepTimeModel

KNOWN = {
    "intercept": 3e-3,
    "new_tokens": 7e-4,
    "context_tokens": 1.5e-6,
    "num_seqs": 2.5e-4,
    "encoder_tokens": 4e-4,
}


def random_features(rng: random.Random) -> StepFeatures:
    new = rng.randint(1, 2048)
    seqs = rng.randint(1, 64)
    return StepFeatures(new, new + rng.randint(0, 60_000), seqs, rng.choice([0, 0, 256, 1024, 2048]))


def test_least_squares_recovers_known_coefficients() -> None:
    rng = random.Random(0)
    truth = StepTimeModel(KNOWN)
    samples = [(f, truth.predict(f)) for f in (random_features(rng) for _ in range(200))]
    fitted = StepTimeModel.fit(samples)
    for name in FEATURES:
        assert fitted.coefficients[name] == pytest.approx(KNOWN[name], rel=1e-6, abs=1e-12), name


def test_least_squares_with_noise_stays_close_and_unprofiled_features_get_zero() -> None:
    rng = random.Random(1)
    truth = StepTimeModel({**KNOWN, "encoder_tokens": 0.0})
    samples = []
    for _ in range(400):
        f = random_features(rng)
        f = StepFeatures(f.new_tokens, f.context_tokens, f.num_seqs, 0)  # a text-only sweep
        samples.append((f, truth.predict(f) * rng.uniform(0.97, 1.03)))
    fitted = StepTimeModel.fit(samples)
    assert fitted.coefficients["encoder_tokens"] == 0.0  # never varied: no evidence, no coefficient
    assert fitted.coefficients["new_tokens"] == pytest.approx(KNOWN["new_tokens"], rel=0.05)
    probe = StepFeatures(512, 4096, 8, 0)
    assert fitted.predict(probe) == pytest.approx(truth.predict(probe), rel=0.03)


def test_fit_needs_samples() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        StepTimeModel.fit([(StepFeatures(1, 1, 1, 0), 0.01)])


def test_json_round_trip(tmp_path: Path) -> None:
    model = StepTimeModel(KNOWN, ewma_alpha=0.3)
    model.observe(StepFeatures(100, 200, 2, 0), 1.0)  # moves the correction away from 1
    path = tmp_path / "step_time.json"
    model.save(path)
    loaded = StepTimeModel.load(path)
    assert loaded.coefficients == model.coefficients
    assert loaded.correction == model.correction and loaded.ewma_alpha == 0.3
    assert json.loads(path.read_text())["coefficients"]["new_tokens"] == KNOWN["new_tokens"]
    f = StepFeatures(64, 5000, 4, 256)
    assert loaded.predict(f) == model.predict(f)


def test_bad_json_and_coefficients_are_rejected() -> None:
    with pytest.raises(ValueError, match="coefficients"):
        StepTimeModel.from_json("[1, 2]")
    with pytest.raises(ValueError, match="unknown"):
        StepTimeModel({"flops": 1.0})
    with pytest.raises(ValueError, match="finite"):
        StepTimeModel({"intercept": math.nan})


def test_online_correction_moves_predictions_toward_measurements() -> None:
    model = StepTimeModel(KNOWN, ewma_alpha=0.2)
    f = StepFeatures(256, 4096, 8, 0)
    truth = 2.5 * model.predict(f)  # the device is 2.5x slower than calibrated
    errors = []
    for _ in range(30):
        errors.append(abs(model.predict(f) - truth))
        model.observe(f, truth)
    assert all(b < a for a, b in itertools.pairwise(errors))
    assert model.predict(f) == pytest.approx(truth, rel=0.01)
    assert model.num_observed == 30
    # Nonsense measurements are ignored rather than poisoning the model.
    before = model.correction
    for bad in (0.0, -1.0, math.inf, math.nan):
        model.observe(f, bad)
    assert model.correction == before


def test_tokens_within_inverts_grant_cost() -> None:
    model = StepTimeModel(KNOWN, correction=1.7)
    for computed, enc in ((0, 0), (1000, 0), (300, 256)):
        n = model.tokens_within(0.5, computed, enc)
        assert n > 0
        assert model.grant_cost(computed, n, enc) <= 0.5 < model.grant_cost(computed, n + 1, enc)
    assert model.tokens_within(1e-6, 0) == 0
    assert model.tokens_within(math.inf, 0) > 1_000_000


def test_features_of_a_plan() -> None:
    def sr(rid: str, computed: int, n: int) -> ScheduledRequest:
        return ScheduledRequest(rid, computed, n, sample=n > 0)

    plan = SchedulerOutput((sr("a", 0, 100), sr("b", 40, 1)), 101)
    assert StepFeatures.of_plan(plan) == StepFeatures(101, 100 + 41, 2, 0)


def test_scheduler_feeds_measured_step_times_to_its_model(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    StepTimeModel(KNOWN).save(path)
    sched = Scheduler(SchedulerConfig(64, 4, 256, "slo", step_time_model=str(path)), CacheConfig(4, 64, True))
    assert sched.step_time.coefficients == KNOWN
    from mmserve.request import Request, SamplingParams

    sched.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=2)))
    plan = sched.schedule()
    features = StepFeatures.of_plan(plan)
    predicted = sched.step_time.predict(features)
    sched.record_step_time(features, 3 * predicted)
    assert sched.step_time.predict(StepFeatures.of_plan(plan)) > predicted


def test_step_time_and_slo_modules_do_not_import_torch() -> None:
    code = (
        "import sys, mmserve.scheduler.step_time, mmserve.scheduler.slo, mmserve.config; "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
