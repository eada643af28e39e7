"""The worker half of disaggregation over real NIXL (UCX on loopback): reads land the
remote blocks' bytes in the chosen local blocks and notify the owner; handshakes that disagree on the KV layout
are refused; an unreachable or killed prefill instance fails the read (after the timeout); and vLLM's handshake
wire format (msgpack [b"get_meta_msg", rank] -> a map payload) is what the side channel speaks."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import torch

from mmserve.bench.servers import free_port
from mmserve.config import KVTransferConfig
from mmserve.engine.nixl_connector import (
    GET_META_MSG,
    NixlAgentMetadata,
    NixlHandshakePayload,
    NixlKVWorker,
    fetch_handshake,
)
from mmserve.scheduler.output import KVLoad

pytest.importorskip("nixl")

NUM_LAYERS, NUM_BLOCKS, BLOCK, HEADS, DIM = 2, 8, 4, 2, 8


def pool(seed: int, block_size: int = BLOCK) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, block_size, HEADS, DIM, generator=g) for _ in range(NUM_LAYERS)]


def worker(name: str, caches: list[torch.Tensor], block_size: int = BLOCK, timeout_s: float = 5.0,
           **extra: object) -> NixlKVWorker:  # fmt: skip
    config = KVTransferConfig(kv_connector_extra_config={"side_channel_host": "127.0.0.1",
                                                         "side_channel_port": free_port(),
                                                         "kv_load_timeout": timeout_s, **extra})  # fmt: skip
    return NixlKVWorker(caches, block_size, name, config)


# UCX's own choice (shared memory and TCP on one machine) and TCP alone (what crosses machines). Shared memory
# alone ("sm,self") cannot serve: NIXL's endpoints ask for peer-failure handling, which sm transports lack.
@pytest.fixture(params=["all", "tcp,self"])
def ucx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("UCX_TLS", request.param)
    yield request.param


def load(prefill: NixlKVWorker, local: tuple[int, ...], far: tuple[int, ...], rid: str = "d-1") -> KVLoad:
    port = prefill.side_channel_port
    return KVLoad(rid, prefill.engine_id, "127.0.0.1", port, f"p-{rid}", 1, local, far)


def until(decode: NixlKVWorker, prefill: NixlKVWorker, loads: tuple[KVLoad, ...], timeout_s: float = 20.0):
    """Step both sides until the decode side's reads end: (done, failed, what the prefill side heard)."""
    done, failed, sent, blocks = [], [], [], 0
    deadline = time.monotonic() + timeout_s
    pending = {lo.request_id for lo in loads}
    report = decode.step(loads)
    while True:
        done += report.done
        failed += report.failed
        blocks += report.blocks_read
        sent += prefill.step(()).sent
        if (pending <= set(done) | set(failed) and len(sent) >= len(done)) or time.monotonic() > deadline:
            return done, failed, sent, blocks
        time.sleep(0.01)
        report = decode.step(())


def test_a_read_copies_exactly_the_chosen_blocks_and_notifies(ucx: str) -> None:
    p_caches, d_caches = pool(1), pool(2)
    before = [c.clone() for c in d_caches]
    prefill, decode = worker("P", p_caches), worker("D", d_caches)
    try:
        done, failed, sent, blocks = until(decode, prefill, (load(prefill, (6, 2), (3, 5)),))
        assert (done, failed, sent, blocks) == (["d-1"], [], ["p-d-1"], 2)
        for layer in range(NUM_LAYERS):
            for kv in (0, 1):
                assert torch.equal(d_caches[layer][kv, 6], p_caches[layer][kv, 3])
                assert torch.equal(d_caches[layer][kv, 2], p_caches[layer][kv, 5])
                untouched = [b for b in range(NUM_BLOCKS) if b not in (6, 2)]
                assert torch.equal(d_caches[layer][kv, untouched], before[layer][kv, untouched])
    finally:
        decode.close()
        prefill.close()


