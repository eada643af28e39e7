"""The scheduler half of disaggregation on hand-built runner outputs (no model, no NIXL): a decode instance's
remote prefill waits for its read and then computes only the last prompt token; prefix hits shrink the read;
aborts during a read keep the blocks until it ends; failed reads fail or recompute per policy; a prefill
instance holds a finished request's blocks under a lease until a decode instance reads them or it expires."""

from __future__ import annotations

import dataclasses

import pytest

from mmserve.config import CacheConfig, KVTransferConfig, SchedulerConfig
from mmserve.errors import InvalidRequestError
from mmserve.request import KVTransferParams, Request, RequestStatus, SamplingParams
from mmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from mmserve.scheduler.scheduler import Scheduler

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(role: str = "kv_both", policy: str = "fail", lease_s: float = 30.0, clock: Clock | None = None,
         num_blocks: int = 32) -> Scheduler:  # fmt: skip
    config = KVTransferConfig(kv_role=role, kv_load_failure_policy=policy, engine_id="engine-P",
                              kv_connector_extra_config={"side_channel_host": "10.0.0.1", "side_channel_port": 5601,
                                                         "kv_lease_duration": lease_s})  # fmt: skip
    return Scheduler(SchedulerConfig(64, 8, 256, "fcfs", max_step_ms=None), CacheConfig(BLOCK, num_blocks, True),
                     clock=clock or Clock(), kv_transfer=(config, "engine-D"))  # fmt: skip


def remote(num_tokens: int, first_block: int = 10) -> KVTransferParams:
    num_blocks = -(-num_tokens // BLOCK)
    return KVTransferParams(do_remote_prefill=True, remote_engine_id="engine-P", remote_host="10.0.0.1",
                            remote_port=5601, remote_request_id="p-1",
                            remote_block_ids=tuple(range(first_block, first_block + num_blocks)))  # fmt: skip


def request(rid: str, n: int, kv: KVTransferParams | None = None, max_tokens: int = 3, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                         kv_transfer=kv))  # fmt: skip


def run(plan: SchedulerOutput, token: int = 7, **kv: tuple[str, ...]) -> ModelRunnerOutput:
    sampled = [s.request_id for s in plan.scheduled if s.sample]
    return ModelRunnerOutput(tuple(sampled), (token,) * len(sampled), (None,) * len(sampled), **kv)


def test_a_remote_prefill_reads_then_computes_only_the_last_prompt_token() -> None:
    sched = make()
    sched.add_request(request("d", 10, remote(10)))
    plan = sched.schedule()
    assert not plan.scheduled and len(plan.kv_loads) == 1 and plan.has_work
    load = plan.kv_loads[0]
    assert load.remote_block_ids == (10, 11, 12) and len(load.local_block_ids) == 3
    assert load.local_block_ids == tuple(sched.kv.block_ids("d"))
    assert (load.remote_host, load.remote_port, load.remote_request_id) == ("10.0.0.1", 5601, "p-1")
    assert sched.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert sched.stats().num_waiting == 1 and sched.stats().num_loading_remote_kv == 1
    # Nothing is published while the read is in flight: another request cannot hit unwritten blocks.
    assert not sched.kv.cached_block_hashes()
    # Steps go on (reporting) until the read ends.
    outputs = sched.update(plan, run(plan))
    assert not outputs and sched.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    plan = sched.schedule()
    assert plan.kv_transfers_pending and not plan.kv_loads and not plan.scheduled
    sched.update(plan, run(plan, kv_loads_done=("d",), kv_blocks_read=3, kv_read_s=0.003))
    assert sched.stats().num_kv_loads_done == 1 and sched.stats().num_kv_blocks_read == 3
    assert len(sched.kv.cached_block_hashes()) == 2  # the full blocks below the last prompt token
    plan = sched.schedule()
    [s] = plan.scheduled
    assert (s.num_computed_tokens, s.num_scheduled_tokens, s.sample) == (9, 1, True)
    assert plan.new_requests[0].request_id == "d"
    outputs = sched.update(plan, run(plan))
    assert outputs[0].new_token_ids == (7,) and not sched.has_pending_kv_transfers()


