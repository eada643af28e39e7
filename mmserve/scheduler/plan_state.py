"""The runner side of incremental plans: each running request's token ids, block table and inputs,
kept from the `NewRequestData` it was sent once and the diffs of every later plan.

Torch-free (tensors inside `NewRequestData` are opaque here). Used by the model runner and, later, by
every tensor-parallel rank; tests use it to check that a plan sequence describes the scheduler's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput


@dataclass
class RequestState:
    data: NewRequestData
    token_ids: list[int]  # prompt + the outputs the runner has been sent
    block_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.data.prompt_token_ids)


@dataclass(frozen=True)
class StepView:
    """One scheduled request of a step with everything the runner needs to build its rows."""

    state: RequestState
    scheduled: ScheduledRequest

    @property
    def request_id(self) -> str:
        return self.scheduled.request_id

    @property
    def start(self) -> int:
        return self.scheduled.num_computed_tokens

    @property
    def end(self) -> int:
        return self.scheduled.num_computed_tokens + self.scheduled.num_scheduled_tokens

    @property
    def token_ids(self) -> list[int]:
        """[num_scheduled_tokens]"""
        return self.state.token_ids[self.start : self.end]

    @property
    def num_output_tokens(self) -> int:
        """Outputs generated before this step (seeds per-step sampling noise)."""
        return len(self.state.token_ids) - self.state.num_prompt_tokens


class RequestStates:
    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def apply(self, plan: SchedulerOutput) -> list[StepView]:
        """Bring every request up to this plan; returns the scheduled ones in batch order. Raises
        ValueError if the plan refers to a request it never sent or does not cover its tokens."""
        for request_id in plan.finished_request_ids | plan.preempted_request_ids:
            self._states.pop(request_id, None)
        for new in plan.new_requests:
            self._states[new.request_id] = RequestState(new, list(new.prompt_token_ids))
        views = []
        for s in plan.scheduled:
            state = self._states.get(s.request_id)
            if state is None:
                raise ValueError(f"request {s.request_id}: scheduled but never sent")
            state.token_ids.extend(s.new_token_ids)
            state.block_ids.extend(s.new_block_ids)
            if s.num_computed_tokens + s.num_scheduled_tokens > len(state.token_ids):
                raise ValueError(f"request {s.request_id}: the plan does not cover its tokens")
            views.append(StepView(state, s))
        return views

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)
