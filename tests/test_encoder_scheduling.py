"""Encoder work inside chunked prefill: the scheduler plans which temporal groups to encode per step
under an encoder budget, shares cached groups, and frees them once consumed. Torch-free."""

from __future__ import annotations

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.request import MultiModalInput, PlaceholderRange, Request, SamplingParams
from mmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from mmserve.scheduler.scheduler import Scheduler


def make_scheduler(
    budget: int, encoder_budget: int | None = None, policy: str = "fcfs", cache: int | None = None
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            budget, 16, 512, policy, max_num_encoder_tokens=encoder_budget, encoder_cache_size=cache
        ),
        CacheConfig(4, 256, True),
    )


def media_request(
    rid: str, n: int, items: list[tuple[str, int, int, int]], first: int = 0, max_tokens: int = 2
) -> Request:
    """items: (mm_hash, offset, length, num_groups)."""
    mm = [
        MultiModalInput(h, PlaceholderRange(o, ln), "video" if g > 1 else "image", g) for h, o, ln, g in items
    ]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(first, first + n)), params, mm_inputs=mm)


def step(sched: Scheduler) -> SchedulerOutput:
    plan = sched.schedule()
    sampled = [s.request_id for s in plan.scheduled if s.sample]
    sched.update(plan, ModelRunnerOutput(tuple(sampled), (1,) * len(sampled), (None,) * len(sampled)))
    return plan


def work(plan: SchedulerOutput) -> list[tuple[str, int]]:
    return [(w.mm_input.mm_hash, w.group) for w in plan.encoder_work]


def test_image_is_encoded_when_the_chunk_first_overlaps_it_and_freed_once_consumed() -> None:
    sched = make_scheduler(budget=5)
    sched.add_request(media_request("a", 20, [("img", 3, 8, 1)]))
    p1 = step(sched)  # tokens 0..4 overlap the image at 3..10
    assert work(p1) == [("img", 0)] and p1.num_encoder_tokens == 8
    p2 = step(sched)  # 5..9: still inside, nothing new to encode
    assert work(p2) == [] and p2.freed_encoder_keys == ()
    p3 = step(sched)  # 10..14 covers the image's last token: released after this plan
    assert work(p3) == [] and p3.freed_encoder_keys == ()
    assert step(sched).freed_encoder_keys == (("img", 0),)
    assert sched.encoder_cache.num_used == 0


def test_video_groups_are_encoded_one_step_at_a_time_under_the_encoder_budget() -> None:
    sched = make_scheduler(budget=64, encoder_budget=6)
    sched.add_request(media_request("v", 30, [("vid", 2, 24, 4)]))  # groups of 6 at 2, 8, 14, 20
    plans = [step(sched) for _ in range(5)]
    assert [work(p) for p in plans[:4]] == [[("vid", g)] for g in range(4)]
    # Each chunk stops right before the group it could not encode.
    assert [p.scheduled[0].num_scheduled_tokens for p in plans[:4]] == [8, 6, 6, 10]
    assert all(p.num_encoder_tokens <= 6 for p in plans)


def test_chunk_that_cannot_encode_anything_waits_for_the_next_step() -> None:
    sched = make_scheduler(budget=64, encoder_budget=6)
    sched.add_request(media_request("a", 10, [("x", 0, 6, 1)]))
    sched.add_request(media_request("b", 10, [("y", 0, 6, 1)], first=50))
    p1 = step(sched)
    assert [s.request_id for s in p1.scheduled] == ["a"]
    p2 = step(sched)
    assert work(p2) == [("y", 0)]


def test_same_image_in_two_requests_is_encoded_once() -> None:
    sched = make_scheduler(budget=64)
    sched.add_request(media_request("a", 12, [("same", 2, 8, 1)]))
    sched.add_request(media_request("b", 12, [("same", 2, 8, 1)], first=40))
    p1 = step(sched)
    assert work(p1) == [("same", 0)]
    assert sched.stats().encoder_cache_hits == 8 and sched.stats().num_encoder_tokens_computed == 8
    assert step(sched).freed_encoder_keys == (("same", 0),)


def test_group_larger_than_the_encoder_budget_runs_alone() -> None:
    sched = make_scheduler(budget=64, encoder_budget=4)
    sched.add_request(media_request("a", 12, [("big", 2, 8, 1)]))
    assert work(step(sched)) == [("big", 0)]


def test_abort_and_preemption_release_encoder_entries() -> None:
    sched = make_scheduler(budget=4)
    sched.add_request(media_request("a", 20, [("img", 2, 12, 1)]))
    step(sched)
    assert sched.encoder_cache.num_used == 12
    sched.finish_request("a")
    assert sched.encoder_cache.num_used == 0
    assert sched.schedule().freed_encoder_keys == (("img", 0),)


def test_preempted_request_releases_and_re_encodes_on_resume() -> None:
    sched = Scheduler(SchedulerConfig(8, 16, 64, "fcfs"), CacheConfig(4, 5, False))
    sched.add_request(media_request("old", 8, [("o", 0, 4, 1)], max_tokens=8))
    sched.add_request(media_request("new", 10, [("n", 1, 8, 1)], first=30, max_tokens=4))
    encoded: list[tuple[str, int]] = []
    while sched.has_unfinished_requests():
        encoded += work(step(sched))
    assert sched.num_preemptions > 0
    assert encoded.count(("n", 0)) >= 2  # encoded again after recompute
    assert sched.encoder_cache.num_used == 0 and sched.kv.num_free_blocks == 5


def test_no_chunk_policy_encodes_the_whole_prompt_at_once() -> None:
    sched = make_scheduler(budget=64, encoder_budget=6, policy="no_chunk")
    sched.add_request(media_request("v", 30, [("vid", 2, 24, 4)]))
    p = step(sched)
    assert work(p) == [("vid", g) for g in range(4)] and p.scheduled[0].num_scheduled_tokens == 30


def test_step_composition_counts() -> None:
    sched = make_scheduler(budget=64)
    sched.add_request(media_request("a", 10, [("img", 2, 4, 1)]))
    p1 = step(sched)
    assert (p1.num_prefill_tokens, p1.num_decode_tokens, p1.num_encoder_tokens) == (10, 0, 4)
    sched.add_request(media_request("b", 5, [], first=20))
    p2 = step(sched)
    assert (p2.num_prefill_tokens, p2.num_decode_tokens, p2.num_encoder_tokens) == (5, 1, 0)
