"""Service tiers and SLO targets end to end: the real server (tiny Qwen2-VL, scheduler policy `slo`)
maps OpenAI's `service_tier` to the scheduler's class, echoes the tier it served the request in (JSON,
every SSE chunk, WebSocket `response.done`, the stock `openai` package, the SDK), validates `slo`, counts
per-class metrics, downgrades under admission control, and answers an infeasible request with 429."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from websockets.sync.client import connect

from mmserve.api import ServerSettings, create_app
from mmserve.api.convert import service_class, service_tier
from mmserve.api.errors import from_engine_error
from mmserve.api.server import ServerThread
from mmserve.client import AsyncClient, Client, UnprocessableEntityError
from mmserve.client.chat import build_chat_body
from mmserve.config import EngineArgs
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.output_processor import RequestOutput
from mmserve.request import SLO, SamplingParams, ServiceClass
from mmserve.scheduler.slo import SloInfeasibleError
from mmserve.scheduler.step_time import MAX_ERROR_FACTOR

KEY = "sk-slo"
HELLO = [{"role": "user", "content": "Describe a red circle on a white background."}]
# Generous class defaults: no test request may be judged late because the shared CPU is slow.
TTFT_MS, TBT_MS = 600_000.0, 600_000.0


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": HELLO,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def slo_engine(model_dir: Path, admission_control: str, num_kv_blocks: int) -> AsyncEngine:
    """The tiny model under the slo policy with this module's class targets."""
    return AsyncEngine(
        EngineArgs(
            str(model_dir), max_num_batched_tokens=128, max_model_len=1024, num_kv_blocks=num_kv_blocks,
            scheduler_policy="slo", interactive_ttft_ms=TTFT_MS, interactive_tbt_ms=TBT_MS,
            admission_control=admission_control,
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[[str], Path]) -> Iterator[AsyncEngine]:
    engine = slo_engine(tiny_model_dir("qwen2_vl"), "downgrade", num_kv_blocks=128)
    yield engine
    asyncio.run(engine.shutdown(1.0))


@pytest.fixture(scope="module")
def server(engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = ServerSettings(
        api_key=KEY, data_dir=tmp_path_factory.mktemp("slo-data"), served_model_name="tiny"
    )
    live = ServerThread(lambda: create_app(engine, settings))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """The sum of the `mmserve:{name}` series whose labels include `labels` (0 when there is none yet)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in http.get("/metrics").text.splitlines()
        if line.startswith(f"mmserve:{name}{{") and all(w in line for w in wanted)
    )


def test_engine_args_reach_the_scheduler(engine: AsyncEngine) -> None:
    config = engine.info.scheduler_config  # as the core reports it in its handshake
    assert config.policy == "slo" and config.admission_control == "downgrade"
    assert config.interactive_slo == SLO(TTFT_MS, TBT_MS)


def test_arrival_time_and_scheduler_clock_agree(engine: AsyncEngine) -> None:
    """Deadlines are arrival_time + target on the scheduler's clock: both must be time.monotonic."""
    before = time.monotonic()
    request, _ = engine.processor.process("Hello", SamplingParams(max_tokens=1), "clock-check")
    assert before <= request.arrival_time <= time.monotonic()
    # The core's process stamps its clock too: time.monotonic is one clock for every process on a host.
    import subprocess
    import sys

    other = float(subprocess.run([sys.executable, "-c", "import time; print(time.monotonic())"],
                                 capture_output=True, text=True, check=True).stdout)  # fmt: skip
    assert request.arrival_time <= other <= time.monotonic()


def test_flex_is_scheduled_as_batch_and_echoed(http: httpx.Client) -> None:
    batch_before = metric(http, "finished_requests_by_class_total", service_class="batch")
    chat_before = metric(http, "finished_requests_by_class_total", service_class="interactive")
    judged_before = metric(http, "slo_attainment_total", service_class="batch")
    r = http.post("/v1/chat/completions", json=body(service_tier="flex"))
    assert r.status_code == 200, r.text
    assert r.json()["service_tier"] == "flex"
    assert metric(http, "finished_requests_by_class_total", service_class="batch") == batch_before + 1
    assert metric(http, "finished_requests_by_class_total", service_class="interactive") == chat_before
    # The batch class has no default targets: nothing to attain, nothing counted.
    assert metric(http, "slo_attainment_total", service_class="batch") == judged_before


@pytest.mark.parametrize(("tier", "echo"), [(None, "default"), ("auto", "default"), ("default", "default"),
                                            ("priority", "priority")])  # fmt: skip
def test_other_tiers_are_interactive(http: httpx.Client, tier: str | None, echo: str) -> None:
    before = metric(http, "finished_requests_by_class_total", service_class="interactive")
    met = metric(http, "slo_attainment_total", service_class="interactive", slo="ttft", outcome="met")
    good = metric(http, "good_requests_total", service_class="interactive")
    r = http.post("/v1/chat/completions", json=body(**({"service_tier": tier} if tier else {})))
    assert r.status_code == 200, r.text
    assert r.json()["service_tier"] == echo
    assert metric(http, "finished_requests_by_class_total", service_class="interactive") == before + 1
    assert (
        metric(http, "slo_attainment_total", service_class="interactive", slo="ttft", outcome="met")
        == met + 1
    )
    assert metric(http, "good_requests_total", service_class="interactive") == good + 1
    assert metric(http, "time_per_output_token_seconds_count", service_class="interactive") >= 1


def test_every_sse_chunk_echoes_the_tier(http: httpx.Client) -> None:
    chunks = []
    request = body(service_tier="flex", stream=True, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=request) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    assert len(chunks) >= 3  # role, deltas, usage
    assert all(c["service_tier"] == "flex" for c in chunks)


def test_admission_control_downgrade_echoes_flex(http: httpx.Client) -> None:
    # A 1 µs TTFT target: no prefill can meet it (the step-time model's intercept alone exceeds it),
    # so admission control "downgrade" runs the chat as batch, and the response says so.
    downgraded = metric(http, "downgraded_requests_total")
    r = http.post("/v1/chat/completions", json=body(slo={"ttft_ms": 0.001}))
    assert r.status_code == 200, r.text
    assert r.json()["service_tier"] == "flex"
    assert metric(http, "downgraded_requests_total") == downgraded + 1
    # Judged against its own target, in the class it ran in.
    assert metric(http, "slo_attainment_total", service_class="batch", slo="ttft", outcome="missed") >= 1


@pytest.mark.parametrize(
    ("slo", "param"),
    [
        ({"ttft_ms": -1}, "slo.ttft_ms"),
        ({"tbt_ms": 0}, "slo.tbt_ms"),
        ({"deadline_ms": "soon"}, "slo.deadline_ms"),
        ({"ttft": 100}, "slo.ttft"),  # misspelt: refused, not dropped
        ([100], "slo"),
    ],
)
def test_slo_is_validated(http: httpx.Client, slo: Any, param: str) -> None:
    r = http.post("/v1/chat/completions", json=body(slo=slo))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_unknown_service_tier_is_refused(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=body(service_tier="turbo"))
    assert r.status_code == 422 and r.json()["error"]["param"] == "service_tier"


def test_stock_openai_package(server: ServerThread) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    done = oai.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, service_tier="flex")
    assert done.service_tier == "flex"
    stream = oai.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, stream=True)
    assert {chunk.service_tier for chunk in stream} == {"default"}