def test_a_prefill_instance_busy_in_a_long_step_still_serves_the_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TCP each end must progress for a READ to move. The prefill side steps once (its scheduler says a
    lease is open) and then not again, as in a long forward: its progress thread serves the read, and the
    notification it heard meanwhile is reported by its next step."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    p_caches, d_caches = pool(1), pool(2)
    prefill, decode = worker("P", p_caches), worker("D", d_caches)
    try:
        prefill.step((), transfers_pending=True)
        report = decode.step((load(prefill, (0, 1, 2), (7, 6, 5)),))
        deadline = time.monotonic() + 20
        while not (report.done or report.failed) and time.monotonic() < deadline:
            time.sleep(0.01)
            report = decode.step(())
        assert report.done == ("d-1",)
        assert torch.equal(d_caches[1][1, :3], p_caches[1][1, [7, 6, 5]])
        assert prefill.step((), transfers_pending=False).sent == ("p-d-1",)
    finally:
        decode.close()
        prefill.close()


def test_a_handshake_with_another_block_size_is_refused() -> None:
    prefill, decode = worker("P", pool(1, block_size=8), block_size=8), worker("D", pool(2))
    try:
        done, failed, sent, _ = until(decode, prefill, (load(prefill, (1,), (1,)),))
        assert (done, failed, sent) == ([], ["d-1"], [])
    finally:
        decode.close()
        prefill.close()


def test_an_unreachable_prefill_instance_fails_the_read_after_the_timeout() -> None:
    decode = worker("D", pool(2), timeout_s=1.0)
    try:
        dead = KVLoad("d-1", "gone", "127.0.0.1", free_port(), "p-1", 1, (1,), (1,))
        start = time.monotonic()
        report = decode.step((dead,))
        while not report.failed and time.monotonic() - start < 15:
            time.sleep(0.05)
            report = decode.step(())
        assert report.failed == ("d-1",) and time.monotonic() - start >= 0.9
        assert decode.num_reads() == 0
    finally:
        decode.close()


def test_the_side_channel_speaks_vllms_handshake() -> None:
    prefill = worker("P", pool(1))
    try:
        payload = msgspec.msgpack.decode(fetch_handshake("127.0.0.1", prefill.side_channel_port, 5.0))
        assert set(payload) == {"compatibility_hash", "agent_metadata_bytes"}  # a map, as vLLM's dataclass
        typed = msgspec.msgpack.decode(msgspec.msgpack.encode(payload), type=NixlHandshakePayload)
        meta = msgspec.msgpack.decode(typed.agent_metadata_bytes, type=NixlAgentMetadata)
        assert meta.engine_id == "P" and meta.num_blocks == NUM_BLOCKS and meta.block_size == BLOCK
        assert len(meta.kv_caches_base_addr) == 2 * NUM_LAYERS and meta.kv_cache_layout == "NHD"
        assert meta.block_lens == [BLOCK * HEADS * DIM * 4] * (2 * NUM_LAYERS)
        assert GET_META_MSG == b"get_meta_msg"
    finally:
        prefill.close()


def test_an_empty_read_only_notifies() -> None:
    """A decode request that ended before its read began: the prefill instance hears of it and frees."""
    prefill, decode = worker("P", pool(1)), worker("D", pool(2))
    try:
        done, failed, sent, blocks = until(decode, prefill, (load(prefill, (), ()),))
        assert (done, failed, sent, blocks) == (["d-1"], [], ["p-d-1"], 0)
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("progress_thread", [None, True])
def test_a_cpu_pool_has_no_progress_thread_polling_by_default(
    progress_thread: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UCX's progress thread polls without pause: beside an engine on the same cores it takes one of them, also
    while nothing moves. A CPU pool's transfers advance in the engine's steps instead (the reads above), unless
    the config asks for the thread. Measured as this process's CPU time while it sleeps."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    extra = {} if progress_thread is None else {"progress_thread": progress_thread}
    caches = pool(1)  # registered with NIXL: alive as long as the worker
    idle = worker("P", caches, **extra)
    try:
        time.sleep(0.2)  # the agent's threads settle
        cpu = time.process_time()
        time.sleep(1.0)
        busy = time.process_time() - cpu
        assert (busy > 0.5) == bool(progress_thread), f"{busy:.2f} s of CPU in 1 s asleep"
    finally:
        idle.close()