def test_a_local_prefix_hit_is_not_read_again() -> None:
    sched = make()
    sched.add_request(request("local", 12, max_tokens=1))
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        sched.update(plan, run(plan))
    sched.add_request(request("d", 14, remote(14)))
    plan = sched.schedule()
    [load] = plan.kv_loads
    # 12 cached tokens = 3 full blocks: only the last 1 of 4 remote blocks is read, into a new local block.
    assert load.remote_block_ids == (13,) and len(load.local_block_ids) == 1
    assert tuple(sched.kv.block_ids("d"))[3:] == load.local_block_ids
    assert sched.requests["d"].num_cached_tokens == 12


def test_abort_during_the_read_keeps_the_blocks_until_it_ends() -> None:
    sched = make()
    sched.add_request(request("d", 10, remote(10)))
    plan = sched.schedule()
    free_during = sched.kv.num_free_blocks
    assert sched.finish_request("d")
    assert sched.kv.num_free_blocks == free_during  # the read may still write into them
    assert sched.has_pending_kv_transfers()
    plan = sched.schedule()
    sched.update(plan, run(plan, kv_loads_done=("d",)))
    assert sched.kv.num_free_blocks == 32 and not sched.has_pending_kv_transfers()


def test_a_failed_read_fails_the_request_under_policy_fail() -> None:
    sched = make(policy="fail")
    sched.add_request(request("d", 10, remote(10)))
    plan = sched.schedule()
    outputs = sched.update(plan, run(plan, kv_loads_failed=("d",)))
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("d", "error")]
    assert "prefill instance" in (outputs[0].error or "")
    assert sched.kv.num_free_blocks == 32 and not sched.requests and sched.stats().num_kv_loads_failed == 1


def test_a_failed_read_is_prefilled_here_under_policy_recompute() -> None:
    sched = make(policy="recompute")
    sched.add_request(request("d", 10, remote(10)))
    plan = sched.schedule()
    assert not sched.update(plan, run(plan, kv_loads_failed=("d",)))
    plan = sched.schedule()
    assert not plan.kv_loads  # not read again
    [s] = plan.scheduled
    assert (s.num_computed_tokens, s.num_scheduled_tokens, s.sample) == (0, 10, True)


def test_a_preempted_request_recomputes_locally() -> None:
    sched = make()
    sched.add_request(request("d", 10, remote(10)))
    plan = sched.schedule()
    sched.update(plan, run(plan, kv_loads_done=("d",)))
    req = sched.requests["d"]
    req.num_preemptions = 1  # as after a preemption: the prefill instance has freed its blocks
    assert not sched.kv_transfer.wants_load(req)  # type: ignore[union-attr]


def test_the_prefill_side_holds_blocks_until_read() -> None:
    clock = Clock()
    sched = make(role="kv_producer", clock=clock)
    sched.add_request(request("p-1", 10, KVTransferParams(do_remote_decode=True), max_tokens=1))
    plan = sched.schedule()
    [out] = sched.update(plan, run(plan))
    params = out.kv_transfer_params
    assert out.finish_reason == "length" and params is not None
    assert params.do_remote_prefill and not params.do_remote_decode
    assert params.remote_engine_id == "engine-D" and params.remote_request_id == "p-1"
    assert (params.remote_host, params.remote_port, params.tp_size) == ("10.0.0.1", 5601, 1)
    assert len(params.remote_block_ids or ()) == 3
    assert params.to_json()["remote_block_ids"] == list(params.remote_block_ids or ())
    assert sched.kv.num_free_blocks == 32 - 3 and sched.stats().num_kv_leases == 1
    plan = sched.schedule()
    assert plan.kv_transfers_pending and plan.finished_request_ids == {"p-1"}
    sched.update(plan, run(plan, kv_sends_done=("p-1", "unknown")))
    assert sched.kv.num_free_blocks == 32 and not sched.has_pending_kv_transfers()


def test_an_unclaimed_lease_expires() -> None:
    clock = Clock()
    sched = make(role="kv_producer", clock=clock, lease_s=5.0)
    sched.add_request(request("p-1", 10, KVTransferParams(do_remote_decode=True), max_tokens=1))
    plan = sched.schedule()
    sched.update(plan, run(plan))
    clock.now += 4.9
    sched.update(sched.schedule(), ModelRunnerOutput((), (), ()))
    assert sched.stats().num_kv_leases == 1
    clock.now += 0.2
    sched.schedule()
    stats = sched.stats()
    assert (stats.num_kv_leases, stats.num_kv_leases_expired, stats.num_free_blocks) == (0, 1, 32)


