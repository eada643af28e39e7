"""Scheduler unit tests on the CPU, driven by hand-built runner outputs (no model, no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.errors import InvalidRequestError, PromptTooLongError
from mmserve.request import Request, RequestStatus, SamplingParams
from mmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from mmserve.scheduler.plan_state import RequestStates, StepView
from mmserve.scheduler.scheduler import Scheduler


def make_scheduler(
    budget: int = 64,
    max_seqs: int = 16,
    num_blocks: int = 64,
    block_size: int = 4,
    policy: str = "fcfs",
    max_model_len: int = 256,
    prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(budget, max_seqs, max_model_len, policy),
        CacheConfig(block_size, num_blocks, prefix_caching),
    )


def make_request(rid: str, n: int, max_tokens: int = 4, first: int = 0, **kw: object) -> Request:
    return Request(
        rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, temperature=0, **kw)
    )


class Mirror:
    """What a runner holds, kept from the incremental plans alone; checked against the scheduler."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.states = sched, RequestStates()

    def apply(self, plan: SchedulerOutput) -> dict[str, StepView]:
        views = {v.request_id: v for v in self.states.apply(plan)}
        for request_id, v in views.items():
            request = self.sched.requests[request_id]
            assert v.token_ids == request.all_token_ids[v.start : v.end]
            assert v.state.block_ids == self.sched.kv.block_ids(request_id)
            assert tuple(v.state.data.prompt_token_ids) == tuple(request.prompt_token_ids)
        return views


