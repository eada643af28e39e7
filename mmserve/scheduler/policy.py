"""Scheduling policies: the order of waiting requests, the preemption victim, and the knobs that
make the `static` and `no_chunk` baselines. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.request import Request


@dataclass(frozen=True)
class SchedulingPolicy:
    """Waiting requests are admitted in ascending `sort_key`; the victim of preemption is the
    running request with the largest key (lowest priority, latest arrival)."""

    name: str
    use_priority: bool = False
    chunked_prefill: bool = True  # a prefill may be split across steps to fit the token budget
    prefill_first: bool = False  # a step that admits new prefills runs no decodes
    admit_while_running: bool = True  # False: a new batch starts only when the last one finished
    slo_aware: bool = False  # steps are planned by scheduler/slo.py (service classes, SLO targets)

    def sort_key(self, request: Request) -> tuple[int, ...]:
        if self.use_priority:
            return (request.priority, request.arrival_seq)
        return (request.arrival_seq,)

    def pick_victim(self, running: list[Request]) -> Request:
        return max(running, key=self.sort_key)


POLICIES: dict[str, SchedulingPolicy] = {
    "fcfs": SchedulingPolicy("fcfs"),
    "priority": SchedulingPolicy("priority", use_priority=True),
    # vLLM V0's default: whole prefills only, and a step with prefills runs no decodes.
    "no_chunk": SchedulingPolicy("no_chunk", chunked_prefill=False, prefill_first=True),
    # Classic static batching: a batch is formed, run to completion, then the next is formed.
    "static": SchedulingPolicy(
        "static", chunked_prefill=False, prefill_first=True, admit_while_running=False
    ),
    # Interactive decodes protected under a TBT-derived step-time budget, interactive prefills
    # least-slack-first, batch work in what is left. Its order and victims live in SloPlanner;
    # sort_key and pick_victim above are unused by it.
    "slo": SchedulingPolicy("slo", slo_aware=True),
}


def get_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from {sorted(POLICIES)}") from None
