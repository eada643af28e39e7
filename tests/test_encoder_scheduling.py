"""Encoder work inside chunked prefill: the scheduler plans which temporal groups to encode per step
under an encoder budget, shares cached groups, drops references once consumed, and evicts
unreferenced entries only when room is needed. Torch-free."""

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


def run(sched: Scheduler) -> list[SchedulerOutput]:
    plans = []
    while sched.has_unfinished_requests():
        plans.append(step(sched))
        assert len(plans) < 1000, "stalled"
    return plans


def work(plan: SchedulerOutput) -> list[tuple[str, int]]:
    return [(w.mm_input.mm_hash, w.group) for w in plan.encoder_work]


def test_image_is_encoded_when_the_chunk_first_overlaps_it_and_released_once_consumed() -> None:
    sched = make_scheduler(budget=5)
    sched.add_request(media_request("a", 20, [("img", 3, 8, 1)]))
    p1 = step(sched)  # tokens 0..4 overlap the image at 3..10
    assert work(p1) == [("img", 0)] and p1.num_encoder_tokens == 8
    p2 = step(sched)  # 5..9: still inside, nothing new to encode
    assert work(p2) == [] and sched.encoder_cache.num_referenced_tokens == 8
    p3 = step(sched)  # 10..14 covers the image's last token: released after this plan
    assert work(p3) == [] and sched.encoder_cache.num_referenced_tokens == 0
    assert sched.encoder_cache.is_cached(("img", 0))  # kept until its room is needed


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
    run(sched)
    assert sched.encoder_cache.num_referenced_tokens == 0
    # A later request with the same image is served from the cache, not the encoder.
    sched.add_request(media_request("c", 12, [("same", 5, 8, 1)], first=80))
    assert work(step(sched)) == [] and sched.stats().encoder_cache_hits == 16


def test_group_larger_than_the_encoder_budget_runs_alone() -> None:
    sched = make_scheduler(budget=64, encoder_budget=4)
    sched.add_request(media_request("a", 12, [("big", 2, 8, 1)]))
    assert work(step(sched)) == [("big", 0)]


def test_abort_and_preemption_release_encoder_entries() -> None:
    sched = make_scheduler(budget=4)
    sched.add_request(media_request("a", 20, [("img", 2, 12, 1)]))
    step(sched)
    assert sched.encoder_cache.num_referenced_tokens == 12
    sched.finish_request("a")
    assert sched.encoder_cache.num_referenced_tokens == 0


def test_preempted_request_releases_and_finds_its_groups_again_on_resume() -> None:
    sched = Scheduler(SchedulerConfig(8, 16, 64, "fcfs"), CacheConfig(4, 5, False))
    sched.add_request(media_request("old", 8, [("o", 0, 4, 1)], max_tokens=8))
    sched.add_request(media_request("new", 10, [("n", 1, 8, 1)], first=30, max_tokens=4))
    encoded: list[tuple[str, int]] = []
    while sched.has_unfinished_requests():
        encoded += work(step(sched))
    assert sched.num_preemptions > 0
    assert encoded.count(("n", 0)) == 1 and sched.stats().encoder_cache_hits >= 8  # a hit on resume
    assert sched.encoder_cache.num_referenced_tokens == 0 and sched.kv.num_free_blocks == 5


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


def test_without_encoder_chunking_a_video_is_encoded_whole_when_first_reached() -> None:
    sched = Scheduler(
        SchedulerConfig(8, 16, 512, "fcfs", max_num_encoder_tokens=6, chunk_encoder=False),
        CacheConfig(4, 256, True),
    )
    sched.add_request(media_request("v", 30, [("vid", 2, 24, 4)]))
    p = step(sched)
    assert work(p) == [("vid", g) for g in range(4)]  # over the budget, but alone in its step
    assert p.scheduled[0].num_scheduled_tokens == 8  # the token budget still chunks the prefill
    assert all(work(step(sched)) == [] for _ in range(3))


def test_group_larger_than_the_encoder_cache_still_runs_when_the_cache_is_empty() -> None:
    sched = make_scheduler(budget=7, encoder_budget=7, cache=28)
    sched.add_request(media_request("a", 70, [("huge", 2, 64, 1)]))
    sched.add_request(media_request("b", 70, [("other", 2, 64, 1)], first=100))
    plans = run(sched)
    assert [w for p in plans for w in work(p)] == [("huge", 0), ("other", 0)]


def test_unreferenced_entries_are_evicted_oldest_first_when_room_is_needed() -> None:
    sched = make_scheduler(budget=64, cache=16)
    sched.add_request(media_request("a", 10, [("first", 1, 8, 1)]))
    run(sched)
    sched.add_request(media_request("b", 10, [("second", 1, 8, 1)], first=20))
    run(sched)
    assert sched.encoder_cache.is_cached(("first", 0)) and sched.encoder_cache.is_cached(("second", 0))
    sched.add_request(media_request("c", 10, [("third", 1, 8, 1)], first=40))
    plan = step(sched)
    assert plan.freed_encoder_keys == (("first", 0),) and work(plan) == [("third", 0)]
    assert sched.encoder_cache.num_cached_tokens == 16


def test_a_new_entry_never_evicts_a_cached_one_the_same_request_shares() -> None:
    sched = make_scheduler(budget=64, encoder_budget=64, cache=12)
    sched.add_request(media_request("first", 12, [("Y", 2, 8, 1)]))
    run(sched)
    # X (new) comes before Y (cached, unreferenced) in the prompt; adding X must not evict Y.
    sched.add_request(media_request("second", 30, [("X", 0, 8, 1), ("Y", 10, 8, 1)], first=100))
    plans = run(sched)
    assert [w for p in plans for w in work(p)] == [("X", 0)] or ("Y", 0) in [
        w for p in plans for w in work(p)
    ]
    assert sched.encoder_cache.num_referenced_tokens == 0


