"""mmserve replicas behind the real vllm-router (PyPI), all on loopback: routing of chat and streams, what a
router reads of a replica (health, vLLM's gauge names, KV events in vLLM's format), prefix-aware routing by
those signals, and a replica killed mid-run and restarted. Two replicas (separate processes) serve the whole
module; each test starts its own router (a Rust binary: it starts in well under a second)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmserve.bench.load import send_http
from mmserve.bench.metrics import RequestTiming
from mmserve.bench.router import (
    SERVED_MODEL_NAME,
    FamilyRequest,
    RouterProcess,
    family_stickiness,
    last_full_block,
    running,
)
from mmserve.bench.workload import Request
from tests.router_harness import KVEventLog, Replica

pytest.importorskip("vllm_router", reason="vllm-router is not installed (the test extra installs it)")

pytestmark = pytest.mark.timeout(600)
BLOCK = 16
NUM_KV_BLOCKS = 512


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen2_vl")


@pytest.fixture(scope="module")
def replicas(model: Path) -> Iterator[list[Replica]]:
    with running([Replica(model, NUM_KV_BLOCKS, BLOCK) for _ in range(2)]) as started:
        yield started


@pytest.fixture
def events(replicas: list[Replica]) -> Iterator[KVEventLog]:
    with contextlib.closing(KVEventLog(replicas)) as log:
        log.wait_for_snapshots()  # subscribed: the log starts from the replicas' real state
        yield log


def metrics(url: str) -> dict[str, float]:
    """Every sample of a replica's /metrics, summed over labels, by sample name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def finished(url: str) -> float:
    return metrics(url).get("mmserve:request_success_total", 0.0)


def chat(text: str, max_tokens: int = 4, system: str | None = None, image: str | None = None) -> dict:
    content: str | list[dict] = text
    if image is not None:
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def words(rng: random.Random, n: int) -> str:
    vocabulary = "red blue green square circle triangle small large image frame shape color count the of".split()
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def prompt_tokens(url: str, body: dict) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"model": SERVED_MODEL_NAME, "messages": body["messages"]}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def text_families(seed: int, num_families: int, per_family: int) -> list[FamilyRequest]:
    """Families sharing a system prompt (about 100 tokens); each request has a numbered text of its own."""
    rng = random.Random(seed)
    systems = [f"Family {seed}-{f}. " + words(rng, 90) for f in range(num_families)]
    out = [
        FamilyRequest(f, Request(chat(f"Request {seed}-{f}-{i}: " + words(rng, 40), system=s)["messages"], 4))
        for f, s in enumerate(systems)
        for i in range(per_family)
    ]
    rng.shuffle(out)
    return out


def served_by(log: KVEventLog, url: str, requests: list[FamilyRequest]) -> list[list[str]]:
    blocks = [last_full_block(prompt_tokens(url, {"messages": fr.request.messages}), BLOCK) for fr in requests]
    return log.wait_for_blocks(blocks)


async def run_all(url: str, requests: list[FamilyRequest], concurrency: int) -> list[RequestTiming]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:

        async def one(fr: FamilyRequest) -> RequestTiming:
            async with sem:
                return await send_http(client, url, fr.request, {})

        return await asyncio.gather(*(one(fr) for fr in requests))


# -- what a router reads of a replica ----------------------------------------------------------------------


