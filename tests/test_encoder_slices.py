"""A temporal group too large for one step's time is encoded over several steps, a slice of the vision
tower's blocks each, so the decodes beside it keep their pace: the scheduler's side in a simulation (virtual
clock), the bookkeeping of partial groups, and a real engine whose output does not change."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from slo_sim import TRUE_COST, VirtualClock, fake_run, make_scheduler, request, simulate

from mmserve.request import RequestStatus
from mmserve.scheduler.encoder_cache import EncoderCacheManager
from mmserve.scheduler.output import SchedulerOutput
from mmserve.scheduler.scheduler import Scheduler
from mmserve.scheduler.step_time import StepTimeModel

# A device whose vision encoder is slow: a 256-token group takes about 1 s, four times the step target.
SLOW_ENCODER = StepTimeModel({**TRUE_COST.coefficients, "encoder_tokens": 4e-3})
DEPTH = 32


def chat_beside_video(policy: str, encoder_depth: int) -> tuple[dict, list[SchedulerOutput], Scheduler]:
    clock = VirtualClock()
    sched = make_scheduler(policy, clock, model=StepTimeModel(SLOW_ENCODER.coefficients), max_step_ms=250.0,
                           encoder_depth=encoder_depth)  # fmt: skip
    chat = request("chat", 0.0, 32, 120)
    video = request("video", 0.3, 1100, 4, media=[(10, 1024, 4)], first_token_id=10_000)  # 4 groups of 256
    plans: list[SchedulerOutput] = []
    traces = simulate(sched, clock, [chat, video], cost=SLOW_ENCODER, on_plan=lambda s, p, _: plans.append(p))
    return traces, plans, sched


@pytest.mark.parametrize("policy", ["fcfs", "slo"])
def test_a_slow_groups_encode_is_spread_so_the_chat_beside_it_keeps_its_pace(policy: str) -> None:
    whole, _, _ = chat_beside_video(policy, encoder_depth=0)
    assert whole["chat"].max_itl > 0.9  # each group's encode stalls the stream for a whole second
    traces, plans, sched = chat_beside_video(policy, encoder_depth=DEPTH)
    assert traces["video"].finish_reason == "length" and traces["chat"].finish_reason == "length"
    assert traces["chat"].max_itl <= 2 * 0.250, traces["chat"].max_itl
    # Each group: slices that chain from block 0 to the tower's end, and none of its tokens before the last.
    done: dict[tuple[str, int], int] = {}
    for plan in plans:
        for w in plan.encoder_work:
            key = (w.mm_input.mm_hash, w.group)
            assert w.blocks is not None and w.blocks[0] == done.get(key, 0) and w.blocks[2] == DEPTH, (key, w.blocks)
            done[key] = w.blocks[1]
        for s in plan.scheduled:
            if s.request_id == "video":
                last = s.num_computed_tokens + s.num_scheduled_tokens - 1
                group = (last - 10) // 256
                if 0 <= group < 4:
                    assert done.get(("video-mm0", group)) == DEPTH, (group, done)
    assert done == {("video-mm0", g): DEPTH for g in range(4)}
    stats = sched.stats()
    assert stats.num_encoder_slices > 4 and stats.num_partial_encodes == 0
    assert stats.num_encoder_tokens_computed == 1024


def test_a_group_that_fits_the_step_is_encoded_whole() -> None:
    """Slicing is for groups that do not fit: with the fast encoder every group goes in one piece."""
    clock = VirtualClock()
    sched = make_scheduler("fcfs", clock, max_step_ms=250.0, encoder_depth=DEPTH)
    chat = request("chat", 0.0, 32, 40)
    video = request("video", 0.05, 300, 4, media=[(10, 256, 4)], first_token_id=10_000)  # 64-token groups
    plans: list[SchedulerOutput] = []
    simulate(sched, clock, [chat, video], on_plan=lambda s, p, _: plans.append(p))
    work = [w for p in plans for w in p.encoder_work]
    assert len(work) == 4 and all(w.blocks is None for w in work)


def test_an_aborted_requests_partial_group_is_dropped_by_the_next_plan() -> None:
    clock = VirtualClock()
    sched = make_scheduler("fcfs", clock, model=StepTimeModel(SLOW_ENCODER.coefficients), max_step_ms=250.0,
                           encoder_depth=DEPTH)  # fmt: skip
    sched.add_request(request("chat", 0.0, 32, 50))
    plan = sched.schedule()
    sched.update(plan, fake_run(plan))  # the chat decodes from now on: steps have a time limit
    sched.add_request(request("video", 0.0, 600, 4, media=[(10, 512, 2)], first_token_id=10_000))
    key = ("video-mm0", 0)
    for _ in range(20):
        plan = sched.schedule()
        sched.update(plan, fake_run(plan))
        if sched.encoder_cache.is_partial(key):
            break
    assert sched.stats().num_partial_encodes == 1
    sched.finish_request("video")
    assert sched.stats().num_partial_encodes == 0 and sched.has_unsent_diffs()
    plan = sched.schedule()
    assert key in plan.freed_encoder_keys  # the runner drops its hidden states before this plan's work
    sched.update(plan, fake_run(plan))
    assert not sched.encoder_cache.has_pending_evictions()


@pytest.mark.parametrize("policy", ["fcfs", "slo"])
def test_only_an_admitted_request_gets_a_slice_with_no_tokens(policy: str) -> None:
    """A waiting request's first group is encoded with its admission (its tokens, its KV blocks), never as
    work ahead of it: a failing slice must be blamed on a request the step ran, and the cache room it holds
    on one that holds blocks."""
    clock = VirtualClock()
    sched = make_scheduler(policy, clock, model=StepTimeModel(SLOW_ENCODER.coefficients), max_step_ms=250.0,
                           encoder_depth=DEPTH)  # fmt: skip
    chat = request("chat", 0.0, 32, 300)
    video = request("video", 0.3, 600, 4, media=[(0, 512, 2)], first_token_id=10_000)  # a group at token 0

    def check(_: Scheduler, plan: SchedulerOutput, __: object) -> None:
        if any(w.blocks is not None for w in plan.encoder_work):
            assert video.status == RequestStatus.RUNNING

    traces = simulate(sched, clock, [chat, video], cost=SLOW_ENCODER, on_plan=check)
    assert traces["video"].finish_reason == "length"  # admitted (with its first group) and served
    assert sched.stats().num_encoder_slices > 0  # its second group went in slices


def test_slo_with_nothing_decoding_plans_a_step_with_no_time_limit() -> None:
    """No decodes: no time limit, so the forced piece's time left is unbounded (it was inf - inf)."""
    sched = make_scheduler("slo", VirtualClock(), encoder_depth=DEPTH)
    sched.add_request(request("a", 0.0, 300, 4, media=[(10, 256, 1)]))
    sched.add_request(request("b", 0.0, 300, 4, "batch", media=[(0, 256, 1)], first_token_id=10_000))
    plan = sched.schedule()
    assert plan.scheduled and all(w.blocks is None for w in plan.encoder_work)