def test_prefix_hit_inside_an_uncached_group_waits_instead_of_going_backwards() -> None:
    sched = Scheduler(
        SchedulerConfig(64, 16, 512, "fcfs", max_num_encoder_tokens=12, encoder_cache_size=12),
        CacheConfig(4, 64, True),
    )
    sched.add_request(media_request("a", 16, [("img", 2, 12, 1)]))
    run(sched)
    sched.add_request(media_request("c", 20, [("other", 0, 12, 1)], first=100))  # evicts img
    sched.add_request(media_request("b", 16, [("img", 2, 12, 1)]))  # prefix hit up to token 8, inside img
    plans = run(sched)
    for plan in plans:
        assert all(s.num_scheduled_tokens > 0 for s in plan.scheduled)
    assert ("img", 0) in [w for p in plans for w in work(p)]


def test_same_item_twice_in_a_prompt_keeps_its_reference_until_the_second_copy_is_planned() -> None:
    sched = make_scheduler(budget=13)
    sched.add_request(media_request("a", 24, [("img", 0, 8, 1), ("img", 10, 8, 1)]))
    step(sched)  # tokens 0..12: the first copy is done, the second is not
    assert sched.encoder_cache.holds("a", ("img", 0))
    run(sched)
    assert sched.encoder_cache.num_referenced_tokens == 0


def test_without_encoder_chunking_a_grant_never_exceeds_the_token_budget() -> None:
    sched = Scheduler(
        SchedulerConfig(
            16, 16, 512, "fcfs", max_num_encoder_tokens=16, encoder_cache_size=64, chunk_encoder=False
        ),
        CacheConfig(4, 256, True),
    )
    sched.add_request(media_request("v", 170, [("vid", 2, 160, 10)]))
    for plan in run(sched):
        assert plan.num_scheduled_tokens <= 16


def _costed_scheduler(budget: int, cost: float, encoder_budget: int | None = None) -> Scheduler:
    return Scheduler(
        SchedulerConfig(budget, 16, 512, "fcfs", max_num_encoder_tokens=encoder_budget, encoder_token_cost=cost),
        CacheConfig(4, 256, True),
    )


def test_encoder_token_cost_takes_its_share_of_the_token_budget() -> None:
    # Groups of 6 at 2, 8, 14, 20; budget 20, two groups' encoding per step.
    plain, costed = _costed_scheduler(20, 0.0, 12), _costed_scheduler(20, 0.5, 12)
    for sched in (plain, costed):
        sched.add_request(media_request("v", 30, [("vid", 2, 24, 4)]))
    p_plain, p_costed = step(plain), step(costed)
    assert work(p_plain) == work(p_costed) == [("vid", 0), ("vid", 1)]
    # Without a cost the chunk runs to the first group it cannot encode (14); with it, each encoded
    # group takes ceil(0.5 x 6) = 3 of the 20 tokens.
    assert p_plain.scheduled[0].num_scheduled_tokens == 14
    assert p_costed.scheduled[0].num_scheduled_tokens == 14  # 14 + 6 charged = 20
    p_costed = step(costed)  # 14..: groups 2 and 3 encoded, 6 charged: 14 tokens, the last 2 left
    assert work(p_costed) == [("vid", 2), ("vid", 3)] and p_costed.scheduled[0].num_scheduled_tokens == 14
    assert step(costed).scheduled[0].num_scheduled_tokens == 2


def test_encoder_token_cost_shrinks_the_chunk_beside_running_decodes() -> None:
    sched = _costed_scheduler(16, 1.0)
    for i in range(4):  # four decodes running
        sched.add_request(media_request(f"d{i}", 1, [], first=100 + i, max_tokens=50))
    step(sched)
    sched.add_request(media_request("v", 40, [("vid", 0, 36, 6)]))  # groups of 6
    plan = step(sched)
    video = next(s for s in plan.scheduled if s.request_id == "v")
    # 4 decodes + 12 left: group 0 charged 6, so 6 prefill tokens (group 0 whole); group 1 would need
    # its own 6 plus one of its tokens.
    assert work(plan) == [("vid", 0)] and video.num_scheduled_tokens == 6
    assert plan.num_scheduled_tokens + 6 <= 16


def test_encoder_token_cost_never_starves_a_chunk() -> None:
    # A cost far above what is left after the decodes: the charge is capped so the chunk still reaches
    # one token into each group, and the video finishes.
    sched = _costed_scheduler(8, 100.0)
    for i in range(6):
        sched.add_request(media_request(f"d{i}", 1, [], first=100 + i, max_tokens=40))
    step(sched)
    sched.add_request(media_request("v", 30, [("vid", 2, 24, 4)], max_tokens=2))
    plans = run(sched)
    assert sum(len(work(p)) for p in plans) == 4
    assert all(p.num_scheduled_tokens <= 8 for p in plans)
    assert sched.encoder_cache.num_referenced_tokens == 0 and sched.kv.num_free_blocks == 256


def test_a_group_whose_charge_does_not_fit_waits_for_the_next_step() -> None:
    sched = _costed_scheduler(10, 1.0)
    sched.add_request(media_request("v", 20, [("vid", 2, 12, 2)]))  # groups of 6 at 2 and 8
    plans = [step(sched) for _ in range(4)]
    # Step 1 encodes group 0 (6 charged) and stops short of group 1; step 2 prefills up to group 1
    # without encoding; step 3 encodes group 1 (6 charged) and prefills 4 of its tokens.
    assert [work(p) for p in plans] == [[("vid", 0)], [], [("vid", 1)], []]
    assert [p.scheduled[0].num_scheduled_tokens for p in plans] == [4, 4, 4, 8]