def test_aborted_or_stopped_by_the_front_end_is_not_handed_over() -> None:
    sched = make(role="kv_producer")
    sched.add_request(request("p-1", 10, KVTransferParams(do_remote_decode=True), max_tokens=5))
    plan = sched.schedule()
    sched.update(plan, run(plan))
    sched.finish_request("p-1", RequestStatus.FINISHED_STOPPED)  # a stop string, found by the front end
    assert sched.kv.num_free_blocks == 32 and not sched.has_pending_kv_transfers()


@pytest.mark.parametrize(
    ("role", "kv", "needle"),
    [
        ("kv_consumer", KVTransferParams(do_remote_decode=True), "kv_role"),
        ("kv_producer", remote(10), "kv_role"),
        ("kv_both", remote(30), "remote_block_ids"),  # 8 blocks for a prompt of 10 tokens
    ],
)
def test_requests_that_cannot_apply_are_refused(role: str, kv: KVTransferParams, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        make(role=role).add_request(request("r", 10, kv))


def test_without_a_kv_transfer_config_the_fields_are_refused() -> None:
    sched = Scheduler(SchedulerConfig(64, 8, 256), CacheConfig(BLOCK, 32, True))
    with pytest.raises(InvalidRequestError, match="--kv-transfer-config"):
        sched.add_request(request("r", 10, KVTransferParams(do_remote_decode=True)))
    # What a router sends a prefill with every remote field null is no transfer at all: accepted anywhere.
    sched.add_request(request("ok", 10, KVTransferParams.parse({"do_remote_decode": False, "remote_host": None})))


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"do_remote_prefill": True}, "remote_engine_id"),
        ({"do_remote_decode": "yes"}, "do_remote_decode"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "not both"),
        ({**dataclasses.asdict(remote(8)), "remote_port": 70000}, "remote_port"),
        ({**dataclasses.asdict(remote(8)), "remote_block_ids": []}, "remote_block_ids"),
        ({"surprise": 1}, "unknown field"),
    ],
)
def test_kv_transfer_params_are_validated(fields: dict, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(kv_transfer=fields)


def test_kv_transfer_config_is_validated() -> None:
    with pytest.raises(InvalidRequestError, match="kv_connector"):
        KVTransferConfig(kv_connector="LMCacheConnector")
    with pytest.raises(InvalidRequestError, match="kv_role"):
        KVTransferConfig(kv_role="kv_prefill")
    with pytest.raises(InvalidRequestError, match="kv_load_failure_policy"):
        KVTransferConfig(kv_load_failure_policy="retry")
    with pytest.raises(InvalidRequestError, match="unknown field"):
        KVTransferConfig.from_json('{"kv_connector": "NixlConnector", "kv_ip": "1.2.3.4"}')
    with pytest.raises(InvalidRequestError, match="kv_lease_duration"):
        KVTransferConfig(kv_connector_extra_config={"kv_lease_duration": 0})
    with pytest.raises(InvalidRequestError, match="progress_thread"):
        KVTransferConfig(kv_connector_extra_config={"progress_thread": "yes"})
    config = KVTransferConfig.from_json('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert (config.kv_lease_duration, config.kv_load_timeout, config.backends) == (30.0, 30.0, ["UCX"])
    assert config.progress_thread is None  # where the KV pool is decides


def test_a_request_aborted_before_its_read_tells_the_prefill_instance() -> None:
    """vLLM's empty read: the prefill instance frees its blocks now instead of when the lease ends."""
    sched = make()
    sched.add_request(request("d", 10, remote(10)))
    assert sched.finish_request("d")  # still waiting: no read began, no block held
    plan = sched.schedule()
    [load] = plan.kv_loads
    assert (load.local_block_ids, load.remote_block_ids, load.remote_request_id) == ((), (), "p-1")
    assert sched.has_pending_kv_transfers()
    sched.update(plan, run(plan, kv_loads_done=("d",)))
    assert not sched.has_pending_kv_transfers() and sched.kv.num_free_blocks == 32
    # A read that failed is not followed by such a notice (policy fail).
    sched.add_request(request("f", 10, remote(10)))
    plan = sched.schedule()
    sched.update(plan, run(plan, kv_loads_failed=("f",)))
    assert not sched.schedule().kv_loads and not sched.has_pending_kv_transfers()
