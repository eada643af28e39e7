"""How the engine core reaches the model: an executor runs a plan and returns the sampled tokens.

The core talks to the workers only through this interface. `InProcessExecutor` runs the model runner
in the core's own process; `MultiRankExecutor` (`multirank_executor.py`, tensor parallelism) runs the
first rank there and the others in their own processes, behind the same methods.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from torch import nn

from mmserve.engine.model_runner import ModelRunner
from mmserve.engine.sampler import GrammarBitmask
from mmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from mmserve.engine.nixl_connector import NixlKVWorker


class Executor(Protocol):
    def execute_model(self, plan: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Run one plan (`grammar`: token masks of its constrained requests). Raises `StepFault` when the step fails after device work began."""
        ...

    def reset_encoder_cache(self) -> None:
        """Drop every cached encoder output (after a failed step, none can be trusted)."""
        ...

    def inject_faults(self, action: str, request_ids: tuple[str, ...] = ()) -> None:
        """Test hook (`FaultInjector`): "fail_requests" | "fail_next_step" | "kill_loop" | "clear"."""
        ...

    def attention_backend(self) -> str:
        ...

    def decode_graphs(self) -> tuple[str, tuple[int, ...], dict[int, int]]:
        """The first rank's decode graphs: (mode "off" | "static" | "cuda", the captured batch sizes, steps
        replayed at each size so far)."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of model weights each rank holds (the first rank's)."""
        ...

    def decode_stack_blocker(self) -> str | None:
        """Why the first rank's decode-only steps run layer by layer (None: as one C call on the CPU)."""
        ...

    def held_state(self) -> tuple[int, list[tuple[str, int]]]:
        """(requests the workers keep state for, their encoder-cache keys): for leak checks."""
        ...

    def local_model(self) -> nn.Module | None:
        """The whole decoder when it runs in this process (benchmarks hook its modules), else None."""
        ...

    def check_health(self) -> None:
        """Raises `EngineFatalError` if a worker is gone (called between steps, also when idle)."""
        ...

    def close(self) -> None:
        """Stop the workers and release what they hold; the executor is unusable after."""
        ...


class InProcessExecutor:
    def __init__(self, runner: ModelRunner, kv_worker: NixlKVWorker | None = None) -> None:
        """`kv_worker`: disaggregation's worker half over the runner's KV pool (None: off)."""
        self._runner = runner
        self._kv_worker = kv_worker

    def execute_model(self, plan: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        if self._kv_worker is None:
            return self._runner.execute(plan, grammar)
        # Reads finish between steps: a block read now is computed on from the next plan on, and a
        # request's blocks are read by a decode instance only after the step that wrote them returned.
        output = self._runner.execute(plan, grammar)
        report = self._kv_worker.step(plan.kv_loads, plan.kv_transfers_pending)
        return dataclasses.replace(
            output, kv_loads_done=report.done, kv_loads_failed=report.failed, kv_sends_done=report.sent,
            kv_blocks_read=report.blocks_read, kv_read_s=report.read_s,
        )  # fmt: skip

    def reset_encoder_cache(self) -> None:
        self._runner.reset_encoder_cache()

    def inject_faults(self, action: str, request_ids: tuple[str, ...] = ()) -> None:
        self._runner.faults.apply(action, request_ids)

    def attention_backend(self) -> str:
        return self._runner.backend.name

    def decode_graphs(self) -> tuple[str, tuple[int, ...], dict[int, int]]:
        return self._runner.decode_graph_summary()

    def weight_bytes(self) -> int:
        return self._runner.weight_bytes()

    def decode_stack_blocker(self) -> str | None:
        return self._runner.decode_stack_blocker

    def held_state(self) -> tuple[int, list[tuple[str, int]]]:
        return self._runner.held_state()

    def local_model(self) -> nn.Module | None:
        return self._runner.model

    def check_health(self) -> None:
        return None  # the runner lives in this thread: nothing can die apart from it

    def close(self) -> None:
        if self._kv_worker is not None:
            self._kv_worker.close()
