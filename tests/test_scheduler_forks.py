"""n > 1 and held requests in the scheduler: forks wait for their parent's prefill and then share its
prompt blocks; a held request (its grammar compiling) is passed over without blocking the others."""

from __future__ import annotations

import pytest

from mmserve.request import Request, RequestStatus, SamplingParams
from tests.test_scheduler import Mirror, fake_run, grants, make_request, make_scheduler, run_to_completion


def forked(rid: str, n: int, num_prompt: int, max_tokens: int = 3, **kw: object) -> list[Request]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, n=n, **kw)
    return Request(rid, list(range(100, 100 + num_prompt)), params).forks()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forks_share_the_prompt_blocks_once_the_prefill_is_done(prefix_caching: bool) -> None:
    sched = make_scheduler(budget=64, block_size=4, prefix_caching=prefix_caching)
    mirror = Mirror(sched)
    parent, *children = forked("a", 3, num_prompt=10)  # 2 full blocks shared, the third recomputed
    for r in (parent, *children):
        sched.add_request(r)
    plan = sched.schedule()
    assert grants(plan) == {"a": 10}  # the forks wait for the parent's prefill
    mirror.apply(plan)
    sched.update(plan, fake_run(plan))
    parent_blocks = sched.kv.block_ids("a")
    plan = sched.schedule()
    # The parent decodes; each fork computes only its prompt's last partial block (10 - 8 tokens).
    assert grants(plan) == {"a": 1, "a-n1": 2, "a-n2": 2}
    views = mirror.apply(plan)
    for child in ("a-n1", "a-n2"):
        assert views[child].start == 8
        assert sched.kv.block_ids(child)[:2] == parent_blocks[:2]
        assert sched.kv.block_ids(child)[2] not in parent_blocks  # written by the fork alone
    assert sched.stats().prefix_cache_hits == 16  # 8 prompt tokens per fork were never recomputed
    sched.update(plan, fake_run(plan))
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_forks_of_a_parent_that_ends_before_its_prefill_compute_their_own_prompt() -> None:
    sched = make_scheduler(budget=4, block_size=4)
    parent, child = forked("a", 2, num_prompt=10)
    sched.add_request(parent)
    sched.add_request(child)
    plan = sched.schedule()
    assert grants(plan) == {"a": 4}  # chunked: the prefill is not done
    sched.update(plan, fake_run(plan))
    sched.finish_request("a")
    plan = sched.schedule()
    # On its own now: the parent's one written full block is a prefix-cache hit, the rest is computed.
    assert grants(plan) == {"a-n1": 4} and plan.scheduled[0].num_computed_tokens == 4
    sched.update(plan, fake_run(plan))
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_an_aborted_fork_that_holds_shared_blocks_frees_only_its_references() -> None:
    sched = make_scheduler(budget=10, max_seqs=1, block_size=4)  # one running: the fork waits, holding blocks
    parent, child = forked("a", 2, num_prompt=10, max_tokens=5)
    sched.add_request(parent)
    sched.add_request(child)
    plan = sched.schedule()
    sched.update(plan, fake_run(plan))
    assert sched.kv.block_ids("a-n1") == sched.kv.block_ids("a")[:2]
    assert sched.requests["a-n1"].status == RequestStatus.WAITING
    sched.finish_request("a-n1")
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_held_request_is_passed_over_until_released() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("held", 5))
    sched.hold("held")
    sched.add_request(make_request("free", 5, first=50))
    plan = sched.schedule()
    assert grants(plan) == {"free": 5}  # behind it in FCFS order, but not blocked by it
    sched.update(plan, fake_run(plan))
    sched.release("held")
    plan = sched.schedule()
    assert "held" in grants(plan)
    sched.update(plan, fake_run(plan))
    run_to_completion(sched)
    assert not sched.requests


def test_the_slo_policy_passes_over_held_requests_too() -> None:
    sched = make_scheduler(policy="slo")
    sched.add_request(make_request("held", 5))
    sched.hold("held")
    sched.add_request(make_request("free", 5, first=50))
    plan = sched.schedule()
    assert grants(plan) == {"free": 5}
    sched.update(plan, fake_run(plan))
    sched.finish_request("held")
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
