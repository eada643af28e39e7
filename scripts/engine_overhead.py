"""The issue's engine overhead at one stream: of each decode step, the share not spent in the model's forward and
logits (`Decoder.forward` + `Decoder.compute_logits`, timed around each call). Two measures of a step:
  - `step`: its `StepRecord` duration (schedule, inputs, forward, sampling, the scheduler's update);
  - `interval`: from one forward's start to the next one's: everything the engine loop does per token, the
    step-time model's refit, stats and output processing (detokenizing, stop checks) included.
One in-process LLM over the bench checkpoint (`$MODEL` overrides), greedy 256-token replies to 30-token prompts,
one line per round.

  python scripts/engine_overhead.py float32 [rounds] [--functions]      # or bfloat16

`--functions` also times each engine function of `_FUNCTIONS` around its calls and prints its mean per step over
all rounds (the prefill steps included, a few in 256). The wrappers add their own cost to every line, and
nested functions count in their callers too: read the lines against each other, not as a sum.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from mmserve import LLM, SamplingParams
from mmserve.engine.core import EngineCore
from mmserve.engine.model_runner import ModelRunner
from mmserve.engine.output_processor import OutputProcessor
from mmserve.engine.sampler import Sampler, SamplingMetadataCache
from mmserve.models import decoder
from mmserve.scheduler.scheduler import Scheduler

# (class, method) timed by --functions: the per-step work around the forward, in the order a step runs it.
_FUNCTIONS: list[tuple[type, str]] = [
    (Scheduler, "schedule"),
    (ModelRunner, "execute"),
    (ModelRunner, "_build_rows"),
    (ModelRunner, "_prepare"),
    (SamplingMetadataCache, "build"),
    (Sampler, "forward"),
    (Scheduler, "update"),
    (Scheduler, "record_step_time"),
    (Scheduler, "stats"),
    (EngineCore, "step"),
    (OutputProcessor, "process"),
]


def _time_functions() -> dict[str, float]:
    """Wraps each of `_FUNCTIONS`; returns the dict their seconds accumulate in, by `Class.method`."""
    totals: dict[str, float] = {}

    def timed(cls: type, name: str) -> None:
        method = getattr(cls, name)
        key = f"{cls.__name__}.{name}"
        totals[key] = 0.0

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - start

        setattr(cls, name, wrapper)

    for cls, name in _FUNCTIONS:
        timed(cls, name)
    return totals


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--functions"]
    dtype = args[0] if args else "float32"
    rounds = int(args[1]) if len(args) > 1 else 5
    functions = _time_functions() if "--functions" in sys.argv[1:] else None
    model_s: list[float] = []  # per step: forward + logits seconds
    starts: list[float] = []  # per step: when its forward began

    def timed(method: Callable[..., Any], new_step: bool) -> Callable[..., Any]:
        def wrapper(self: decoder.Decoder, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = method(self, *args, **kwargs)
            if new_step:
                starts.append(start)
                model_s.append(0.0)
            model_s[-1] += time.perf_counter() - start
            return result

        return wrapper

    decoder.Decoder.forward = timed(decoder.Decoder.forward, True)  # type: ignore[method-assign]
    decoder.Decoder.compute_logits = timed(decoder.Decoder.compute_logits, False)  # type: ignore[method-assign]
    llm = LLM(os.environ.get("MODEL", os.path.expanduser("~/.cache/mmserve/bench-qwen2")), dtype=dtype)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    llm.generate(["the 1 " * 30], params)  # warm-up
    if functions is not None:
        functions.update(dict.fromkeys(functions, 0.0))
    num_steps = 0
    for round_ in range(rounds):
        llm.step_records.clear()
        model_s.clear()
        starts.clear()
        llm.generate([f"the {round_ + 2} " * 30], params)
        steps = list(zip(llm.step_records, model_s, strict=True))  # one forward per step
        num_steps += len(steps)
        decodes = [(r.duration_s, m) for r, m in steps if r.num_prefill_tokens == 0]
        step = sum(d for d, _ in decodes) / len(decodes)
        model = sum(m for _, m in decodes) / len(decodes)
        # intervals that start at a decode's forward (the last one has no next forward)
        intervals = [
            (b - a, m) for (r, m), a, b in zip(steps, starts, starts[1:], strict=False) if r.num_prefill_tokens == 0
        ]
        interval = sum(i for i, _ in intervals) / len(intervals)
        interval_model = sum(m for _, m in intervals) / len(intervals)
        print(f"{dtype}: {len(decodes)} decode steps, forward + logits {model * 1e3:.2f} ms; "
              f"step {step * 1e3:.2f} ms, engine {(step - model) * 1e3:.2f} ms = {(step - model) / step:.1%}; "
              f"interval {interval * 1e3:.2f} ms, engine {(interval - interval_model) * 1e3:.2f} ms = "
              f"{(interval - interval_model) / interval:.1%}")  # fmt: skip
    if functions is not None:
        for key, seconds in sorted(functions.items(), key=lambda kv: -kv[1]):
            print(f"{seconds / num_steps * 1e6:8.1f} us/step  {key}")


if __name__ == "__main__":
    main()
