"""Step-time model: predicts one engine step's duration from what its plan computes, fitted by
least squares (`mmserve bench profile`) and corrected online from measured steps. It knows plans and seconds,
never the device or the model."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mmserve.scheduler.output import SchedulerOutput

# Coefficient names, in the order of `StepFeatures.vector()`. Units: seconds per unit of the feature.
FEATURES: tuple[str, ...] = ("intercept", "new_tokens", "context_tokens", "num_seqs", "encoder_tokens")

# A guess for a mid-size model on one accelerator, used until a calibration file is given; the
# online correction rescales it within a few steps. `mmserve bench profile` should write the real one.
DEFAULT_COEFFICIENTS: dict[str, float] = {
    "intercept": 5e-3,
    "new_tokens": 2e-4,
    "context_tokens": 1e-6,
    "num_seqs": 5e-5,
    "encoder_tokens": 4e-4,
}


@dataclass(frozen=True)
class StepFeatures:
    """What a step computes, in the units the model is linear in."""

    new_tokens: int  # tokens computed this step over all requests (prefill chunks + decodes)
    context_tokens: int  # sum over scheduled requests of (cached + new) tokens its queries attend to
    num_seqs: int  # requests in the step
    encoder_tokens: int  # embedding tokens the vision encoder computes (a video counts by its groups')

    @classmethod
    def of_plan(cls, plan: SchedulerOutput) -> StepFeatures:
        return cls(
            new_tokens=plan.num_scheduled_tokens,
            context_tokens=sum(s.num_computed_tokens + s.num_scheduled_tokens for s in plan.scheduled),
            num_seqs=len(plan.scheduled),
            encoder_tokens=plan.num_encoder_tokens,
        )

    def vector(self) -> tuple[float, ...]:
        """[len(FEATURES)]; the leading 1 multiplies the intercept."""
        return (1.0, self.new_tokens, self.context_tokens, self.num_seqs, self.encoder_tokens)


class StepTimeModel:
    """t = correction * max(0, sum_i coef_i * feature_i).

    `correction` is an exponentially weighted average of measured / predicted (the linear part)
    over recent steps, so a model calibrated on one machine or load adapts to this one.
    """

    def __init__(
        self,
        coefficients: Mapping[str, float] | None = None,
        ewma_alpha: float = 0.2,
        correction: float = 1.0,
    ) -> None:
        coefficients = dict(DEFAULT_COEFFICIENTS if coefficients is None else coefficients)
        unknown = set(coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown step-time coefficient(s) {sorted(unknown)}; expected {FEATURES}")
        if not all(math.isfinite(float(v)) for v in coefficients.values()):
            raise ValueError("step-time coefficients must be finite numbers")
        if not (0.0 < ewma_alpha <= 1.0) or not (correction > 0.0):
            raise ValueError("ewma_alpha must be in (0, 1] and correction > 0")
        self.coefficients: dict[str, float] = {name: float(coefficients.get(name, 0.0)) for name in FEATURES}
        self.ewma_alpha = ewma_alpha
        self.correction = correction
        self.num_observed = 0

    # -- prediction ------------------------------------------------------------------------------
    def linear(self, features: StepFeatures) -> float:
        """The calibrated linear part, before the online correction (never negative)."""
        c = self.coefficients
        return max(0.0, sum(c[name] * x for name, x in zip(FEATURES, features.vector(), strict=True)))

    def predict(self, features: StepFeatures) -> float:
        """Seconds."""
        return self.correction * self.linear(features)

    def intercept(self) -> float:
        """Seconds a step costs before it computes anything."""
        return self.correction * max(0.0, self.coefficients["intercept"])

    def grant_cost(self, num_computed: int, num_new: int, encoder_tokens: int = 0) -> float:
        """Seconds that one more request in a step adds: `num_new` tokens over `num_computed`
        cached ones (it attends to num_computed + num_new), plus its new encoder work."""
        c = self.coefficients
        linear = (
            c["new_tokens"] * num_new
            + c["context_tokens"] * (num_computed + num_new)
            + c["num_seqs"]
            + c["encoder_tokens"] * encoder_tokens
        )
        return self.correction * max(0.0, linear)

    def tokens_within(self, seconds: float, num_computed: int, encoder_tokens: int = 0) -> int:
        """The most tokens one request may add to a step without adding more than `seconds`."""
        c = self.coefficients
        per_token = self.correction * (c["new_tokens"] + c["context_tokens"])
        fixed = self.grant_cost(num_computed, 0, encoder_tokens)
        if seconds < fixed:
            return 0
        if per_token <= 0.0 or seconds == math.inf:
            return 1 << 30  # tokens cost nothing in this model: only the token budget limits them
        return int((seconds - fixed) / per_token)

    # -- online correction -----------------------------------------------------------------------
    def observe(self, features: StepFeatures, measured_s: float) -> None:
        """Move the correction toward measured / predicted for one executed step."""
        linear = self.linear(features)
        if linear <= 0.0 or not (measured_s > 0.0) or not math.isfinite(measured_s):
            return
        ratio = min(max(measured_s / linear, 1e-3), 1e3)  # one outlier step cannot wreck the model
        self.correction = (1.0 - self.ewma_alpha) * self.correction + self.ewma_alpha * ratio
        self.num_observed += 1

    # -- calibration -----------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Iterable[tuple[StepFeatures, float]], ewma_alpha: float = 0.2) -> StepTimeModel:
        """Least squares on the *relative* error over (features, seconds) samples, with non-negative
        coefficients. On absolute error a sweep's few long prefill steps dominate, and collinear
        features (a fresh prefill's context equals its new tokens) can take negative or inflated
        coefficients that misjudge the short steps the `slo` policy plans under a TBT target. Each row
        is divided by its measured time; a feature whose coefficient comes out negative is dropped and
        the rest refitted (a small active-set NNLS). A feature that is zero in every sample gets 0.
        numpy is imported here only: calibration runs in `mmserve bench profile`, never in the scheduler."""
        import numpy as np

        pairs = list(samples)
        x = np.array([f.vector() for f, _ in pairs], dtype=np.float64)  # [n, len(FEATURES)]
        t = np.array([s for _, s in pairs], dtype=np.float64)  # [n]
        if len(t) < 2 or not np.all(t > 0):
            raise ValueError("fitting a step-time model needs at least 2 samples with positive times")
        a = x / t[:, None]  # row i: features_i / t_i, so that a @ c - 1 is the relative error
        active = [j for j in range(len(FEATURES)) if np.any(x[:, j] != 0)]
        coef = np.zeros(len(FEATURES))
        while active:
            scale = np.abs(a[:, active]).max(axis=0)  # conditioning: columns to max |.| = 1
            sol, *_ = np.linalg.lstsq(a[:, active] / scale, np.ones(len(t)), rcond=None)
            sol = sol / scale
            if np.all(sol >= 0):
                coef[:] = 0.0
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))  # the most negative one explains nothing physical: drop it
        return cls(dict(zip(FEATURES, coef.tolist(), strict=True)), ewma_alpha=ewma_alpha)

    # -- persistence -----------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {"coefficients": self.coefficients, "ewma_alpha": self.ewma_alpha, "correction": self.correction},
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> StepTimeModel:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("coefficients"), dict):
            raise ValueError("step-time model JSON must be an object with a 'coefficients' object")
        return cls(
            data["coefficients"],
            ewma_alpha=float(data.get("ewma_alpha", 0.2)),
            correction=float(data.get("correction", 1.0)),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepTimeModel:
        return cls.from_json(Path(path).read_text())
