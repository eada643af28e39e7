"""Step-time model: predicts one engine step's duration from what its plan computes. It starts from a
prior (built-in, or fitted by `mmserve bench profile`) and refits itself online from the measured steps;
it also measures its own recent error, which the planners turn into a safety margin. It knows plans and
seconds, never the device or the model. Pure Python: the scheduler runs it every step."""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mmserve.scheduler.output import SchedulerOutput

# Coefficient names, in the order of `StepFeatures.vector()`. Units: seconds per unit of the feature.
FEATURES: tuple[str, ...] = ("intercept", "new_tokens", "context_tokens", "num_seqs", "encoder_tokens")

# The prior when no calibration file is given: deliberately slow (a small model on a few CPU cores), so
# the first steps after a start are planned short rather than long; the online fit replaces it within a
# few steps wherever the data speak, and scales it as a whole where they do not (see StepTimeModel).
DEFAULT_COEFFICIENTS: dict[str, float] = {
    "intercept": 1e-2,
    "new_tokens": 1e-3,
    "context_tokens": 2e-6,
    "num_seqs": 2e-4,
    "encoder_tokens": 1.5e-3,
}


@dataclass(frozen=True)
class StepFeatures:
    """What a step computes, in the units the model is linear in."""

    new_tokens: int  # tokens computed this step over all requests (prefill chunks + decodes)
    context_tokens: int  # sum over scheduled requests of (cached + new) tokens its queries attend to
    num_seqs: int  # requests in the step
    # Embedding tokens the vision encoder computes (a video counts by its groups'; a slice of the tower by its
    # share of the blocks).
    encoder_tokens: float

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


# Step shapes at which the prior speaks (see StepTimeModel): decode batches, prefill chunks, encoder work.
_PRIOR_STEPS: tuple[StepFeatures, ...] = (
    StepFeatures(1, 512, 1, 0),
    StepFeatures(16, 16 * 1024, 16, 0),
    StepFeatures(64, 64 * 2048, 64, 0),
    StepFeatures(256, 256, 1, 0),
    StepFeatures(2048, 2048, 1, 0),
    StepFeatures(512, 4096, 8, 256),
    StepFeatures(256, 256, 1, 1024),
)


@dataclass(frozen=True)
class StepTimeStats:
    """The model's record against the steps it was told about (cumulative; for /metrics)."""

    num_observed: int
    predicted_s: float  # sum of the predictions made for the observed steps (before each refit)
    observed_s: float  # sum of their measured durations
    abs_error_s: float  # sum of |measured - predicted|
    error_factor: float  # the planning margin now (see StepTimeModel.error_factor)


# The widest planning margin. Errors beyond 2x are transients (a noisy neighbour, a cold start) that the
# refit absorbs within tens of steps; a wider margin would shrink every step's prefill to nothing meanwhile,
# which costs the queued requests their TTFT without saving the streams their TBT.
MAX_ERROR_FACTOR = 2.0


