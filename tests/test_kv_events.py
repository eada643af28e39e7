"""KV cache events as the manager records them: a subscriber that applies them in order holds exactly the
manager's cached hashes, and every `BlockStored` rebuilds its hashes from its tokens and media keys. Torch-free."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.request import MultiModalInput, PlaceholderRange, Request, SamplingParams
from mmserve.scheduler.kv_cache_manager import KVCacheManager, hash_block
from mmserve.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


def apply(held: set[bytes], events: list[KVCacheEvent]) -> None:
    """A router's view of one replica."""
    for event in events:
        if isinstance(event, BlockStored):
            assert not held & set(event.block_hashes), "a hash announced twice"
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= held, "a hash removed that was never stored"
            held.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            held.clear()


def check_chain(event: BlockStored) -> None:
    bs = event.block_size
    parent = event.parent_block_hash or b""
    assert len(event.token_ids) == bs * len(event.block_hashes) == bs * len(event.extra_keys)
    for i, block_hash in enumerate(event.block_hashes):
        tokens = list(event.token_ids[i * bs : (i + 1) * bs])
        assert hash_block(parent, tokens, event.extra_keys[i] or ()) == block_hash
        parent = block_hash


def admit(kv: KVCacheManager, r: Request) -> bool:
    hits, num_cached = kv.get_computed_blocks(r)
    kv.record_prefix_lookup(r.num_tokens, num_cached)
    if kv.allocate_slots(r, r.num_tokens - num_cached, hits) is None:
        return False
    r.num_computed_tokens = r.num_tokens
    return True


def test_events_off_by_default_record_nothing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert admit(kv, Request("a", list(range(12)), SamplingParams()))
    assert kv.take_events() == [] and kv.snapshot_events() == [] and kv.cached_block_hashes()


def test_a_snapshot_gathers_each_chain_into_one_event_after_its_parent() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_kv_events=True)
    a = Request("a", list(range(13)), SamplingParams())  # blocks 0-2 of the shared chain
    b = Request("b", [*range(8), 90, 91, 92, 93, 94], SamplingParams())  # shares blocks 0-1, then its own
    assert admit(kv, a) and admit(kv, b)
    kv.take_events()
    cleared, *stored = kv.snapshot_events()
    assert cleared == AllBlocksCleared()
    assert [e.block_hashes for e in stored] == [tuple(a.block_hashes[:3]), (b.block_hashes[2],)]
    assert stored[1].parent_block_hash == a.block_hashes[1] and stored[1].token_ids == (90, 91, 92, 93)


def test_stored_removed_and_cleared_in_order() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_kv_events=True)
    a = Request("a", list(range(9)), SamplingParams())
    assert admit(kv, a)
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert stored.block_hashes == tuple(a.block_hashes[:2]) and stored.token_ids == tuple(range(8))
    check_chain(stored)
    kv.free(a)
    assert kv.take_events() == []  # freed blocks stay cached: nothing leaves
    b = Request("b", [100 + t for t in range(16)], SamplingParams())  # needs every block: evicts a's
    assert admit(kv, b)
    events = kv.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(a.block_hashes[:2])
    kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_media_keys_travel_with_the_blocks_they_overlap() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_kv_events=True)
    image = MultiModalInput("img-1", PlaceholderRange(offset=2, length=5), "image")
    r = Request("a", list(range(13)), SamplingParams(), mm_inputs=[image])
    assert admit(kv, r)
    (stored,) = kv.take_events()
    assert stored.extra_keys == (("img-1",), ("img-1",), None)
    check_chain(stored)


def test_a_continuation_names_its_parent() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_kv_events=True)
    r = Request("a", list(range(6)), SamplingParams())
    assert admit(kv, r)
    first = kv.take_events()
    r.append_output_token(50)
    r.append_output_token(51)
    assert kv.allocate_slots(r, 2) is not None
    r.num_computed_tokens = r.num_tokens
    (second,) = kv.take_events()
    assert first[0].block_hashes == (r.block_hashes[0],)
    assert second.parent_block_hash == r.block_hashes[0] and second.token_ids == (4, 5, 50, 51)
    check_chain(second)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_a_subscriber_replaying_the_events_holds_what_the_manager_holds(seed: int) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_kv_events=True)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
    live: list[Request] = []
    held: set[bytes] = set()
    for n in range(40):
        op = rng.random()
        if op < 0.5:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            media = []
            if rng.random() < 0.3 and len(tokens) > 3:
                media = [MultiModalInput(f"m{rng.randrange(2)}", PlaceholderRange(1, len(tokens) - 2), "image")]
            r = Request(f"r{n}", tokens, SamplingParams(), mm_inputs=media)
            if admit(kv, r):
                live.append(r)
        elif op < 0.8 and live:
            kv.free(live.pop(rng.randrange(len(live))))
        elif op < 0.88 and live:
            r = rng.choice(live)
            r.append_output_token(rng.randrange(50))
            if kv.allocate_slots(r, 1) is not None:
                r.num_computed_tokens = r.num_tokens
        elif op < 0.93:
            # A chunked prefill granted and freed before it ran (a preempted victim, an abort): the blocks
            # it published were never written and leave the cache again.
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(4, 16))]
            r = Request(f"g{n}", tokens, SamplingParams())
            hits, num_cached = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - num_cached, hits) is not None:
                r.num_computed_tokens = num_cached
                kv.free(r)
        elif op < 0.97 and live:
            parent = rng.choice(live)  # a sibling sequence sharing the parent's written prompt blocks
            child = Request(f"f{n}", list(parent.prompt_token_ids), SamplingParams())
            if kv.fork(parent, child):
                if kv.allocate_slots(child, child.num_tokens - child.num_computed_tokens) is None:
                    kv.free(child)
                else:
                    child.num_computed_tokens = child.num_tokens
                    live.append(child)
        else:
            kv.reset_prefix_cache()
        events = kv.take_events()
        for event in events:
            if isinstance(event, BlockStored):
                check_chain(event)
        apply(held, events)
        assert held == kv.cached_block_hashes()
        if n % 5 == 4:  # a subscriber joining now, from the snapshot alone
            joined: set[bytes] = {b"stale"}
            snapshot = kv.snapshot_events()
            assert isinstance(snapshot[0], AllBlocksCleared)
            for event in snapshot:
                if isinstance(event, BlockStored):
                    check_chain(event)
                    parent = event.parent_block_hash
                    # parents first; a chain whose parent left the cache is announced with that parent
                    assert parent is None or parent in joined or parent not in kv.cached_block_hashes()
                apply(joined, [event])
            assert joined == kv.cached_block_hashes()


