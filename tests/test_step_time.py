"""The step-time model: least-squares calibration, JSON round trip, online correction, and the
engine feedback path through Scheduler.record_step_time. Pure Python, no device."""

from __future__ import annotations

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
    model = StepTimeModel(KNOWN)
    model.observe(StepFeatures(100, 200, 2, 0), 1.0)  # refits away from the prior
    path = tmp_path / "step_time.json"
    model.save(path)
    loaded = StepTimeModel.load(path)  # the fit so far becomes the next start's prior
    assert loaded.coefficients == loaded.prior == pytest.approx(model.coefficients)
    f = StepFeatures(64, 5000, 4, 256)
    assert loaded.predict(f) == pytest.approx(model.predict(f))
    # The older format's online correction is folded into the coefficients.
    old = {"coefficients": KNOWN, "correction": 2.0, "ewma_alpha": 0.2}
    assert StepTimeModel.from_json(json.dumps(old)).coefficients == {k: 2 * v for k, v in KNOWN.items()}


def test_bad_json_and_coefficients_are_rejected() -> None:
    with pytest.raises(ValueError, match="coefficients"):
        StepTimeModel.from_json("[1, 2]")
    with pytest.raises(ValueError, match="unknown"):
        StepTimeModel({"flops": 1.0})
    with pytest.raises(ValueError, match="finite"):
        StepTimeModel({"intercept": math.nan})
    with pytest.raises(ValueError, match=">= 0"):
        StepTimeModel({"intercept": -1.0})


@pytest.mark.parametrize("wrong_by", [2.0, 0.5, 10.0])
def test_online_fit_converges_from_a_prior_off_by_a_factor(wrong_by: float) -> None:
    """Random steps of every shape, measured with 5% noise and an outlier now and then: the refit
    recovers each coefficient, and the error factor settles near the noise."""
    rng = random.Random(3)
    truth = StepTimeModel(KNOWN)
    model = StepTimeModel({k: wrong_by * v for k, v in KNOWN.items()})
    errors = []
    for i in range(300):
        f = random_features(rng)
        measured = truth.predict(f) * rng.uniform(0.95, 1.05)
        if i % 37 == 5:
            measured *= 15  # a stall (a page-fault storm, another process): must not wreck the fit
        errors.append(abs(model.predict(f) / truth.predict(f) - 1))
        model.observe(f, measured)
    for name in FEATURES:
        assert model.coefficients[name] == pytest.approx(KNOWN[name], rel=0.25), name  # ~50 steps of 5% noise
    assert max(errors[-50:]) < 0.1 < errors[0]
    assert model.num_observed == 300
    assert 1.0 <= model.error_factor() < 1.1


def test_features_the_data_never_vary_keep_the_priors_proportions() -> None:
    """Decode-only steps on a machine 3x slower than the prior: the fit learns the decode costs, and the
    prefill and encoder costs it has no evidence for follow the prior scaled by the same 3x."""
    truth = StepTimeModel({k: 3 * v for k, v in KNOWN.items()})
    model = StepTimeModel(KNOWN)
    for i in range(200):
        n = 4 + i % 5
        f = StepFeatures(n, n * 1000, n, 0)
        model.observe(f, truth.predict(f))
    for probe in (StepFeatures(2048, 2048, 1, 0), StepFeatures(256, 256, 1, 1024)):
        assert model.predict(probe) == pytest.approx(truth.predict(probe), rel=0.05)


def test_error_factor_widens_with_noise_and_nonsense_is_ignored() -> None:
    rng = random.Random(4)
    truth = StepTimeModel(KNOWN)
    quiet, noisy = StepTimeModel(KNOWN), StepTimeModel(KNOWN)
    assert quiet.error_factor() == 1.0  # before any step
    for _ in range(200):
        f = random_features(rng)
        quiet.observe(f, truth.predict(f))
        noisy.observe(f, truth.predict(f) * rng.choice([0.7, 1.0, 1.6]))  # a machine shared with others
    assert quiet.error_factor() == pytest.approx(1.0, abs=1e-6)
    assert noisy.error_factor() > 1.3
    before = dict(quiet.coefficients), quiet.num_observed
    for bad in (0.0, -1.0, math.inf, math.nan):
        quiet.observe(StepFeatures(256, 4096, 8, 0), bad)
    assert (quiet.coefficients, quiet.num_observed) == before
    stats = noisy.stats()
    assert stats.num_observed == 200 and stats.observed_s > 0 and stats.predicted_s > 0
    assert stats.abs_error_s > 0 and stats.error_factor == noisy.error_factor()


def test_a_settled_model_refits_on_a_cadence_and_at_once_when_a_step_surprises_it() -> None:
    """After its first steps, steady decode steps (10% noise) move the fit only every few steps, so the
    solve is not paid every step; a step the fit mispredicts wildly (a long prefill on a machine slower
    than the prior) moves it on that very step, and nothing is lost: the later steps keep being summed."""
    rng = random.Random(5)
    truth = StepTimeModel({k: 2 * v for k, v in KNOWN.items()})
    model = StepTimeModel(KNOWN)
    decode = StepFeatures(4, 4000, 4, 0)
    for _ in range(40):
        model.observe(decode, truth.predict(decode) * rng.uniform(0.95, 1.05))
    changes = 0
    for _ in range(80):
        before = dict(model.coefficients)
        model.observe(decode, truth.predict(decode) * rng.uniform(0.9, 1.1))
        changes += model.coefficients != before
    assert 80 // 8 <= changes <= 80 // 8 + 1
    prefill = StepFeatures(2048, 2048, 1, 0)
    assert model.predict(prefill) < 0.5 * 3 * truth.predict(prefill)  # the machine just got 3x slower
    before = dict(model.coefficients)
    model.observe(prefill, 3 * truth.predict(prefill))
    assert model.coefficients != before
    assert model.num_observed == 121


def test_tokens_within_inverts_grant_cost() -> None:
    model = StepTimeModel({k: 1.7 * v for k, v in KNOWN.items()})
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