class StepTimeModel:
    """t = max(0, sum_i coef_i * feature_i), refitted from the observed steps.

    The fit is least squares on the *relative* error (a 2 ms decode step counts as much as a 2 s
    prefill, and a slow outlier step, e.g. a page fault storm, has a bounded pull: its row x / t is
    small), with exponential forgetting (`forgetting` per step, so the model follows a machine whose
    speed drifts), a Huber weight on rows the current model over-predicts wildly, non-negative
    coefficients, and a prior: pseudo-steps at typical shapes (`_PRIOR_STEPS`) priced by the prior
    coefficients times the data's overall scale against the prior. So a feature the recent steps never
    varied (no video yet, one batch size only) keeps the prior's proportion to the others instead of
    drifting anywhere, while the ones the data pin down follow the data.

    `error_factor` is a high quantile of measured / predicted over the last `window` steps: how much
    longer than predicted a step may turn out. Planners divide their time targets by it, so the margin
    widens when the model is wrong and shrinks back when it is right.

    Every step enters the sums; the solve runs after each of the first `_WARMUP_STEPS` steps, after any
    step it mispredicted by more than `_SURPRISE`, and otherwise every `_REFIT_EVERY` steps. Between two
    solves the sums move by a few forgetting factors, so the fit they would give differs little from the
    one in use, and the solve is most of the cost of an observe that runs every step. Likewise a step's row
    waits in `_unfolded` and enters the sums just before the next solve, in the order observed: the same sums,
    bit for bit, with the folding loop run warm over several rows (at one stream, a step's bookkeeping runs
    right after a forward has flushed the caches, so each piece of code run once a step costs several times
    its warm cost).
    """

    def __init__(
        self,
        coefficients: Mapping[str, float] | None = None,
        *,
        prior_weight: float = 1.0,
        forgetting: float = 0.98,
        window: int = 32,
        error_quantile: float = 0.9,
    ) -> None:
        coefficients = dict(DEFAULT_COEFFICIENTS if coefficients is None else coefficients)
        unknown = set(coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown step-time coefficient(s) {sorted(unknown)}; expected {FEATURES}")
        if not all(math.isfinite(float(v)) and float(v) >= 0.0 for v in coefficients.values()):
            raise ValueError("step-time coefficients must be finite numbers >= 0")
        if not (
            prior_weight > 0.0 and 0.0 < forgetting <= 1.0 and window >= 1 and 0.0 < error_quantile <= 1.0
        ):
            raise ValueError("prior_weight > 0, forgetting in (0, 1], window >= 1, error_quantile in (0, 1]")
        self.prior: dict[str, float] = {name: float(coefficients.get(name, 0.0)) for name in FEATURES}
        self.coefficients: dict[str, float] = dict(self.prior)  # the current fit
        self.prior_weight = prior_weight
        self.forgetting = forgetting
        self.error_quantile = error_quantile
        self.num_observed = 0
        k = len(FEATURES)
        self._gram = [[0.0] * k for _ in range(k)]  # [k, k] sum of w * a a^T over observed rows a = x / t
        self._rhs = [0.0] * k  # [k] sum of w * a (each row's target is 1: relative error)
        self._unfolded: list[tuple[tuple[float, ...], float, float]] = []  # (x, measured_s, w) not yet in the sums
        self._log_scale = 0.0  # mean log(measured / prior prediction): the data's scale against the prior
        self._num_scaled = 0
        self._ratios: deque[float] = deque(maxlen=window)  # measured / predicted, latest steps
        self._ranked_ratios: list[float] = []  # the same values, sorted: kept by bisection, not sorted per step
        self._steps_since_refit = 0
        self._error_factor = 1.0  # see error_factor
        self._predicted_s = self._observed_s = self._abs_error_s = 0.0
        # The prior's rows a0 = x / t0(x), one per _PRIOR_STEPS entry, each of weight w = prior_weight / rows: every
        # refit adds w * sum a0 a0^T / scale^2 and w * sum a0 / scale (the data's scale), so the sums are made here.
        self._prior_vector = c0 = [self.prior[name] for name in FEATURES]  # [k]
        rows = [[x / t0 for x in f.vector()] for f in _PRIOR_STEPS if (t0 := _dot(c0, f.vector())) > 0.0]
        w = prior_weight / max(1, len(rows))
        self._prior_gram = [[w * sum(a0[i] * a0[j] for a0 in rows) for j in range(k)] for i in range(k)]
        self._prior_rhs = [w * sum(a0[i] for a0 in rows) for i in range(k)]

    # -- prediction ------------------------------------------------------------------------------
    def predict(self, features: StepFeatures) -> float:
        """Seconds."""
        c = self.coefficients
        return max(0.0, sum(c[name] * x for name, x in zip(FEATURES, features.vector(), strict=True)))

    def intercept(self) -> float:
        """Seconds a step costs before it computes anything."""
        return self.coefficients["intercept"]

    def grant_cost(self, num_computed: int, num_new: int, encoder_tokens: float = 0.0) -> float:
        """Seconds that one more request in a step adds: `num_new` tokens over `num_computed`
        cached ones (it attends to num_computed + num_new), plus its new encoder work."""
        c = self.coefficients
        return max(
            0.0,
            c["new_tokens"] * num_new
            + c["context_tokens"] * (num_computed + num_new)
            + c["num_seqs"]
            + c["encoder_tokens"] * encoder_tokens,
        )

    def encoder_cost(self, encoder_tokens: float) -> float:
        """Seconds that encoder work alone adds to a step (a slice of a group's encode with no tokens of its own)."""
        return max(0.0, self.coefficients["encoder_tokens"] * encoder_tokens)

    def tokens_within(self, seconds: float, num_computed: int, encoder_tokens: float = 0.0) -> int:
        """The most tokens one request may add to a step without adding more than `seconds`."""
        c = self.coefficients
        per_token = c["new_tokens"] + c["context_tokens"]
        fixed = self.grant_cost(num_computed, 0, encoder_tokens)
        if seconds < fixed:
            return 0
        if per_token <= 0.0 or seconds == math.inf:
            return 1 << 30  # tokens cost nothing in this model: only the token budget limits them
        return int((seconds - fixed) / per_token)

    def error_factor(self) -> float:
        """How much longer than predicted a step may run: the `error_quantile` of measured / predicted
        over the recent steps, within [1, MAX_ERROR_FACTOR] (1 before any step: the prior is already slow).
        Kept up to date by `observe`: the planners read it several times a step."""
        return self._error_factor

    def _add_ratio(self, ratio: float) -> None:
        ranked = self._ranked_ratios
        if len(self._ratios) == self._ratios.maxlen:
            del ranked[bisect.bisect_left(ranked, self._ratios[0])]  # the one the append pushes out
        self._ratios.append(ratio)
        bisect.insort(ranked, ratio)
        q = ranked[max(0, math.ceil(self.error_quantile * len(ranked)) - 1)]
        self._error_factor = min(max(q, 1.0), MAX_ERROR_FACTOR)

    def stats(self) -> StepTimeStats:
        return StepTimeStats(
            self.num_observed, self._predicted_s, self._observed_s, self._abs_error_s, self.error_factor()
        )

    # -- online fit ------------------------------------------------------------------------------
    def observe(self, features: StepFeatures, measured_s: float) -> None:
        """Account one executed step and refit when due (see the class). Nonsense times (<= 0, inf, nan)
        are ignored."""
        if not (measured_s > 0.0) or not math.isfinite(measured_s):
            return
        x = features.vector()
        predicted = self.predict(features)
        self.num_observed += 1
        self._predicted_s += predicted
        self._observed_s += measured_s
        self._abs_error_s += abs(measured_s - predicted)
        if predicted > 0.0:
            self._add_ratio(measured_s / predicted)
        prior = _dot(self._prior_vector, x)
        if prior > 0.0:
            # A running mean at first, then an exponential one; after the first step one step moves it by
            # at most a factor 4 (an outlier cannot rescale the prior wholesale).
            log_ratio = math.log(measured_s / prior)
            if self._num_scaled:
                bound = math.log(4.0)
                log_ratio = min(max(log_ratio, self._log_scale - bound), self._log_scale + bound)
            self._num_scaled += 1
            alpha = max(1.0 / self._num_scaled, 1.0 - self.forgetting)
            self._log_scale = (1.0 - alpha) * self._log_scale + alpha * log_ratio
        over = predicted / measured_s - 1.0  # the current model's relative error on this step
        weight = 1.0 if abs(over) <= _HUBER else _HUBER / abs(over)
        self._unfolded.append((x, measured_s, weight))
        self._steps_since_refit += 1
        if (
            self.num_observed <= _WARMUP_STEPS
            or self._steps_since_refit >= _REFIT_EVERY
            or abs(measured_s - predicted) > _SURPRISE * measured_s
        ):
            self._steps_since_refit = 0
            self._refit()

    def _fold(self) -> None:
        """Adds the rows observed since the last solve to the sums, oldest first, forgetting as it goes."""
        lam = self.forgetting
        for x, measured_s, weight in self._unfolded:
            a = [v / measured_s for v in x]
            self._rhs = [lam * r + weight * ai for r, ai in zip(self._rhs, a, strict=True)]
            for row, ai in zip(self._gram, a, strict=True):
                wa = weight * ai
                row[:] = [lam * g + wa * aj for g, aj in zip(row, a, strict=True)]
        self._unfolded.clear()

    def _refit(self) -> None:
        self._fold()
        k = len(FEATURES)
        scale = math.exp(self._log_scale)  # the prior's rows price steps at scale x the prior
        g, r = 1.0 / (scale * scale), 1.0 / scale
        gram = [
            [a + g * p for a, p in zip(row, prior, strict=True)]
            for row, prior in zip(self._gram, self._prior_gram, strict=True)
        ]
        rhs = [a + r * p for a, p in zip(self._rhs, self._prior_rhs, strict=True)]
        active = [j for j in range(k) if gram[j][j] > 0.0]
        while active:
            sol = _solve([[gram[i][j] for j in active] for i in active], [rhs[i] for i in active])
            if sol is None:
                return  # singular: keep the last fit
            if min(sol) >= 0.0:
                self.coefficients = dict.fromkeys(FEATURES, 0.0)
                for j, v in zip(active, sol, strict=True):
                    self.coefficients[FEATURES[j]] = v
                return
            active.pop(min(range(len(sol)), key=sol.__getitem__))  # a negative cost is nothing physical
        self.coefficients = dict.fromkeys(FEATURES, 0.0)

    # -- calibration -----------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Iterable[tuple[StepFeatures, float]]) -> StepTimeModel:
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
        return cls(dict(zip(FEATURES, coef.tolist(), strict=True)))

    # -- persistence -----------------------------------------------------------------------------
    def to_json(self) -> str:
        """The current fit, which a later start may take as its prior (a warm start)."""
        return json.dumps({"coefficients": self.coefficients}, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StepTimeModel:
        """A model whose prior is the file's coefficients. Files of the older format also hold an online
        `correction` factor; it is folded into the coefficients (their `ewma_alpha` no longer applies)."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("coefficients"), dict):
            raise ValueError("step-time model JSON must be an object with a 'coefficients' object")
        correction = data.get("correction", 1.0)
        if not isinstance(correction, (int, float)) or not correction > 0:
            raise ValueError("step-time model JSON: 'correction' must be a number > 0")
        coefficients = data["coefficients"]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in coefficients.values()):
            raise ValueError("step-time coefficients must be finite numbers >= 0")
        return cls({name: correction * v for name, v in coefficients.items()})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepTimeModel:
        return cls.from_json(Path(path).read_text())


_HUBER = 1.0  # rows the model over-predicts by more than this (relative) pull with weight _HUBER / error
# The refit cadence (see StepTimeModel): a solve after each of the first steps, after a step mispredicted by more
# than _SURPRISE of its measured time (a new shape, a machine that changed speed), else every _REFIT_EVERY steps.
_WARMUP_STEPS = 32
_SURPRISE = 0.25
_REFIT_EVERY = 8


def _dot(a: list[float], b: tuple[float, ...] | list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _solve(m: list[list[float]], b: list[float]) -> list[float] | None:
    """x with m x = b for a small symmetric positive semi-definite m ([n, n]), by Gaussian elimination
    with partial pivoting after a Jacobi scaling (the features span ten orders of magnitude). None if
    singular."""
    n = len(b)
    d = [1.0 / math.sqrt(m[i][i]) for i in range(n)]  # m[i][i] > 0 for every active feature
    a = [[m[i][j] * d[i] * d[j] for j in range(n)] + [b[i] * d[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, n + 1):
                    a[r][c] -= f * a[col][c]
    y = [0.0] * n
    for i in reversed(range(n)):
        y[i] = (a[i][n] - sum(a[i][j] * y[j] for j in range(i + 1, n))) / a[i][i]
    return [y[i] * d[i] for i in range(n)]