def fake_run(plan: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    sampled = [s.request_id for s in plan.scheduled if s.sample]
    return ModelRunnerOutput(tuple(sampled), (token,) * len(sampled), (None,) * len(sampled))


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    plans = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return plans
        plan = sched.schedule()
        assert plan.num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(plan.scheduled) <= sched.config.max_num_seqs
        plans.append(plan)
        sched.update(plan, fake_run(plan))
    raise AssertionError("scheduler did not finish")


def step(sched: Scheduler) -> SchedulerOutput:
    plan = sched.schedule()
    sched.update(plan, fake_run(plan))
    return plan


def grants(plan: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_scheduled_tokens for s in plan.scheduled}


def test_importing_scheduler_does_not_import_torch() -> None:
    code = (
        "import sys, mmserve.scheduler.scheduler, mmserve.scheduler.output; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_budget_is_never_exceeded_and_everything_is_freed() -> None:
    sched = make_scheduler(budget=10, block_size=4)
    for i, n in enumerate([1, 9, 23, 4, 40, 10]):
        sched.add_request(make_request(f"r{i}", n, max_tokens=5, first=100 * i))
    plans = run_to_completion(sched)
    assert all(p.num_scheduled_tokens <= 10 for p in plans)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.running and not sched.waiting


def test_long_prefill_is_chunked_and_samples_only_at_its_end() -> None:
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", 20))
    chunks = []
    for _ in range(3):
        plan = sched.schedule()
        (s,) = plan.scheduled
        chunks.append((s.num_computed_tokens, s.num_scheduled_tokens, s.sample))
        sched.update(plan, fake_run(plan))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    s = sched.schedule().scheduled[0]
    # A decode carries only what the runner has not seen: the token it sampled last step, and the block
    # its 21st token starts (blocks of 4).
    assert (s.num_computed_tokens, s.new_token_ids, len(s.new_block_ids), s.sample) == (20, (7,), 1, True)


def test_decodes_are_served_before_partial_prefills_and_new_requests() -> None:
    sched = make_scheduler(budget=6)
    sched.add_request(make_request("short1", 2))
    sched.add_request(make_request("short2", 2))
    plan = sched.schedule()
    assert grants(plan) == {"short1": 2, "short2": 2}
    sched.update(plan, fake_run(plan))
    sched.add_request(make_request("long", 30))
    plan = sched.schedule()
    # Both decodes first (one token each), then the new prefill gets what is left.
    assert grants(plan) == {"short1": 1, "short2": 1, "long": 4}
    sched.update(plan, fake_run(plan))
    sched.add_request(make_request("late", 5))
    plan = sched.schedule()
    assert list(grants(plan)) == ["short1", "short2", "long"]
    assert grants(plan)["long"] == 4


def test_max_num_seqs_limits_running_requests() -> None:
    sched = make_scheduler(budget=100, max_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 3, first=10 * i))
    plan = sched.schedule()
    assert set(grants(plan)) == {"r0", "r1"}
    assert len(sched.waiting) == 2


def test_preemption_by_recompute_and_resume() -> None:
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fill 4 blocks; growing both forces preemption.
    sched = make_scheduler(budget=64, num_blocks=6, block_size=4, prefix_caching=False)
    sched.add_request(make_request("old", 8, max_tokens=8))
    sched.add_request(make_request("new", 8, max_tokens=8, first=50))
    preempted_plans = []
    for plan in run_to_completion(sched):
        if plan.preempted_request_ids:
            preempted_plans.append(plan)
    # The latest request is the victim; it is recomputed from scratch (prompt + its outputs).
    assert sched.num_preemptions >= 1
    assert all(p.preempted_request_ids == {"new"} for p in preempted_plans)
    assert sched.kv.num_free_blocks == 6


def test_preempted_request_recomputes_its_generated_tokens() -> None:
    sched = make_scheduler(budget=64, num_blocks=4, block_size=4, prefix_caching=False)
    sched.add_request(make_request("a", 7, max_tokens=6))
    sched.add_request(make_request("b", 7, max_tokens=6, first=50))
    seen_resume = False
    mirror = Mirror(sched)
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        for s in mirror.apply(plan).values():
            if s.request_id == "b" and s.start == 0 and s.end > 7:
                seen_resume = True
                assert s.token_ids[:7] == list(range(50, 57)) and set(s.token_ids[7:]) == {7}
                assert "b" in {n.request_id for n in plan.new_requests}  # resent whole after preemption
        sched.update(plan, fake_run(plan))
    assert seen_resume
    assert sched.kv.num_free_blocks == 4


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    sched = make_scheduler(budget=4, num_blocks=16)
    sched.add_request(make_request("running", 10))
    sched.add_request(make_request("waiting", 10, first=40))
    plan = sched.schedule()
    sched.update(plan, fake_run(plan))
    assert sched.kv.num_free_blocks < 16
    assert sched.finish_request("running")
    assert sched.finish_request("waiting")
    assert not sched.finish_request("waiting")
    assert sched.kv.num_free_blocks == 16
    assert sched.schedule().finished_request_ids == {"running", "waiting"}


def test_token_sampled_for_an_aborted_request_is_dropped() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    plan = sched.schedule()
    sched.finish_request("a")
    assert sched.update(plan, fake_run(plan)) == []


def test_stop_conditions() -> None:
    sched = make_scheduler(max_model_len=12)
    sched.add_request(Request("eos", [1, 2], SamplingParams(max_tokens=9), eos_token_ids=(7,)))
    sched.add_request(
        Request("ignore", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_ids=(7,))
    )
    sched.add_request(Request("stop_id", [1, 2], SamplingParams(max_tokens=9, stop_token_ids=[7])))
    sched.add_request(Request("context", [1] * 10, SamplingParams(max_tokens=9)))
    finished = {}
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        for out in sched.update(plan, fake_run(plan)):
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"eos": "stop", "ignore": "length", "stop_id": "stop", "context": "length"}