def test_websocket_response_create(server: ServerThread) -> None:
    with connect(server.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert json.loads(ws.recv(timeout=60))["type"] == "session.created"
        for tier, slo, expected in (("flex", None, "flex"), (None, {"tbt_ms": 50_000}, "default")):
            response = {"messages": HELLO, "max_tokens": 3, "service_tier": tier, "slo": slo}
            ws.send(json.dumps({"type": "response.create", "response": response}))
            while (event := json.loads(ws.recv(timeout=120)))["type"] != "response.done":
                assert event["type"] != "error", event
            assert event["response"]["status"] in ("completed", "incomplete")  # stop or max_tokens
            assert event["response"]["service_tier"] == expected
        ws.send(
            json.dumps({"type": "response.create", "response": {"messages": HELLO, "slo": {"ttft_ms": 0}}})
        )
        event = json.loads(ws.recv(timeout=60))
        assert event["type"] == "error" and event["error"]["param"].endswith("slo.ttft_ms")


def test_sdk_client(server: ServerThread) -> None:
    with Client(server.url, api_key=KEY, timeout=120) as client:
        done = client.chat.completions.create(
            messages=HELLO, max_tokens=3, service_tier="flex", slo={"deadline_ms": 600_000}
        )
        assert done.service_tier == "flex"
        with client.chat.completions.create(
            messages=HELLO, max_tokens=3, stream=True, slo={"ttft_ms": 5e5}
        ) as s:
            assert {chunk.service_tier for chunk in s} == {"default"}
        with pytest.raises(UnprocessableEntityError):
            client.chat.completions.create(messages=HELLO, max_tokens=3, slo={"ttft_ms": -5})
        with client.chat.session() as session:
            result = session.send(HELLO, max_tokens=3, service_tier="flex", slo={"tbt_ms": 1e5}).wait(
                timeout=120
            )
        assert result.status in ("completed", "incomplete") and result.service_tier == "flex"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_sdk_async_client(server: ServerThread) -> None:
    async with AsyncClient(server.url, api_key=KEY, timeout=120) as client:
        done = await client.chat.completions.create(messages=HELLO, max_tokens=3, service_tier="priority")
        assert done.service_tier == "priority"
        stream = await client.chat.completions.create(
            messages=HELLO, max_tokens=3, stream=True, service_tier="flex"
        )
        async with stream:
            assert {chunk.service_tier async for chunk in stream} == {"flex"}
        async with client.chat.session() as session:
            handle = await session.send(HELLO, max_tokens=3, service_tier="flex")
            result = await handle.wait(timeout=120)
        assert result.status in ("completed", "incomplete") and result.service_tier == "flex"


# -- pure pieces ------------------------------------------------------------------------------------


def test_sdk_body_carries_tier_and_slo() -> None:
    sent = build_chat_body(
        HELLO, False, {"service_tier": "flex", "slo": {"ttft_ms": 200.0}, "priority": None}
    )
    assert sent["service_tier"] == "flex" and sent["slo"] == {"ttft_ms": 200.0} and "priority" not in sent


def test_tier_mapping() -> None:
    assert service_class("flex") == ServiceClass.BATCH
    assert {service_class(t) for t in (None, "auto", "default", "priority")} == {ServiceClass.INTERACTIVE}
    served_batch = RequestOutput("r", None, [1], service_class=ServiceClass.BATCH)
    assert service_tier("priority", served_batch) == "flex"  # a downgrade is echoed as flex
    assert service_tier("auto", RequestOutput("r", None, [1])) == "default"


def test_infeasible_is_a_429_with_openai_shape() -> None:
    err = from_engine_error(SloInfeasibleError("cannot meet it"))
    assert err.status == 429 and err.type == "rate_limit_error" and err.code == "slo_infeasible"
    assert json.loads(err.response().body)["error"]["message"] == "cannot meet it"
    assert err.headers == {"Retry-After": "1"}
    assert from_engine_error(SloInfeasibleError("later", retry_after_s=7.2)).headers == {"Retry-After": "8"}
    assert from_engine_error(SloInfeasibleError("never", retry_after_s=None)).headers is None  # no retry would do


def test_serve_flags_reach_engine_args() -> None:
    import argparse

    from mmserve.cli import _add_slo_flags, _slo_engine_kwargs

    parser = argparse.ArgumentParser()
    _add_slo_flags(parser)
    args = parser.parse_args(["--interactive-ttft-ms", "500", "--interactive-tbt-ms", "0",
                              "--slo-admission", "reject", "--step-time-headroom", "0.3",
                              "--max-step-ms", "0"])  # fmt: skip
    engine_args = EngineArgs("unused", scheduler_policy="slo", **_slo_engine_kwargs(args))
    config = engine_args.scheduler_config(1024)
    assert config.interactive_slo == SLO(500.0, None)  # 0: no target
    assert config.admission_control == "reject" and config.step_time_headroom == 0.3
    assert config.max_step_ms is None  # 0: fixed token budgets only
    assert EngineArgs("unused").scheduler_config(1024).max_step_ms == 250.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--admission-control", "maybe"])


def test_step_time_model_path_is_checked_at_start(tmp_path: Path) -> None:
    from mmserve.errors import InvalidRequestError
    from mmserve.scheduler.step_time import StepTimeModel

    with pytest.raises(InvalidRequestError, match="step_time_model"):
        EngineArgs("unused", scheduler_policy="slo", step_time_model=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(InvalidRequestError, match="step_time_model"):
        EngineArgs("unused", scheduler_policy="slo", step_time_model=str(tmp_path / "bad.json"))
    good = tmp_path / "good.json"
    StepTimeModel({"intercept": 0.01, "new_tokens": 0.001}).save(good)
    config = EngineArgs("unused", scheduler_policy="slo", step_time_model=str(good)).scheduler_config(64)
    assert config.step_time_model == str(good)


def test_admission_reject_is_a_429_through_the_api(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """`--slo-admission reject` on a real server (the engine core in its own process): a chat whose TTFT
    target cannot be met even alone (1 µs) is refused with 429 and code slo_infeasible before anything is
    queued, and without Retry-After, since no retry could succeed; the others are served, and /metrics
    counts the refusal and shows the online step-time model's record."""
    engine = slo_engine(tiny_model_dir("qwen2_vl"), "reject", num_kv_blocks=64)
    settings = ServerSettings(data_dir=tmp_path, served_model_name="tiny")
    live = ServerThread(lambda: create_app(engine, settings))
    try:
        with httpx.Client(base_url=live.url, timeout=120) as client:
            assert client.post("/v1/chat/completions", json=body()).status_code == 200
            r = client.post("/v1/chat/completions", json=body(slo={"ttft_ms": 0.001}))
            assert r.status_code == 429, r.text
            assert "Retry-After" not in r.headers
            error = r.json()["error"]
            assert error["code"] == "slo_infeasible" and error["param"] == "slo"
            assert "even on an idle engine" in error["message"]
            assert client.post("/v1/chat/completions", json=body()).status_code == 200  # still serving
            assert metric(client, "rejected_requests_total") == 1
            assert metric(client, "step_time_observations_total") >= 2
            assert metric(client, "step_time_observed_seconds_total") > 0
            assert metric(client, "step_time_predicted_seconds_total") > 0
            assert 1.0 <= metric(client, "step_time_error_factor") <= MAX_ERROR_FACTOR  # the margin, capped
            assert metric(client, "num_requests_waiting") == 0 and metric(client, "num_requests_running") == 0
    finally:
        live.stop()
        asyncio.run(engine.shutdown(1.0))
