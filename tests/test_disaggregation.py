"""Prefill/decode disaggregation end to end: a prefill and a decode `mmserve serve` (NIXL over UCX on loopback)
behind the real vllm-router in its PD mode. Greedy output equals a colocated instance's for text, image and video
prompts, streamed or not; a decode instance that already holds a prefix reads only the blocks it lacks; a lease
nobody claims ends; a prefill instance killed before the read fails the request or is recomputed, per policy."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mmserve.bench.router import SERVED_MODEL_NAME, PDRouterProcess, pd_instance
from mmserve.bench.servers import ServerProcess, free_port

ASSETS = Path(__file__).resolve().parent.parent / "assets"
MODEL = SERVED_MODEL_NAME
LEASE_S = 4.0
# Every transfer here goes over UCX's TCP transport (what crosses machines); tests/test_nixl_connector.py
# also reads over UCX's own choice of transports (shared memory on one machine).
UCX_TCP = {"UCX_TLS": "tcp,self"}

pytestmark = pytest.mark.timeout(600)


def start_instance(model: Path, role: str, wait: bool = True, extra_args: tuple[str, ...] = (),
                   **extra: Any) -> ServerProcess:  # fmt: skip
    args = ("--num-kv-blocks", "256", "--decode-workers", "1", *extra_args)
    return pd_instance(model, role, args, wait, UCX_TCP, **extra)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen2_vl")


def ec_transfer_config(role: str, path: Path) -> tuple[str, str]:
    config = {"ec_connector": "ECExampleConnector", "ec_role": role,
              "ec_connector_extra_config": {"shared_storage_path": str(path)}}  # fmt: skip
    return "--ec-transfer-config", json.dumps(config)


@pytest.fixture(scope="module")
def encoder_outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory an encoder instance stores its outputs in and the prefill instance loads them from."""
    return tmp_path_factory.mktemp("encoder-outputs")


@pytest.fixture(scope="module")
def pd(model: Path, encoder_outputs: Path) -> Iterator[tuple[ServerProcess, ServerProcess, PDRouterProcess]]:
    """The prefill instance also loads what an encoder instance stored (E/P/D when one is running)."""
    prefill = start_instance(model, "kv_producer", wait=False, extra_args=ec_transfer_config("ec_consumer",
                             encoder_outputs), kv_lease_duration=LEASE_S)  # fmt: skip
    try:
        decode = start_instance(model, "kv_consumer", wait=False)
        try:
            prefill.wait_until_up()
            decode.wait_until_up()
            router = PDRouterProcess([prefill.url], [decode.url])
            try:
                yield prefill, decode, router
            finally:
                router.close()
        finally:
            decode.close()
    finally:
        prefill.close()