# -- on the wire (vLLM's format), read back by a plain ZeroMQ subscriber ---------------------------------------


def _free_tcp() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _recv(sub, timeout_ms: int = 5000) -> list[bytes]:
    assert sub.poll(timeout_ms), "no KV event batch arrived"
    return sub.recv_multipart()


def test_the_publisher_speaks_vllms_wire_format_and_replays() -> None:
    import zmq
    from msgspec.msgpack import decode as unpack  # untyped: what a subscriber in another language sees

    from mmserve.config import KVEventsConfig
    from mmserve.engine.kv_event_publisher import KVEventPublisher

    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=_free_tcp(), replay_endpoint=_free_tcp(),
                            topic="kv")  # fmt: skip
    publisher = KVEventPublisher(config)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sockets = [sub]
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(config.endpoint)
    try:
        kv = KVCacheManager(num_blocks=4, block_size=4, enable_kv_events=True)
        image = MultiModalInput("img-1", PlaceholderRange(offset=0, length=3), "image")
        r = Request("a", list(range(9)), SamplingParams(), mm_inputs=[image])
        assert admit(kv, r)
        first = kv.take_events()
        deadline = time.monotonic() + 10
        while not publisher.take_snapshot_request():  # the XPUB socket heard the subscription
            assert time.monotonic() < deadline, "a subscription did not ask for a snapshot"
            time.sleep(0.01)
        assert not publisher.take_snapshot_request()  # once per subscription
        # A PUB socket drops what is sent before the subscription reaches it: publish until one arrives.
        deadline_polls = 50
        while not sub.poll(100):
            publisher.publish(first)
            deadline_polls -= 1
            assert deadline_polls, "the subscriber never received a batch"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        ts, events, *rank = unpack(payload)
        assert isinstance(ts, float) and rank in ([], [None])
        (stored,) = events
        assert stored["type"] == "BlockStored" and stored["block_hashes"] == list(r.block_hashes[:2])
        assert stored["parent_block_hash"] is None and stored["token_ids"] == list(range(8))
        assert stored["block_size"] == 4 and stored["medium"] == "GPU"
        assert stored["extra_keys"] == [["img-1"], None]
        for field in ("lora_id", "lora_name", "group_idx"):  # present, as vllm-router requires
            assert field in stored and stored[field] is None
        kv.reset_prefix_cache()
        publisher.publish(kv.take_events())
        topic, seq2, payload = _recv(sub)
        assert int.from_bytes(seq2, "big") == int.from_bytes(seq, "big") + 1
        assert unpack(payload)[1] == [{"type": "AllBlocksCleared"}]

        dealer = context.socket(zmq.DEALER)
        sockets.append(dealer)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(config.replay_endpoint)
        dealer.send_multipart([b"", seq2])  # from the last batch on
        frames = []
        while True:
            assert dealer.poll(5000), "the replay did not end"
            frames.append(dealer.recv_multipart())
            if frames[-1][1] == (-1).to_bytes(8, "big", signed=True):
                break
        assert [f[1] for f in frames[:-1]] == [seq2] and frames[0][2] == payload and frames[-1][2] == b""
    finally:
        context.destroy(linger=0)  # every socket, even one a failed assertion left open
        publisher.close()


def test_kv_events_config_is_vllms_json_and_refuses_what_it_cannot_honour() -> None:
    from mmserve.config import EngineArgs, KVEventsConfig
    from mmserve.errors import InvalidRequestError

    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "t"}')
    assert config.enabled and config.endpoint == "tcp://*:5557" and config.buffer_steps == 10_000
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for text, word in (('{"enable_kv_cache_events": true, "bogus": 1}', "bogus"), ("[1]", "object"),
                       ('{"publisher": "kafka"}', "publisher"), ('{"endpoint": "5557"}', "endpoint")):  # fmt: skip
        with pytest.raises(InvalidRequestError, match=word):
            KVEventsConfig.from_json(text)
    with pytest.raises(InvalidRequestError, match="prefix caching"):
        EngineArgs("m", enable_prefix_caching=False, kv_events_config=config)


def test_serve_refuses_a_bad_kv_events_config_in_one_line(
    tiny_model_dir: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from mmserve.cli import main

    model = str(tiny_model_dir("qwen2"))
    assert main(["serve", "--model", model, "--kv-events-config", '{"enable_kv_cache_events": true, "hwm": 0}']) == 2
    assert "kv_events_config.hwm" in capsys.readouterr().err
    assert main(["serve", "--model", model, "--no-prefix-caching", "--kv-events-config",
                 '{"enable_kv_cache_events": true}']) == 2  # fmt: skip
    assert "prefix caching" in capsys.readouterr().err