def test_a_partial_group_orphaned_while_a_plan_is_made_is_dropped_by_the_plan_after() -> None:
    """The plan being made may run a slice of it (planned before its request was preempted), so the runner
    must keep the state through that plan; another request that advances it in time keeps it alive."""
    cache = EncoderCacheManager(4096)
    key = ("v", 0)
    cache.begin_plan()
    cache.advance("a", key, 3)
    cache.release_all("a")  # preempted later in the same plan
    assert cache.take_evicted() == [] and not cache.is_partial(key) and cache.has_pending_evictions()
    cache.begin_plan()
    assert cache.take_evicted() == [key] and not cache.has_pending_evictions()
    cache.begin_plan()
    cache.advance("a", key, 2)
    cache.release_all("a")
    cache.begin_plan()
    cache.advance("b", key, 1)  # started again by another request: the runner restarts it from block 0
    assert cache.take_evicted() == [] and cache.blocks_done(key) == 1
    cache.add("b", key, 256)  # its last slice: an entry, no longer partial
    assert not cache.is_partial(key) and cache.num_partial == 0


# -- a real engine -----------------------------------------------------------------------------------------
ASSETS = Path(__file__).resolve().parent.parent / "assets"


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_an_engine_encoding_in_slices_answers_as_one_encoding_whole(
    arch: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    """A text request streams while a photo and a clip arrive; with a step target far below one group's
    encode, the groups are encoded a block at a time: the same greedy tokens, nothing left behind (Qwen2.5-VL's
    window order and Qwen3-VL's DeepStack levels carried across steps)."""
    from mmserve import LLM, SamplingParams

    model = tiny_model_dir(arch)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(ASSETS / "sample.jpg")}},
        {"type": "text", "text": "and this clip"},
        {"type": "video_url", "video_url": {"url": str(ASSETS / "sample_clip.mp4")}},
    ]}]  # fmt: skip
    # Long enough that the text request still decodes (so steps have a time limit) when the clip is reached.
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    answers = []
    for max_step_ms in (0.0, 0.01):
        llm = LLM(model, max_num_batched_tokens=64, max_step_ms=max_step_ms)
        prompts = ["a text prompt that decodes beside the media", llm.processor.chat_prompt(messages)]
        outputs = llm.generate(prompts, params)
        stats = llm.stats()
        answers.append([o.token_ids for o in outputs])
        assert stats.num_partial_encodes == 0 and stats.num_referenced_encoder_tokens == 0
        assert not any(llm.engine.leak_report().values()), llm.engine.leak_report()
        if max_step_ms:
            assert stats.num_encoder_slices >= 2  # a 2-block tower: a group went a block at a time
        else:
            assert stats.num_encoder_slices == 0
    assert answers[0] == answers[1]