def metric(url: str, name: str, **labels: str) -> float:
    """The value of `mmserve:<name>` (with these labels) in the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"mmserve:{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no mmserve:{name} {labels} in /metrics")


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def chat(content: Any, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}  # fmt: skip


def complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_text(url: str, body: dict[str, Any]) -> str:
    parts = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


def text_of(response: dict[str, Any]) -> str:
    return response["choices"][0]["message"]["content"]


LONG_TEXT = "Tell me a story about a lighthouse keeper who counts the waves every night. " * 6


def test_text_through_the_router_equals_a_colocated_instance(pd: tuple[ServerProcess, ServerProcess, PDRouterProcess]) -> None:
    prefill, decode, router = pd
    body = chat(LONG_TEXT)
    reference = complete(prefill.url, body)  # the prefill instance serving it alone (no kv_transfer_params)
    assert reference["kv_transfer_params"] is None
    loads_before = metric(decode.url, "kv_transfer_loads_total", outcome="done")
    routed = complete(router.url, body)
    assert text_of(routed) == text_of(reference)
    assert routed["usage"]["completion_tokens"] == 12
    assert metric(decode.url, "kv_transfer_loads_total", outcome="done") == loads_before + 1
    # The decode instance read the blocks and told the prefill instance, which freed them (no lease left).
    deadline = time.monotonic() + 10
    while metric(prefill.url, "kv_transfer_leases") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(prefill.url, "kv_transfer_leases") == 0


@pytest.mark.parametrize("media", ["image", "video"])
def test_media_streamed_through_the_router(pd: tuple[ServerProcess, ServerProcess, PDRouterProcess], media: str) -> None:
    prefill, decode, router = pd
    part = (
        {"type": "image_url", "image_url": {"url": data_url(ASSETS / "sample.jpg", "image/jpeg")}}
        if media == "image"
        else {"type": "video_url", "video_url": {"url": data_url(ASSETS / "sample_clip.mp4", "video/mp4")}}
    )
    body = chat([part, {"type": "text", "text": f"What is in this {media}?"}], max_tokens=10)
    reference = text_of(complete(prefill.url, body))
    encoder_before = metric(decode.url, "encoder_tokens_total")
    loads_before = metric(decode.url, "kv_transfer_loads_total", outcome="done")
    assert streamed_text(router.url, body) == reference
    assert metric(decode.url, "kv_transfer_loads_total", outcome="done") == loads_before + 1
    # The decode instance read the media's KV: its vision tower never ran.
    assert metric(decode.url, "encoder_tokens_total") == encoder_before


def test_a_decode_instance_reads_only_the_blocks_it_lacks(pd: tuple[ServerProcess, ServerProcess, PDRouterProcess]) -> None:
    prefill, decode, router = pd
    body = chat("A shared system prompt that many chats begin with, long enough for several blocks. " * 5)
    first = complete(router.url, body)
    hits_before = metric(decode.url, "prefix_cache_hits_total")
    second = complete(router.url, body)
    assert text_of(second) == text_of(first) == text_of(complete(prefill.url, body))
    # All of its full blocks but the last were already here: only the rest was read.
    assert metric(decode.url, "prefix_cache_hits_total") - hits_before >= 16 * 4


def test_an_unclaimed_lease_ends(pd: tuple[ServerProcess, ServerProcess, PDRouterProcess]) -> None:
    prefill, _, _ = pd
    expired_before = metric(prefill.url, "kv_transfer_leases_expired_total")
    usage_before = metric(prefill.url, "kv_cache_usage_perc")
    answer = complete(prefill.url, chat("Nobody will read this. " * 8, max_tokens=1,
                                        kv_transfer_params={"do_remote_decode": True}))  # fmt: skip
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert params["remote_host"] == "127.0.0.1" and params["tp_size"] == 1
    assert metric(prefill.url, "kv_transfer_leases") == 1
    assert metric(prefill.url, "kv_cache_usage_perc") > usage_before
    deadline = time.monotonic() + LEASE_S + 10
    while metric(prefill.url, "kv_transfer_leases") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(prefill.url, "kv_transfer_leases") == 0
    assert metric(prefill.url, "kv_transfer_leases_expired_total") == expired_before + 1
    assert metric(prefill.url, "kv_cache_usage_perc") == usage_before


def test_refusals_name_the_field(pd: tuple[ServerProcess, ServerProcess, PDRouterProcess]) -> None:
    prefill, decode, _ = pd

    def refused(url: str, body: dict[str, Any]) -> str:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        return response.json()["error"]["message"]

    assert "stream must be false" in refused(prefill.url, chat("hi", kv_transfer_params={"do_remote_decode": True},
                                                                  stream=True))  # fmt: skip
    assert "kv_role" in refused(decode.url, chat("hi", kv_transfer_params={"do_remote_decode": True}))
    remote = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [0], "remote_host": "127.0.0.1",
              "remote_port": 1, "remote_request_id": "r"}  # fmt: skip
    assert "kv_role" in refused(prefill.url, chat("hi", kv_transfer_params=remote))
    assert "remote_block_ids" in refused(decode.url, chat("hi " * 40, kv_transfer_params=remote))
    assert "unknown field" in refused(decode.url, chat("hi", kv_transfer_params={"do_remote_decode": True, "x": 1}))
    assert re.search("remote_port", refused(decode.url, chat("hi", kv_transfer_params={**remote, "remote_port": None})))


def run_core(core: Any, request: Any, timeout_s: float = 60.0) -> list[Any]:
    """Step an in-process engine core until `request` ends: its outputs."""
    core.add_request(request)
    outputs: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while not any(o.finished for o in outputs):
        assert time.monotonic() < deadline, "the request did not end"
        outputs += [o for o in core.step().outputs if o.request_id == request.request_id]
        time.sleep(0.002)
    while core.has_unfinished_requests() and time.monotonic() < deadline:  # the runner forgets it
        core.step()
    return outputs


def test_an_encoder_instance_feeds_the_prefill_instance(
    pd: tuple[ServerProcess, ServerProcess, PDRouterProcess], model: Path, encoder_outputs: Path
) -> None:
    """E/P/D: the encoder instance encodes the image and stores it; the prefill instance loads it instead of
    running its tower; the decode instance reads the KV. The answer is the colocated one."""
    prefill, decode, router = pd
    encoder = ServerProcess(model, served_model_name=MODEL, extra_args=(*ec_transfer_config("ec_producer",
                            encoder_outputs), "--num-kv-blocks", "8", "--decode-workers", "1"))  # fmt: skip
    try:
        image = {"type": "image_url", "image_url": {"url": data_url(ASSETS / "easy-vqa-test-2.png", "image/png")}}
        body = chat([image, {"type": "text", "text": "Which shape is this?"}], max_tokens=8)
        reference = text_of(complete(decode.url, body))  # the decode instance alone encodes it itself
        encoded = complete(encoder.url, {**body, "max_tokens": 1})  # what a proxy sends an encoder instance
        assert encoded["usage"]["completion_tokens"] == 0 and text_of(encoded) == ""
        assert metric(encoder.url, "encoder_tokens_total") > 0
        assert len(list(encoder_outputs.glob("*.safetensors"))) == 1
        computed = metric(prefill.url, "encoder_tokens_total")
        loaded = metric(prefill.url, "encoder_tokens_loaded_total")
        assert text_of(complete(router.url, body)) == reference
        assert metric(prefill.url, "encoder_tokens_total") == computed  # its tower did not run
        assert metric(prefill.url, "encoder_tokens_loaded_total") - loaded == metric(encoder.url, "encoder_tokens_total")
    finally:
        encoder.close()


# Last in the module: it kills the shared prefill instance (pytest runs a module's tests in file order).
def test_a_prefill_instance_killed_before_the_read(
    pd: tuple[ServerProcess, ServerProcess, PDRouterProcess], model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fail`: a clean error; `recompute`: the decode instance prefills it itself, with the colocated output.
    Nothing leaks on the decode side either way."""
    import psutil

    from mmserve.config import EngineArgs, KVTransferConfig
    from mmserve.engine.core import EngineCore
    from mmserve.request import Request, SamplingParams

    prefill = pd[0]
    try:
        prompts = {"fail": list(range(40, 90)), "recompute": list(range(90, 140))}
        answers = {}
        for policy, ids in prompts.items():
            body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
            response = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            answers[policy] = response.json()["kv_transfer_params"]
        assert prefill.proc is not None
        server = psutil.Process(prefill.proc.pid)
        family = [server, *server.children(recursive=True)]  # its engine core holds the KV and side channel
        # Killed together, none of them removes the engine's socket directory: the test does, once they are gone.
        sockets = {os.path.dirname(c.laddr) for p in family for c in p.net_connections(kind="unix") if c.laddr}
        for proc in family:
            proc.kill()
        psutil.wait_procs(family, timeout=30)
        for directory in sockets:
            if os.path.basename(directory).startswith("mmserve-"):
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        prefill.close()
    monkeypatch.setenv("UCX_TLS", UCX_TCP["UCX_TLS"])
    for policy, ids in prompts.items():
        config = KVTransferConfig(kv_role="kv_consumer", kv_load_failure_policy=policy,
                                  kv_connector_extra_config={"side_channel_host": "127.0.0.1",
                                                             "side_channel_port": free_port(), "kv_load_timeout": 2})  # fmt: skip
        core = EngineCore(EngineArgs(model=str(model), device="cpu", num_kv_blocks=64, kv_transfer_config=config))
        try:
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, kv_transfer=answers[policy])
            outputs = run_core(core, Request(f"{policy}-remote", ids, params))
            if policy == "fail":
                assert [o.finish_reason for o in outputs] == ["error"]
                assert "prefill instance" in (outputs[0].error or "")
            else:
                local = run_core(core, Request("local", ids, dataclasses.replace(params, kv_transfer=None)))
                tokens = [t for o in outputs for t in o.new_token_ids]
                assert len(tokens) == 6 and tokens == [t for o in local for t in o.new_token_ids]
            stats = core.stats()
            assert (stats.num_kv_loads_failed, stats.num_kv_loads_done) == (1, 0)
            assert not any(core.leak_report().values()), core.leak_report()
        finally:
            core.close()