def test_invalid_requests_are_rejected_with_clear_errors() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        sched.add_request(make_request("long", 16))
    with pytest.raises(InvalidRequestError, match="at least one token"):
        sched.add_request(make_request("empty", 0))
    sched.add_request(make_request("dup", 2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(make_request("dup", 2))
    no_chunk = make_scheduler(budget=8, policy="no_chunk")
    with pytest.raises(PromptTooLongError, match="does not chunk"):
        no_chunk.add_request(make_request("big", 9))


def test_prefix_cache_hit_on_shared_prefix() -> None:
    sched = make_scheduler(budget=64, block_size=4)
    sched.add_request(make_request("a", 10))
    run_to_completion(sched)
    sched.add_request(Request("b", [*range(10), 99, 98], SamplingParams(max_tokens=2)))
    plan = sched.schedule()
    (s,) = plan.scheduled
    assert s.num_computed_tokens == 8  # two full blocks of "a"'s prompt were reused
    assert sched.stats().prefix_cache_hits == 8


def test_fcfs_policy_admits_in_arrival_order() -> None:
    sched = make_scheduler(budget=3, max_seqs=1)
    for rid in ("first", "second", "third"):
        sched.add_request(make_request(rid, 3, max_tokens=1, priority=-5 if rid == "third" else 0))
    order = [p.scheduled[0].request_id for p in run_to_completion(sched)]
    assert order == ["first", "second", "third"]


def test_priority_policy_admits_smaller_priority_first_and_preempts_the_largest() -> None:
    sched = make_scheduler(budget=3, max_seqs=1, policy="priority")
    for rid, prio in (("low", 5), ("high", -1), ("mid", 0)):
        sched.add_request(make_request(rid, 3, max_tokens=1, priority=prio))
    assert [p.scheduled[0].request_id for p in run_to_completion(sched)] == ["high", "mid", "low"]
    sched = make_scheduler(budget=64, num_blocks=4, block_size=4, policy="priority", prefix_caching=False)
    sched.add_request(make_request("important", 6, max_tokens=8, priority=-1))
    sched.add_request(make_request("batch", 6, max_tokens=8, priority=3, first=50))
    victims = set()
    for plan in run_to_completion(sched):
        victims |= plan.preempted_request_ids
    assert victims == {"batch"}


def test_no_chunk_policy_runs_whole_prefills_first() -> None:
    sched = make_scheduler(budget=10, policy="no_chunk")
    sched.add_request(make_request("a", 6))
    plan = sched.schedule()
    assert grants(plan) == {"a": 6}
    sched.update(plan, fake_run(plan))
    sched.add_request(make_request("b", 8, first=20))
    plan = sched.schedule()
    assert grants(plan) == {"b": 8}  # prefill-first: a's decode waits a step
    sched.update(plan, fake_run(plan))
    sched.add_request(make_request("c", 9, first=40))
    plan = sched.schedule()
    assert grants(plan) == {"c": 9}
    sched.update(plan, fake_run(plan))
    plan = sched.schedule()
    assert grants(plan) == {"a": 1, "b": 1, "c": 1}
    sched.update(plan, fake_run(plan))
    for plan in run_to_completion(sched):
        assert all(s.num_computed_tokens == 0 or s.num_scheduled_tokens == 1 for s in plan.scheduled)


def test_static_policy_admits_no_request_until_the_batch_finished() -> None:
    sched = make_scheduler(budget=100, policy="static")
    sched.add_request(make_request("a", 4, max_tokens=3))
    sched.add_request(make_request("b", 4, max_tokens=5, first=20))
    plan = sched.schedule()
    assert set(grants(plan)) == {"a", "b"}
    sched.update(plan, fake_run(plan))
    sched.add_request(make_request("c", 4, first=40))
    batches = []
    for plan in run_to_completion(sched):
        batches.append(set(grants(plan)))
    # "c" waits while "b" still decodes, even after "a" finished and left room.
    first_c = next(i for i, b in enumerate(batches) if "c" in b)
    assert all("c" not in b for b in batches[:first_c])
    assert all(b == {"c"} for b in batches[first_c:])
    assert {"b"} in batches[:first_c]


def test_block_hashes_distinguish_media() -> None:
    from mmserve.request import MultiModalInput, PlaceholderRange

    sched = make_scheduler(budget=64, block_size=4)
    img = lambda h: [MultiModalInput(h, PlaceholderRange(2, 4), "image")]  # noqa: E731
    a = Request("a", [1, 2, 9, 9, 9, 9, 3, 4, 5], SamplingParams(max_tokens=1), mm_inputs=img("cat"))
    sched.add_request(a)
    run_to_completion(sched)
    b = Request("b", [1, 2, 9, 9, 9, 9, 3, 4, 5], SamplingParams(max_tokens=1), mm_inputs=img("dog"))
    sched.add_request(b)
    assert step(sched).scheduled[0].num_computed_tokens == 0
    run_to_completion(sched)
    c = Request("c", [1, 2, 9, 9, 9, 9, 3, 4, 5], SamplingParams(max_tokens=1), mm_inputs=img("cat"))
    sched.add_request(c)
    assert step(sched).scheduled[0].num_computed_tokens == 8


def test_statuses_are_final_once_finished() -> None:
    assert RequestStatus.FINISHED_ABORTED.finished and not RequestStatus.PREEMPTED.finished
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"


def test_victim_granted_in_the_same_step_leaves_no_published_hash_for_unwritten_kv() -> None:
    """A partial prefill granted tokens, then preempted in the same step, must not leave block
    hashes for KV that was never written (a later prefix hit would read garbage)."""
    from mmserve.request import MultiModalInput, PlaceholderRange

    sched = Scheduler(
        SchedulerConfig(32, 16, 512, "priority", max_num_encoder_tokens=16, encoder_cache_size=64),
        CacheConfig(4, 17, True),
    )
    written: dict[tuple[int, int], tuple[str, int]] = {}
    mirror = Mirror(sched)
    block_ids: dict[str, list[int]] = {}

    def run_step() -> SchedulerOutput:
        plan = sched.schedule()
        for s in mirror.apply(plan).values():  # what a runner would write
            block_ids[s.request_id] = list(s.state.block_ids)
            for pos in range(s.start, s.end):
                written[(s.state.block_ids[pos // 4], pos % 4)] = (s.request_id, pos)
        sched.update(plan, fake_run(plan))
        return plan

    # A video prefill that the encoder budget slows to a few tokens a step, so H arrives meanwhile.
    video = [MultiModalInput("vid", PlaceholderRange(0, 64), "video", 4)]
    sched.add_request(
        Request("A", list(range(64)), SamplingParams(max_tokens=4, priority=1), mm_inputs=video)
    )
    run_step()
    sched.add_request(make_request("H", 30, max_tokens=2, first=1000, priority=0))
    while sched.has_unfinished_requests():
        plan = run_step()
        for s in plan.scheduled:
            if s.request_id == "A":  # every prefix-hit position holds A's own K/V
                assert all(
                    written.get((block_ids["A"][p // 4], p % 4)) == ("A", p)
                    for p in range(s.num_computed_tokens)
                )
    assert sched.num_preemptions > 0


def test_no_chunk_policy_readmits_a_preempted_request_longer_than_the_budget() -> None:
    sched = make_scheduler(
        budget=14, num_blocks=8, block_size=4, policy="no_chunk", max_model_len=32, prefix_caching=False
    )
    sched.add_request(make_request("a", 14, max_tokens=12))
    sched.add_request(make_request("b", 12, max_tokens=12, first=100))
    plans = run_to_completion(sched)
    assert sched.num_preemptions > 0 and all(p.num_scheduled_tokens <= 14 for p in plans)


def test_incremental_plans_describe_the_scheduler_state_through_preemption_aborts_and_prefix_hits() -> None:
    """A runner that only applies the plans' diffs holds, every step, exactly the scheduler's token ids
    and block tables; a decode step sends one token id per request and a block id only when one fills."""
    import random

    rng = random.Random(0)
    sched = make_scheduler(budget=24, max_seqs=6, num_blocks=12, block_size=4, max_model_len=40)
    mirror = Mirror(sched)
    shared = list(range(500, 512))  # a prefix several requests share (prefix-cache hits)
    for step_index in range(400):
        if rng.random() < 0.5:
            n = rng.randint(1, 14)
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1000) for _ in range(n)]
            sched.add_request(Request(f"r{step_index}", prompt, SamplingParams(max_tokens=rng.randint(1, 12))))
        if sched.requests and rng.random() < 0.05:
            sched.finish_request(rng.choice(sorted(sched.requests)))
        plan = sched.schedule()
        mirror.apply(plan)
        resent = {n.request_id for n in plan.new_requests}  # admitted, or readmitted after preemption
        for s in plan.scheduled:
            if s.is_decode and s.request_id not in resent:
                assert len(s.new_token_ids) == 1 and len(s.new_block_ids) <= 1
        sched.update(plan, fake_run(plan, token=rng.randrange(1000)))
    assert sched.num_preemptions > 0 and sched.kv.prefix_cache_hits > 0
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        mirror.apply(plan)
        sched.update(plan, fake_run(plan))
    mirror.apply(sched.schedule())  # the last finished ids reach the runner
    assert len(mirror.states) == 0  # and it keeps nothing for them
