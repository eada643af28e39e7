"""Encoder disaggregation without servers: the scheduler plans stored groups as loads (no encoder budget, still
cache room) and an encoder instance's steps encode media and end requests with no tokens; the shared store
writes whole files, refuses keys that are not hashes, keeps under its byte cap and reports what it cannot load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmserve.config import CacheConfig, ECTransferConfig, SchedulerConfig
from mmserve.engine.ec_connector import SharedEncoderStore
from mmserve.errors import InvalidRequestError
from mmserve.request import MultiModalInput, PlaceholderRange, Request, SamplingParams
from mmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from mmserve.scheduler.scheduler import Scheduler

H1, H2 = "a" * 64, "b" * 64


def scheduler(stored: set[tuple[str, int]], encode_only: bool = False, encoder_budget: int = 64) -> Scheduler:
    config = SchedulerConfig(256, 8, 1024, max_num_encoder_tokens=encoder_budget, max_step_ms=None)
    return Scheduler(config, CacheConfig(4, 128, True), encoder_outputs=stored.__contains__, encode_only=encode_only)


def video_request(rid: str, mm_hash: str = H1, groups: int = 3, tokens_per_group: int = 16) -> Request:
    length = groups * tokens_per_group
    mm = MultiModalInput(mm_hash, PlaceholderRange(4, length), "video", groups)
    return Request(rid, list(range(length + 10)), SamplingParams(max_tokens=2, temperature=0), mm_inputs=[mm])


def empty(plan: SchedulerOutput) -> ModelRunnerOutput:
    sampled = [s.request_id for s in plan.scheduled if s.sample]
    return ModelRunnerOutput(tuple(sampled), (5,) * len(sampled), (None,) * len(sampled))


def test_stored_groups_are_loaded_not_encoded() -> None:
    sched = scheduler({(H1, 0), (H1, 2)}, encoder_budget=16)  # the budget fits one group encoded per step
    sched.add_request(video_request("r"))
    plan = sched.schedule()
    # Groups 0 and 2 are loads (no budget), group 1 is encoded: all three in one step.
    assert [(w.group, w.load) for w in plan.encoder_work] == [(0, True), (1, False), (2, True)]
    assert plan.num_encoder_tokens == 16
    sched.update(plan, empty(plan))
    stats = sched.stats()
    assert (stats.num_encoder_tokens_computed, stats.num_encoder_tokens_loaded) == (16, 32)


def test_an_encoder_instance_encodes_and_ends_requests_without_tokens() -> None:
    sched = scheduler({(H2, 0)}, encode_only=True, encoder_budget=32)
    sched.add_request(video_request("v"))  # 3 groups of 16: two steps at 32 a step
    sched.add_request(video_request("stored", H2, groups=1))  # stored already: nothing to do
    plan = sched.schedule()
    assert not plan.scheduled and [(w.mm_input.mm_hash, w.group) for w in plan.encoder_work] == [(H1, 0), (H1, 1)]
    assert not sched.update(plan, empty(plan))
    plan = sched.schedule()
    assert [w.group for w in plan.encoder_work] == [2]
    outputs = sched.update(plan, empty(plan))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("v", (), "length"), ("stored", (), "length")]  # fmt: skip
    assert not sched.requests and sched.kv.num_free_blocks == 128
    assert sched.stats().num_referenced_encoder_tokens == 0


def test_the_store(tmp_path: Path) -> None:
    store = SharedEncoderStore(tmp_path, max_bytes=3 * 16 * 8 * 4 + 400)  # about three files
    embeds = [torch.full((16, 8), float(i)) for i in range(4)]
    for i, e in enumerate(embeds):
        store.save((H1, i), e)
    assert not store.contains((H1, 0)) and all(store.contains((H1, i)) for i in (1, 2, 3))  # the oldest went
    assert not list(tmp_path.glob(".*.tmp"))  # written whole, then renamed
    assert torch.equal(store.load((H1, 3), 16, torch.device("cpu"), torch.float32), embeds[3])
    assert store.load((H1, 3), 15, torch.device("cpu"), torch.float32) is None  # another item's shape
    assert store.load((H1, 0), 16, torch.device("cpu"), torch.float32) is None
    (tmp_path / f"{H2}-0.safetensors").write_bytes(b"not a tensor file")
    assert store.contains((H2, 0)) and store.load((H2, 0), 16, torch.device("cpu"), torch.float32) is None
    assert store.num_load_failures == 3
    assert not store.contains(("../../etc/passwd", 0)) and not store.contains(("ABC", 0))


def test_ec_transfer_config_is_validated() -> None:
    with pytest.raises(InvalidRequestError, match="ec_connector"):
        ECTransferConfig(ec_connector="SHMConnector", ec_connector_extra_config={"shared_storage_path": "/x"})
    with pytest.raises(InvalidRequestError, match="ec_role"):
        ECTransferConfig(ec_role="ec_both", ec_connector_extra_config={"shared_storage_path": "/x"})
    with pytest.raises(InvalidRequestError, match="shared_storage_path"):
        ECTransferConfig.from_json('{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer"}')
