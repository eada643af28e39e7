"""How the engine core reaches the model: an executor runs a plan and returns the sampled tokens.

The core talks to the workers only through this interface. `InProcessExecutor` runs the model runner
in the core's own process; a multi-rank executor (tensor parallelism) implements the same methods.
"""

from __future__ import annotations

from typing import Protocol

from mmserve.engine.model_runner import ModelRunner
from mmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one plan. Raises `StepFault` when the step fails after device work began."""
        ...

    def reset_encoder_cache(self) -> None:
        """Drop every cached encoder output (after a failed step, none can be trusted)."""
        ...

    def inject_faults(self, action: str, request_ids: tuple[str, ...] = ()) -> None:
        """Test hook (`FaultInjector`): "fail_requests" | "fail_next_step" | "kill_loop" | "clear"."""
        ...

    def attention_backend(self) -> str:
        ...

    def held_state(self) -> tuple[int, list[tuple[str, int]]]:
        """(requests the workers keep state for, their encoder-cache keys): for leak checks."""
        ...


class InProcessExecutor:
    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self._runner.execute(plan)

    def reset_encoder_cache(self) -> None:
        self._runner.reset_encoder_cache()

    def inject_faults(self, action: str, request_ids: tuple[str, ...] = ()) -> None:
        faults = self._runner.faults
        if action == "fail_requests":
            faults.fail_requests(request_ids)
        elif action == "fail_next_step":
            faults.fail_next_step()
        elif action == "kill_loop":
            faults.kill_loop()
        elif action == "clear":
            faults.clear()
        else:
            raise ValueError(f"unknown fault action {action!r}")

    def attention_backend(self) -> str:
        return self._runner.backend.name

    def held_state(self) -> tuple[int, list[tuple[str, int]]]:
        return self._runner.held_state()