def test_a_replica_answers_health_and_vllms_gauge_names(replicas: list[Replica]) -> None:
    url = replicas[0].url
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/live").status_code == 200
    text = httpx.get(url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        (ours,), (theirs,) = families["mmserve:" + name].samples, families["vllm:" + name].samples
        assert ours.value == theirs.value and theirs.labels == {"model_name": SERVED_MODEL_NAME, "engine": "0"}
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels["block_size"] == str(BLOCK) and info.labels["num_gpu_blocks"] == str(NUM_KV_BLOCKS)
    assert info.labels["enable_prefix_caching"] == "True"


def test_kv_events_announce_exactly_the_prompt_blocks_the_allocator_hashed(
    replicas: list[Replica], events: KVEventLog
) -> None:
    """A multimodal request straight to one replica: its KV events carry every full prompt block (token ids as
    /tokenize gives them, placeholders expanded), the image's mm_hash on the blocks it overlaps, and hashes
    that follow from tokens, keys and parent with the allocator's own chain hash."""
    import numpy as np

    from mmserve.bench.workload import image_data_url

    url = replicas[0].url
    image = image_data_url(np.random.default_rng(11), 64)
    body = chat("Describe the shapes in this picture in a few words, please.", system="You look at pictures.",
                image=image)  # fmt: skip
    before = events.snapshot(url)
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tokens = prompt_tokens(url, body)
    num_full = (len(tokens) - 1) // BLOCK  # the block of the last prompt token is not registered yet
    prompt_blocks = {tuple(tokens[i * BLOCK : (i + 1) * BLOCK]) for i in range(num_full)}
    events.wait_for_blocks(sorted(prompt_blocks))
    after = events.snapshot(url)
    new_blocks = after.stored_blocks - before.stored_blocks
    assert prompt_blocks <= after.stored_blocks and new_blocks, "a prompt block was not announced"
    assert after.chains_ok, "a BlockStored hash does not follow from its tokens, media keys and parent"
    assert after.num_decode_errors == 0
    assert after.last_seq is not None and after.num_batches > before.num_batches
    assert after.held >= set(after.stored_hashes[len(before.stored_hashes) :])  # nothing evicted at 512 blocks
    # The other replica computed nothing of it.
    other = events.snapshot(replicas[1].url)
    assert not prompt_blocks & other.stored_blocks


def test_power_of_two_reads_each_replicas_load(replicas: list[Replica]) -> None:
    """vllm-router's power_of_two polls GET /get_load on every worker (-1 when a worker lacks it)."""
    url = replicas[0].url
    assert httpx.get(url + "/get_load").json() == {"load": 0, "num_requests_running": 0, "num_requests_waiting": 0}
    router = RouterProcess("power_of_two", replicas)
    try:
        # A stream long enough to be running at the router's next poll (about once a second); on a machine fast
        # enough to finish it first, another one, a few times.
        body = {**chat("a long answer", max_tokens=3000), "ignore_eos": True, "stream": True}
        seen: dict = {}
        for _ in range(5):
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as stream:
                lines = stream.iter_lines()  # kept: a dropped iterator closes the stream (the server then aborts)
                next(lines)  # running on the first replica now
                while httpx.get(url + "/get_load").json()["load"] == 1:
                    workers = httpx.get(router.url + "/get_loads", timeout=5).json()["workers"]
                    loads = {w["worker"]: w["load"] for w in workers}
                    if loads.get(url) == 1:
                        seen = loads
                        break
                    time.sleep(0.1)
            if seen:
                break
        assert seen == {url: 1, replicas[1].url: 0}, seen
        r = httpx.post(router.url + "/v1/chat/completions", json=chat("hi"), timeout=60)
        assert r.status_code == 200
    finally:
        router.close()


# -- routing -----------------------------------------------------------------------------------------------


def test_round_robin_forwards_chat_and_streams_to_both_replicas(replicas: list[Replica]) -> None:
    import json

    counts = [finished(r.url) for r in replicas]
    router = RouterProcess("round_robin", replicas)
    try:
        for i in range(4):
            r = httpx.post(router.url + "/v1/chat/completions", json=chat(f"hello {i}"), timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=60,
                          json={**chat("stream please", max_tokens=6), "stream": True}) as r:  # fmt: skip
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        models = httpx.get(router.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [SERVED_MODEL_NAME]
    finally:
        router.close()
    served = [finished(r.url) - c for r, c in zip(replicas, counts, strict=True)]
    assert sum(served) == 5 and min(served) >= 2, served


def test_cache_aware_keeps_each_prefix_family_on_one_replica_under_concurrency(
    replicas: list[Replica], events: KVEventLog
) -> None:
    requests = text_families(seed=1, num_families=4, per_family=5)
    router = RouterProcess("cache_aware", replicas)
    try:
        timings = asyncio.run(run_all(router.url, requests, concurrency=4))
    finally:
        router.close()
    assert all(t.success for t in timings), [t.error for t in timings if not t.success]
    served = served_by(events, replicas[0].url, requests)
    assert all(len(s) == 1 for s in served), "a request's own block was computed on no replica, or on both"
    assert family_stickiness([fr.family for fr in requests], served) >= 0.9
    assert len({s[0] for s in served}) == 2, "every family on one replica: no balance at all"


def test_kv_aware_routes_each_family_to_the_replica_whose_kv_events_hold_its_prefix(
    replicas: list[Replica], events: KVEventLog
) -> None:
    """Each family's prefix is put on a replica of the test's choosing, straight to that replica and before the
    router starts (a router restarted after the caches filled): only the cache snapshot each replica sends a
    new subscriber can tell the router where each prefix is."""
    requests = text_families(seed=2, num_families=4, per_family=4)
    home = {f: replicas[(f + 1) % 2].url for f in range(4)}  # family 0 on the second replica: no tie-break luck
    warm: dict[int, FamilyRequest] = {}
    for fr in requests:
        warm.setdefault(fr.family, fr)
    rest = [fr for fr in requests if warm[fr.family] is not fr]
    for family, fr in warm.items():
        body = {"model": SERVED_MODEL_NAME, "messages": fr.request.messages, "max_tokens": 1}
        assert httpx.post(home[family] + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    homes = served_by(events, replicas[0].url, list(warm.values()))
    assert homes == [[home[f]] for f in warm], "the warm-up prefixes are not where the test put them"
    cleared = events.num_cleared()
    router = RouterProcess("kv_aware", replicas)
    try:
        events.wait_for_snapshots(cleared)  # sent to every subscriber when the router's subscription arrived
        time.sleep(0.3)  # and applied by the router
        for fr in rest:  # one at a time: equal load, so only the prefix decides
            timing = asyncio.run(run_all(router.url, [fr], concurrency=1))[0]
            assert timing.success, timing.error
            time.sleep(0.2)  # this request's blocks reach the router before the next decision
    finally:
        router.close()
    served = served_by(events, replicas[0].url, rest)
    assert served == [[home[fr.family]] for fr in rest]


# -- faults ------------------------------------------------------------------------------------------------


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_a_killed_replica_fails_only_its_own_streams_and_rejoins_when_restarted(replicas: list[Replica]) -> None:
    router = RouterProcess("round_robin", replicas, extra_args=("--retry-max-retries", "5"))
    try:
        # A long stream through the router, then its replica dies under it: the client sees the stream end.
        body = {**chat("tell me a long story", max_tokens=400), "stream": True, "ignore_eos": True}
        result: dict = {}

        async def stream_until_it_ends() -> None:
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
                try:
                    async with client.stream("POST", router.url + "/v1/chat/completions", json=body) as r:
                        result["status"] = r.status_code
                        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                        result["done"] = bool(lines) and lines[-1] == "data: [DONE]"
                except httpx.HTTPError as exc:
                    result["error"] = type(exc).__name__

        async def kill_the_stream_s_replica() -> Replica:
            task = asyncio.create_task(stream_until_it_ends())
            holder = None
            for _ in range(200):
                await asyncio.sleep(0.05)
                running = [metrics(r.url).get("mmserve:num_requests_running", 0.0) for r in replicas]
                if max(running) >= 1:
                    holder = replicas[running.index(max(running))]
                    break
            assert holder is not None, "the stream never started on a replica"
            children = _descendants(holder.pid)
            holder.kill()
            await asyncio.wait_for(task, 30)  # never a hang
            _, alive = psutil.wait_procs(children, timeout=15)
            assert not alive, f"processes of the killed replica outlived it: {alive}"
            return holder

        killed = asyncio.run(kill_the_stream_s_replica())
        assert not result.get("done"), "a stream whose replica died must not end as if complete"
        survivor = replicas[0] if killed is replicas[1] else replicas[1]
        victim = killed

        # Traffic goes on: the router retries around the dead replica and then stops sending it anything.
        before = finished(survivor.url)
        rng = random.Random(3)
        requests = [FamilyRequest(0, Request(chat(words(rng, 12))["messages"], 4)) for _ in range(100)]
        timings = asyncio.run(run_all(router.url, requests, concurrency=2))
        ok = sum(t.success for t in timings)
        assert ok >= 99, [t.error for t in timings if not t.success][:5]
        assert finished(survivor.url) - before >= ok

        # Restarted on the same ports, it rejoins: the router sends it requests again.
        victim.start()
        deadline = time.monotonic() + 30
        served = 0.0
        while time.monotonic() < deadline and served == 0:
            for _ in range(4):
                r = httpx.post(router.url + "/v1/chat/completions", json=chat("back again"), timeout=60)
                assert r.status_code == 200, r.text
            served = finished(victim.url)
        assert served > 0, "the restarted replica never got a request from the router"
    finally:
        router.close()
        for replica in replicas:  # leave the module's replicas as they were
            if replica.server is None:
                replica.start()


def test_bench_serve_runs_through_the_router_and_sums_every_replicas_caches(
    replicas: list[Replica], model: Path
) -> None:
    """`mmserve bench serve --url ROUTER --metrics-url R1 --metrics-url R2`: the cache figures are the sum of
    what every replica's counters did over the run (a router answers /metrics from one replica only)."""
    from mmserve.bench import ServeBenchConfig
    from mmserve.bench.serve import bench_serve

    def queries() -> float:
        return sum(metrics(r.url).get("mmserve:prefix_cache_queries_total", 0.0) for r in replicas)

    router = RouterProcess("round_robin", replicas)
    try:
        before = queries()
        cfg = ServeBenchConfig(url=router.url, transports=("http",), num_prompts=6, input_len=(8, 24),
                               output_len=(2, 4), metrics_url=tuple(r.url for r in replicas))  # fmt: skip
        report = bench_serve(model, cfg, progress=False)
        total = queries() - before
    finally:
        router.close()
    figures = report["results"]["http"]
    assert figures["completed"] == 6 and figures["failed"] == 0
    warm_up = total - figures["server_prefix_cache_queries"]  # the tool's one warm-up request, not counted
    assert figures["server_prefix_cache_queries"] > 0 and 0 < warm_up < total
    assert "engine_core_loop" not in figures  # one core's loop is not the system's
