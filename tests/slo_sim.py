"""A small discrete-event simulation for scheduler tests: the real Scheduler, a virtual clock, a
fixed step-cost model standing in for the device, hand-built runner outputs. Deterministic."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.request import SLO, MultiModalInput, PlaceholderRange, Request, SamplingParams, ServiceClass
from mmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from mmserve.scheduler.scheduler import Scheduler
from mmserve.scheduler.step_time import StepFeatures, StepTimeModel

# The simulated device: about 1.25k prefill tokens/s, a 64-token image group in ~32 ms.
TRUE_COST = StepTimeModel(
    {
        "intercept": 4e-3,
        "new_tokens": 8e-4,
        "context_tokens": 2e-6,
        "num_seqs": 2e-4,
        "encoder_tokens": 5e-4,
    }
)


class VirtualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Trace:
    """One request's life as the simulated client sees it."""

    request: Request
    token_times: list[float] = field(default_factory=list)  # clock time of each output token
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.request.arrival_time if self.token_times else None

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (vLLM's TPOT); 0 for one token."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0

    @property
    def max_itl(self) -> float:
        t = self.token_times
        return max((b - a for a, b in itertools.pairwise(t)), default=0.0)


@dataclass(frozen=True)
class RunningSnapshot:
    """A running request as it stood right before a schedule() call."""

    request_id: str
    service_class: ServiceClass
    is_decode: bool  # Request.is_decoding: its prompt is in, one token left to compute


def fake_run(plan: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    sampled = [s.request_id for s in plan.scheduled if s.sample]
    return ModelRunnerOutput(tuple(sampled), (token,) * len(sampled), (None,) * len(sampled))


def make_scheduler(
    policy: str,
    clock: VirtualClock,
    budget: int = 512,
    max_seqs: int = 32,
    num_blocks: int = 4096,
    block_size: int = 16,
    model: StepTimeModel | None = None,
    encoder_depth: int = 0,
    **slo_knobs: object,
) -> Scheduler:
    config = SchedulerConfig(
        budget, max_seqs, 8192, policy, max_num_encoder_tokens=256, encoder_cache_size=4096, **slo_knobs
    )
    # A fresh copy of the true costs unless told otherwise, so online corrections never leak between runs.
    model = model or StepTimeModel(TRUE_COST.coefficients)
    return Scheduler(config, CacheConfig(block_size, num_blocks, True), clock=clock, step_time_model=model,
                     encoder_depth=encoder_depth)  # fmt: skip


def request(
    rid: str,
    arrival: float,
    prompt: int,
    max_tokens: int,
    service_class: str = "interactive",
    slo: SLO | dict | None = None,
    media: list[tuple[int, int, int]] = (),  # (offset, length, num_groups)
    first_token_id: int = 0,
) -> Request:
    """A request whose prompt tokens are distinct across requests (no accidental prefix hits)."""
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, service_class=service_class, slo=slo
    )
    mm = [
        MultiModalInput(f"{rid}-mm{i}", PlaceholderRange(o, n), "video" if g > 1 else "image", g)
        for i, (o, n, g) in enumerate(media)
    ]
    tokens = list(range(first_token_id, first_token_id + prompt))
    return Request(rid, tokens, params, arrival_time=arrival, mm_inputs=mm)


def simulate(
    sched: Scheduler,
    clock: VirtualClock,
    arrivals: list[Request],
    cost: StepTimeModel = TRUE_COST,
    feedback: bool = True,
    on_plan: Callable[[Scheduler, SchedulerOutput, list[RunningSnapshot]], None] | None = None,
    aborts: dict[str, float] | None = None,  # request id -> clock time at which the client cancels
    idle_step_s: float = 5e-3,
    max_steps: int = 200_000,
) -> dict[str, Trace]:
    """Run until every request finished. A step takes cost.predict(plan) seconds of virtual time;
    its tokens are stamped at the step's end. Arrivals join before the first step that starts at
    or after their arrival time."""
    pending = sorted(arrivals, key=lambda r: r.arrival_time)
    traces = {r.request_id: Trace(r) for r in arrivals}
    aborts = dict(aborts or {})
    for _ in range(max_steps):
        while pending and pending[0].arrival_time <= clock.now:
            sched.add_request(pending.pop(0))
        for rid, at in list(aborts.items()):
            if at <= clock.now:
                del aborts[rid]
                if sched.finish_request(rid):
                    traces[rid].finish_reason = "abort"
        if not sched.has_unfinished_requests():
            if not pending:
                return traces
            clock.now = pending[0].arrival_time
            continue
        before = [
            RunningSnapshot(r.request_id, r.service_class, r.is_decoding)
            for r in sched.running
        ]
        plan = sched.schedule()
        if on_plan is not None:
            on_plan(sched, plan, before)
        if plan.is_empty and not plan.encoder_work:
            # Nothing can run (memory, pins): time passes until the next arrival or a short idle tick.
            clock.now = (
                min(pending[0].arrival_time, clock.now + idle_step_s) if pending else clock.now + idle_step_s
            )
            continue
        features = StepFeatures.of_plan(plan)
        duration = cost.predict(features)
        clock.now += duration
        for out in sched.update(plan, fake_run(plan)):
            trace = traces[out.request_id]
            trace.token_times.append(clock.now)
            if out.finished:
                trace.finish_reason = out.finish_reason
        if feedback:
            sched.record_step_time(features, duration)
    raise AssertionError("simulation did not finish")


def effective_slo(sched: Scheduler, req: Request) -> SLO:
    """The request's own targets over its (original) class's defaults, whatever the policy."""
    own = req.sampling_params.slo or SLO()
    return own.over(sched.config.class_slo(req.sampling_params.service_class))


def meets_slo(trace: Trace, slo: SLO) -> bool:
    """vLLM's goodput rule: every target the request has must be met (TBT judged as mean TPOT)."""
    if trace.finish_reason not in ("stop", "length") or trace.ttft is None:
        return False
    if slo.ttft_ms is not None and trace.ttft * 1e3 > slo.ttft_ms:
        return False
    if slo.tbt_ms is not None and trace.tpot * 1e3 > slo.tbt_ms:
        return False
    e2e = trace.token_times[-1] - trace.request.arrival_time
    return slo.deadline_ms is None or e2e * 1e3 <= slo.deadline_ms


def goodput(sched: Scheduler, traces: dict[str, Trace], cls: ServiceClass | None = None) -> int:
    return sum(
        meets_slo(t, effective_slo(sched, t.request))
        for t in traces.values()
        if cls is None or t.request.sampling_params.service_class == cls
    )


def slo_mix(seed: int, num_chats: int = 60, chat_rate: float = 4.0, num_batch: int = 8) -> list[Request]:
    """Poisson chats (short text, some with one 64-token image) over a backlog of batch jobs (long
    prompts, some with a 4-group video), all arriving in the first seconds."""
    rng = random.Random(seed)
    out: list[Request] = []
    t = 0.0
    for i in range(num_chats):
        t += rng.expovariate(chat_rate)
        prompt = rng.randint(16, 64)
        media = [(4, 64, 1)] if rng.random() < 0.3 else []
        out.append(
            request(
                f"chat{i}",
                t,
                prompt + (64 if media else 0),
                rng.randint(8, 24),
                media=media,
                first_token_id=100_000 * (i + 1),
            )
        )
    for j in range(num_batch):
        prompt = rng.randint(600, 1200)
        media = [(8, 512, 4)] if j % 3 == 0 else []
        out.append(
            request(
                f"batch{j}",
                rng.uniform(0.0, 0.5),
                prompt,
                rng.randint(16, 48),
                "batch",
                media=media,
                first_token_id=10_000_000 + 100_000 * j,
            )
        )
    return out


def blocks_in_use(sched: Scheduler) -> int:
    return sched.kv.num_blocks - sched.kv.num_free_blocks


def finite(x: float) -> bool:
    return not math.isinf(x)
